"""The HTTP routes: `/v1/chat/completions`, `/v1/completions`, `/v1/models`, `/health`, `/metrics`.

A generation request is handled in four phases: 1. validate the body (pydantic, `schemas.py`), 2. build its
decoding settings and token ids (`translate.py`), 3. submit its jobs to the scheduler (one per prompt and
choice), 4. relay the scheduler's events (`streaming.py`), as server-sent events when `stream` is true, else
collected into one response. Every generation request is counted in the app's Prometheus metrics."""

from __future__ import annotations

import asyncio
import contextlib
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from refusion.serve import streaming, translate
from refusion.serve.errors import ApiError
from refusion.serve.metrics import CONTENT_TYPE, RequestTimer
from refusion.serve.scheduler import SHUTTING_DOWN, Draining, Event, QueueFull, SchedulerStopped
from refusion.serve.schemas import ChatCompletionRequest, CompletionRequest
from refusion.serve.server import Server

RETRY_AFTER_SECONDS = 1
REQUEST_SCHEMAS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest}


def add_routes(app: FastAPI, server: Server) -> None:
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
        return {"object": "list", "data": [model_card(server)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model_name(server, name)
        return model_card(server)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answer(server, request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(server, request, chat=False)


def document_request_bodies(app: FastAPI) -> None:
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


def model_card(server: Server) -> dict:
    return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "refusion",
            "max_model_len": server.context_length, "refusion": server.engine}


def check_model_name(server: Server, name: str) -> None:
    if name != server.model_name:
        raise ApiError(404, f"The model `{name}` does not exist: this server serves `{server.model_name}`",
                       param="model", code="model_not_found")


async def answer(server: Server, request: Request, *, chat: bool):
    """Parse, tokenize and generate; the request is counted by the status it ends with."""
    timer = RequestTimer(server.metrics)
    try:
        body = await translate.parse_body(request, ChatCompletionRequest if chat else CompletionRequest)
        timer.strategy = translate.request_strategy(server, body)
        check_model_name(server, body.model)
        prompts = translate.prompt_ids(server, body, chat=chat)
        response = await generate(server, request, body, prompts, chat=chat, timer=timer)
    except ApiError as e:
        timer.finish(e.status)
        raise
    except Exception:
        timer.finish(500)
        raise
    if not isinstance(response, StreamingResponse):  # a stream is counted when it ends
        timer.finish(response.status_code)
    return response


async def generate(server: Server, request: Request, body, prompts: list[list[int]], *, chat: bool,
                   timer: RequestTimer):
    # 1. decoding settings and jobs (validated before anything is queued)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()

    def emitter(index: int):
        def emit(event: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is shutting down
                loop.call_soon_threadsafe(queue.put_nowait, (index, event))
        return emit

    translate.check_fits_scheduler(server, len(prompts), body.choices_per_prompt())
    emits = [emitter(i) for i in range(len(prompts) * body.choices_per_prompt())]
    jobs = await translate.build_jobs(server, body, prompts, emits)

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

    # 3. relay the events (until the request's deadline, if the server sets one)
    deadline = None
    if server.request_timeout is not None:
        deadline = loop.time() + server.request_timeout - (time.perf_counter() - timer.started)
    reply = streaming.Reply(server, body, prompts, chat)
    if body.stream:
        return StreamingResponse(streaming.stream(server, request, jobs, queue, reply, timer, deadline),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await streaming.collect(request, jobs, queue, reply, deadline)
    finally:
        for job in jobs:
            server.scheduler.cancel(job)  # no-op for finished jobs; frees the rows of a client that left
