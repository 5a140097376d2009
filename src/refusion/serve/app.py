"""The OpenAI-compatible HTTP API: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.

`create_app(model, tokenizer, ...)` builds a FastAPI app around one `Scheduler` (the decoding thread).
A request is handled in four phases: 1. validate the body (pydantic, `schemas.py`), 2. build its decoding
settings (server defaults < request fields < the `"refusion"` extension object) and token ids, 3. submit
its jobs to the scheduler (one per prompt and choice), 4. relay the scheduler's events, as server-sent events
when `stream` is true, else collected into one response. Every error is an OpenAI-style body
`{"error": {...}}`; every generation request is counted in the app's Prometheus metrics (`metrics.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from refusion.config import (
    STRATEGIES,
    ConfigError,
    DecodeConfig,
    ignored_settings,
    layered_settings,
    owner_of,
)
from refusion.serve.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
from refusion.serve.scheduler import (
    DECODING_FAILED,
    SHUTTING_DOWN,
    Draining,
    Event,
    Job,
    PublishedLogprob,
    QueueFull,
    Scheduler,
    SchedulerStopped,
)
from refusion.serve.schemas import (
    OPENAI_NAMES,
    ChatCompletionRequest,
    CompletionRequest,
    UnsupportedValue,
    error_body,
    new_id,
    now,
)

log = logging.getLogger("refusion.serve")

ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}
ERROR_STATUS = {DECODING_FAILED: 500, SHUTTING_DOWN: 503}
"""HTTP status of an error event, by its code."""
CLIENT_CLOSED_REQUEST = 499
"""Status recorded (and, for a non-streamed request, answered) when the client left first (nginx's code)."""
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.25
MAX_BODY_BYTES = 8 << 20
"""Larger bodies are refused (413) before they are parsed or tokenized."""


class ApiError(Exception):
    """An error answered with an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        body = error_body(self.message, type=ERROR_TYPES.get(self.status, "invalid_request_error"),
                          param=self.param, code=self.code)
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class Server:
    """What the handlers share."""

    model: object
    tokenizer: object
    config: DecodeConfig
    """Server defaults; each request may override fields."""
    model_name: str
    scheduler: Scheduler
    created: int
    metrics: ServerMetrics

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)


def create_app(model, tokenizer, *, config: DecodeConfig | None = None, model_name: str = "refusion",
               max_batch_size: int = 8, max_queue: int = 64) -> FastAPI:
    """A FastAPI app serving `model`; its scheduler thread starts and stops with the app (lifespan)."""
    config = config or DecodeConfig()
    _check_model_fits(model, config)
    metrics = ServerMetrics()
    scheduler = Scheduler(model, tokenizer, max_batch_size=max_batch_size, max_queue=max_queue, observer=metrics)
    metrics.watch(queue_depth=lambda: len(scheduler.waiting), batch_size=lambda: len(scheduler.live))
    server = Server(model, tokenizer, config, model_name, scheduler, now(), metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="refusion", description="OpenAI-compatible ReFusion server", lifespan=lifespan)
    app.state.server = server
    _add_error_handlers(app)
    _add_routes(app, server)
    _document_request_bodies(app)
    return app


def _check_model_fits(model, config: DecodeConfig) -> None:
    """Fail at startup, not on the first request, when the default strategy cannot run on this model."""
    from refusion.model.setup import setup_of
    setup_of(model).special_tokens.for_decoding(config)


# ------------------------------------------------------------------------------------------ routes
def _add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/health")
    async def health():
        status = server.scheduler.status()
        ok = status["running"] and not status["draining"]
        word = "ok" if ok else "draining" if status["draining"] else "unavailable"
        return JSONResponse({"status": word, "model": server.model_name, **status}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response,
             responses={200: {"content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}})
    async def metrics():
        """Prometheus metrics (text exposition format), docs/SERVING.md."""
        return Response(server.metrics.exposition(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card(server)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        _check_model_name(server, name)
        return _model_card(server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _answer(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _answer(server, request, chat=False)


REQUEST_SCHEMAS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def _document_request_bodies(app: FastAPI) -> None:
    """Put the request schemas in the OpenAPI document (the handlers parse their bodies themselves, so FastAPI
    does not see them); clients and schema-driven fuzzers (tests/serve/test_fuzz.py) read them there."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_SCHEMAS.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


async def _answer(server: Server, request: Request, *, chat: bool):
    """Parse, tokenize and generate; the request is counted by the status it ends with."""
    timer = RequestTimer(server.metrics)
    try:
        body = await _parse(request, ChatCompletionRequest if chat else CompletionRequest)
        timer.strategy = _strategy(server, body)
        _check_model_name(server, body.model)
        with server.scheduler.tokenizer_lock:
            if chat:
                prompts = [_encode_chat(server.tokenizer, body.chat_messages())]
            else:
                prompts = [p if isinstance(p, list) else server.tokenizer(p)["input_ids"] for p in body.prompts()]
        response = await _generate(server, request, body, prompts, chat=chat, timer=timer)
    except ApiError as e:
        timer.finish(e.status)
        raise
    except Exception:
        timer.finish(500)
        raise
    if not isinstance(response, StreamingResponse):  # a stream is counted when it ends
        timer.finish(response.status_code)
    return response


def _strategy(server: Server, body) -> str:
    """The request's strategy, as a metrics label (an invalid one is refused later; it is not a label value)."""
    chosen = body.refusion.strategy if body.refusion is not None else None
    chosen = chosen or server.config.strategy
    return chosen if chosen in STRATEGIES else "unknown"


async def _parse(request: Request, schema: type[BaseModel]):
    """The JSON body as `schema` (whatever the Content-Type says, as curl -d sends form-encoded)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None


def _model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "refusion",
            "max_model_len": server.context_length}


def _check_model_name(server: Server, name: str) -> None:
    if name != server.model_name:
        raise ApiError(404, f"The model `{name}` does not exist: this server serves `{server.model_name}`",
                       param="model", code="model_not_found")


def _encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template itself may refuse a conversation (roles out of order, ...)
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


# ------------------------------------------------------------------------------------------ generation
async def _generate(server: Server, request: Request, body, prompts: list[list[int]], *, chat: bool,
                    timer: RequestTimer):
    # 1. decoding settings and jobs (validated before anything is queued)
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def emitter(index: int):
        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
        return emit

    _check_fits_scheduler(server, len(prompts), body.choices_per_prompt())
    jobs = _build_jobs(server, body, prompts, [emitter(i) for i in range(len(prompts) * body.choices_per_prompt())])

    # 2. queue them
    try:
        server.scheduler.submit(jobs)
    except QueueFull as e:
        raise ApiError(503, str(e), code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
    except Draining as e:
        raise ApiError(503, str(e), code=SHUTTING_DOWN) from None
    except SchedulerStopped as e:
        raise ApiError(503, str(e), code="unavailable") from None
    timer.queued = True

    # 3. relay the events
    reply = Reply(server, body, prompts, chat)
    if body.stream:
        return StreamingResponse(_stream(server, request, jobs, events, reply, timer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await _collect(request, jobs, events, reply)
    finally:
        for job in jobs:
            server.scheduler.cancel(job)  # no-op for finished jobs; frees the rows of a client that left


def _check_fits_scheduler(server: Server, prompts: int, n: int) -> None:
    """A request that could never be queued (its choices are submitted all or none) is a 400, not a 503 forever."""
    capacity = server.scheduler.capacity
    if prompts * n > capacity:
        raise ApiError(400, f"this request needs {prompts * n} sequences ({prompts} prompt(s) x n={n}) but the "
                            f"server holds at most {capacity} (max_batch_size + max_queue); lower n or send fewer "
                            "prompts", param="n" if n > 1 else "prompt")


def _build_jobs(server: Server, body, prompts: list[list[int]], emits) -> list[Job]:
    """n jobs per prompt (choice index = prompt index * n + j, as OpenAI orders them). Prompts are validated
    here, so that a bad one is a 400 naming its field before anything is queued (`Decoder.add` checks again
    when the scheduler admits the job); the decoder seeds each sequence's generator with seed + its choice
    index (at random when the request gives no seed)."""
    from refusion.decode.loop import validate_prompts
    from refusion.model.setup import setup_of

    n, jobs = body.choices_per_prompt(), []
    for p, prompt in enumerate(prompts):
        cfg = _request_config(server, body, len(prompt))
        try:
            tokens = setup_of(server.model).special_tokens.for_decoding(cfg)
            mask_id, eos_ids = tokens.mask_token_id, list(tokens.eos_token_ids)
            validate_prompts(server.model, [prompt], cfg, mask_id, first_index=p)
        except ValueError as e:
            prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            too_long_param = prompt_param if body.requested_tokens() is None else "max_tokens"
            raise _config_error(e, prompt_param, too_long_param) from None
        if body.refusion is not None and body.refusion.ignore_eos:
            eos_ids = []
        grammar = _response_grammar(server, body, cfg, eos_ids)
        for index in range(p * n, (p + 1) * n):
            jobs.append(Job(prompt, cfg, mask_id, eos_ids, emits[index], stops=body.stop_strings(), index=index,
                            grammar=grammar))
    return jobs


def _response_grammar(server: Server, body, cfg: DecodeConfig, eos_ids: list[int]):
    """The compiled grammar of the request's response_format (None for none or "text"); a strategy that cannot
    honour it, or a schema the grammar engine cannot compile, is a 400 naming the field."""
    if body.response_format is None or body.response_format.type == "text":
        return None
    try:
        from refusion.decode.grammar import ResponseGrammar, UnsupportedStrategy, check_strategy
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise ApiError(400, "response_format needs llguidance (pip install 'refusion[serve]')",
                       param="response_format") from None
    try:
        check_strategy(cfg.strategy)
        vocab_size = server.model.config.get_text_config().vocab_size
        with server.scheduler.tokenizer_lock:
            return ResponseGrammar.compile(server.tokenizer, body.response_format.as_dict(), vocab_size, eos_ids)
    except UnsupportedStrategy as e:
        raise ApiError(400, str(e), param="refusion.strategy") from None
    except (ValueError, ImportError) as e:
        raise ApiError(400, str(e), param="response_format") from None


def _request_config(server: Server, body, prompt_length: int) -> DecodeConfig:
    """Server defaults, then the request's standard fields, then its `"refusion"` object."""
    changes = {}
    if body.requested_tokens() is not None:
        changes["max_new_tokens"] = body.requested_tokens()
    if body.temperature is not None:
        changes["temperature"] = float(body.temperature)
    if body.seed is not None:
        changes["seed"] = body.seed
    if body.logprobs_wanted() is not None:
        changes["logprobs"] = body.logprobs_wanted()
    if body.refusion is not None:
        changes.update(body.refusion.overrides())
    try:
        settings = layered_settings(server.config.to_dict(), explicit=changes)
        _refuse_ignored(changes, settings.get("strategy", server.config.strategy))
        cfg = DecodeConfig(**settings)
    except ValueError as e:
        raise _config_error(e, None, None) from None
    if body.requested_tokens() is None:  # the server default may not fit after a long prompt: shorten it
        cfg = _fit_default_length(server, cfg, prompt_length)
    return cfg


def _fit_default_length(server: Server, cfg: DecodeConfig, prompt_length: int) -> DecodeConfig:
    context = server.context_length
    if context is None:
        return cfg
    step = cfg.slot_size if cfg.strategy == "refusion" else 1
    room = (context - prompt_length) // step * step
    return cfg.replace(max_new_tokens=room) if 1 <= room < cfg.max_new_tokens else cfg


def _refuse_ignored(changes: dict, strategy: str) -> None:
    """A request's setting that its strategy never reads is a 400 naming it (a client cannot see a server's
    warnings, so what the Python API and the CLI warn about, the server refuses)."""
    for name, value in ignored_settings(changes, strategy).items():
        raise ConfigError(name, value, f"strategy={strategy!r} never reads it (only strategy={owner_of(name)!r} "
                                       "does): leave it out")


def _config_error(e: ValueError, prompt_param: str | None, too_long_param: str | None) -> ApiError:
    """A DecodeConfig / engine ValueError as a 400 naming the request field, by the error's type."""
    from refusion.decode.loop import PromptTooLong
    from refusion.model.special_tokens import MissingMaskToken

    message = str(e).replace("max_new_tokens", "max_tokens")
    if isinstance(e, ConfigError):
        param = OPENAI_NAMES.get(e.field, f"refusion.{e.field}")
    elif isinstance(e, MissingMaskToken):
        param = "refusion.strategy"
        message += " (this model can only be served with strategy 'autoregressive')"
    elif isinstance(e, PromptTooLong):
        param = too_long_param
    else:
        param = prompt_param
    return ApiError(400, message, param=param)


class Reply:
    """Builds the response objects (chat or text completion, whole or chunked)."""

    def __init__(self, server: Server, body, prompts: list[list[int]], chat: bool):
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created, self.model, self.chat = now(), server.model_name, chat
        self.prompt_tokens = sum(map(len, prompts))
        self.include_usage = body.include_usage()
        self.logprobs = body.logprobs_wanted() is not None

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def choice(self, index: int, text: str, event: Event | None, logprobs: list[PublishedLogprob]) -> dict:
        finish = event.finish_reason if event else None
        choice = {"index": index, "logprobs": self.logprobs_object(logprobs), "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text, "refusal": None}
        else:
            choice["text"] = text
        if event is not None and event.stats is not None:
            choice["refusion"] = event.stats
        return choice

    def whole(self, choices: list[dict], completion_tokens: int) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices,
                "usage": self.usage(completion_tokens)}

    def logprobs_object(self, logprobs: list[PublishedLogprob] | None) -> dict | None:
        """OpenAI's logprobs of a choice or chunk: chat `{"content": [...], "refusal": None}`, completions
        `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; None when the request asked for none."""
        if not self.logprobs:
            return None
        logprobs = logprobs or []
        if self.chat:
            def entry(token: str, logprob: float) -> dict:
                return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
            return {"content": [{**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                                for lp in logprobs], "refusal": None}
        return {"tokens": [lp.token for lp in logprobs], "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [dict(lp.top) for lp in logprobs], "text_offset": [lp.offset for lp in logprobs]}

    def chunk(self, index: int, text: str | None, event: Event | None = None, role: bool = False) -> dict:
        carried = event.logprobs if event is not None and text is not None else None  # a delta's own tokens
        choice = {"index": index, "logprobs": self.logprobs_object(carried) if carried else None,
                  "finish_reason": event.finish_reason if event else None}
        if self.chat:
            choice["delta"] = ({"role": "assistant", "content": ""} if role else
                               {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        if event is not None and event.stats is not None:
            choice["refusion"] = event.stats
        return self._chunk([choice])

    def usage_chunk(self, completion_tokens: int) -> dict:
        return {**self._chunk([]), "usage": self.usage(completion_tokens)}

    def _chunk(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "system_fingerprint": None, "choices": choices}


async def _events(request: Request, events: asyncio.Queue) -> AsyncIterator[tuple[int, Event]]:
    """The jobs' events as they come; ends when the client has disconnected (checked every
    DISCONNECT_POLL_SECONDS whether events flow or not), so a client that leaves before its first chunk, or
    an ASGI server that drops writes to a closed connection, never keeps a sequence decoding."""
    next_check = loop_time() + DISCONNECT_POLL_SECONDS
    while True:
        try:
            item = await asyncio.wait_for(events.get(), DISCONNECT_POLL_SECONDS)
        except asyncio.TimeoutError:
            item = None
        if loop_time() >= next_check:
            next_check = loop_time() + DISCONNECT_POLL_SECONDS
            if await request.is_disconnected():
                return
        if item is not None:
            yield item


async def _collect(request: Request, jobs: list[Job], events: asyncio.Queue, reply: Reply) -> JSONResponse:
    """Non-streamed: gather every job's deltas until its final event (or until the client leaves)."""
    texts, finals = [""] * len(jobs), [None] * len(jobs)
    logprobs: list[list[PublishedLogprob]] = [[] for _ in jobs]
    async with contextlib.aclosing(_events(request, events)) as stream:
        async for index, event in stream:
            if event.error is not None:
                raise ApiError(ERROR_STATUS.get(event.code, 500), event.error, code=event.code or DECODING_FAILED)
            texts[index] += event.delta
            logprobs[index] += event.logprobs or []
            if event.final:
                finals[index] = event
            if all(f is not None for f in finals):
                break
        else:
            return JSONResponse(error_body("client disconnected"), status_code=CLIENT_CLOSED_REQUEST)
    choices = [reply.choice(i, texts[i], finals[i], logprobs[i]) for i in range(len(jobs))]
    return JSONResponse(reply.whole(choices, sum(f.completion_tokens for f in finals)))


async def _stream(server: Server, request: Request, jobs: list[Job], events: asyncio.Queue,
                  reply: Reply, timer: RequestTimer) -> AsyncIterator[str]:
    """Streamed: one SSE chunk per delta, a last chunk per choice with its finish_reason, then [DONE]. An error
    (decoding failed, server shutting down) is an `{"error": ...}` event, then [DONE].

    When the client disconnects, the server cancels this generator (ASGI spec < 2.4) or `_events` ends
    (any server); `finally` frees the jobs' rows.
    """
    status = CLIENT_CLOSED_REQUEST  # until the stream ends otherwise
    try:
        if reply.chat:
            for i in range(len(jobs)):
                yield _sse(reply.chunk(i, None, role=True))
        done, completion_tokens = 0, 0
        async with contextlib.aclosing(_events(request, events)) as stream:
            async for index, event in stream:
                if event.error is not None:
                    status = ERROR_STATUS.get(event.code, 500)
                    yield _sse(error_body(event.error, type="server_error", code=event.code or DECODING_FAILED))
                    break
                if event.delta or event.logprobs:
                    yield _sse(reply.chunk(index, event.delta, event))
                if event.final:
                    done += 1
                    completion_tokens += event.completion_tokens
                    yield _sse(reply.chunk(index, None, event))
                if done == len(jobs):
                    if reply.include_usage:
                        yield _sse(reply.usage_chunk(completion_tokens))
                    status = 200
                    break
            else:
                return  # the client has gone
        yield "data: [DONE]\n\n"
    finally:
        timer.finish(status)
        for job in jobs:
            server.scheduler.cancel(job)


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


# ------------------------------------------------------------------------------------------ errors
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return _validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return ApiError(e.status_code, str(e.detail), headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def server_error(request: Request, e: Exception):
        log.exception("unhandled error")
        return ApiError(500, f"internal error: {type(e).__name__}: {e}").response()


def _validation_error(e: RequestValidationError | ValidationError) -> ApiError:
    """The first pydantic error as a 400 naming the field (`refusion.slot_size`, `messages.0.role`, ...)."""
    errors = e.errors()
    if not errors:
        return ApiError(400, "invalid request body")
    err = errors[0]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, UnsupportedValue):
        return ApiError(400, str(cause), param=cause.param)
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    loc = [x for x in loc if not _is_union_branch(x)]
    param = ".".join(loc) or None
    if err.get("type") == "missing":
        return ApiError(400, f"missing required field {param!r}", param=param)
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {param!r}", param=param)
    got = json.dumps(err.get("input"), default=str)
    got = got if len(got) <= 80 else got[:77] + "..."
    where = f"{param}: " if param else "request body: "
    return ApiError(400, f"{where}{err.get('msg', 'invalid value')} (got {got})", param=param)


def _is_union_branch(part: str) -> bool:
    """pydantic names the branch of a union in the error location (`str`, `list[int]`, ...)."""
    return part in ("str", "int", "float", "bool", "function-after") or part.startswith(("list[", "dict["))
