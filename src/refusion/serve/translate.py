"""From an HTTP request to the scheduler's jobs: parse the body, tokenize its prompts, layer its decoding
settings (server defaults < the request's standard fields < its `"refusion"` extension object), compile its
response grammar, and build one `Job` per prompt and choice. Every problem is an `ApiError` (400) naming the
request field, raised before anything is queued."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from refusion.config import (
    CONTEXT_LENGTH_EXCEEDED,
    OPENAI_NAMES,
    STRATEGIES,
    ConfigError,
    DecodeConfig,
    ignored_settings,
    layered_settings,
    owner_of,
)
from refusion.serve.errors import ApiError, validation_error
from refusion.serve.scheduler import Job
from refusion.serve.schemas import ChatCompletionRequest
from refusion.serve.server import Server

MAX_BODY_BYTES = 8 << 20
"""Larger bodies are refused (413) before they are parsed or tokenized."""
MAX_SCHEMA_DEPTH = 128
"""Most levels of JSON nesting in a response_format (a property nested in an object schema takes two); llguidance's
own parser refuses recursion much deeper than this."""
MAX_SCHEMA_BYTES = 128 << 10
"""Largest response_format compiled, as JSON (OpenAI's structured outputs allow 120,000 characters of names and
values). Each sequence builds its grammar's matcher when it joins the batch, in the scheduler thread, in a time that
grows with the schema (~0.3 s at 300 kB on the 2-core development machine): the bound keeps that pause short."""
GRAMMAR_COMPILE_SECONDS = 10.0
"""A response_format that takes longer to compile is refused (llguidance's own limits normally end it sooner)."""


async def parse_body(request: Request, schema: type[BaseModel]):
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
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def request_strategy(server: Server, body) -> str:
    """The request's strategy, as a metrics label (an invalid one is refused later; it is not a label value)."""
    chosen = body.refusion.strategy if body.refusion is not None else None
    chosen = chosen or server.config.strategy
    return chosen if chosen in STRATEGIES else "unknown"


def prompt_ids(server: Server, body, *, chat: bool) -> list[list[int]]:
    """The request's prompts as token ids (a chat is one prompt, through the chat template)."""
    with server.scheduler.tokenizer_lock:
        if chat:
            return [encode_chat(server.tokenizer, body.chat_messages())]
        return [p if isinstance(p, list) else server.tokenizer(p)["input_ids"] for p in body.prompts()]


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template itself may refuse a conversation (roles out of order, ...)
        raise ApiError(400, f"the chat template rejected the messages: {e}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def check_fits_scheduler(server: Server, prompts: int, n: int) -> None:
    """A request that could never be queued (its choices are submitted all or none) is a 400, not a 503 forever."""
    capacity = server.scheduler.capacity
    if prompts * n > capacity:
        raise ApiError(400, f"this request needs {prompts * n} sequences ({prompts} prompt(s) x n={n}) but the "
                            f"server holds at most {capacity} (max_batch_size + max_queue); lower n or send fewer "
                            "prompts", param="n" if n > 1 else "prompt")


async def build_jobs(server: Server, body, prompts: list[list[int]], emits) -> list[Job]:
    """n jobs per prompt (choice index = prompt index * n + j, as OpenAI orders them). Prompts are validated
    here, so that a bad one is a 400 naming its field before anything is queued (`Decoder.add` checks again
    when the scheduler admits the job); the decoder seeds each sequence's generator with seed + its choice
    index (at random when the request gives no seed). The response grammar is compiled once per request."""
    from refusion.decode.loop import validate_prompts
    from refusion.model.setup import setup_of

    n, plans = body.choices_per_prompt(), []
    for p, prompt in enumerate(prompts):
        cfg = request_config(server, body, len(prompt))
        try:
            tokens = setup_of(server.model).special_tokens.for_decoding(cfg)
            mask_id, eos_ids = tokens.mask_token_id, list(tokens.eos_token_ids)
            validate_prompts(server.model, [prompt], cfg, mask_id, first_index=p)
        except ValueError as e:
            prompt_param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
            too_long_param = prompt_param if body.requested_tokens() is None else "max_tokens"
            raise config_error(e, prompt_param, too_long_param) from None
        if body.refusion is not None and body.refusion.ignore_eos:
            eos_ids = []
        plans.append((prompt, cfg, mask_id, eos_ids))
    _, cfg, _, eos_ids = plans[0]  # every prompt of a request has the same strategy and EOS tokens
    grammar = await response_grammar(server, body, cfg, eos_ids)
    return [Job(prompt, cfg, mask_id, eos_ids, emits[index], stops=body.stop_strings(), index=index, grammar=grammar)
            for p, (prompt, cfg, mask_id, eos_ids) in enumerate(plans) for index in range(p * n, (p + 1) * n)]


async def response_grammar(server: Server, body, cfg: DecodeConfig, eos_ids: list[int]):
    """The compiled grammar of the request's response_format (None for none or "text"); a strategy that cannot
    honour it, or a schema the grammar engine cannot compile, is a 400 naming the field.

    A schema of any size or depth is bounded: deeper than MAX_SCHEMA_DEPTH or larger than MAX_SCHEMA_BYTES is
    refused before compiling; llguidance bounds its own work (its parser limits: lexer fuel, grammar size); the
    compile runs in a worker thread, off the event loop, and one that outlasts GRAMMAR_COMPILE_SECONDS is refused."""
    if body.response_format is None or body.response_format.type == "text":
        return None
    try:
        from refusion.decode.grammar import UnsupportedStrategy, check_strategy
    except ImportError:  # pragma: no cover - the serve extra installs it
        raise ApiError(400, "response_format needs llguidance (pip install 'refusion[serve]')",
                       param="response_format") from None
    try:
        check_strategy(cfg.strategy)
    except UnsupportedStrategy as e:
        raise ApiError(400, str(e), param="refusion.strategy") from None
    response_format = body.response_format.as_dict()
    _check_schema_bounds(response_format)
    try:
        return await asyncio.wait_for(asyncio.to_thread(_compile_grammar, server, response_format, eos_ids),
                                      GRAMMAR_COMPILE_SECONDS)
    except asyncio.TimeoutError:
        raise ApiError(400, f"response_format: the schema did not compile within {GRAMMAR_COMPILE_SECONDS:g} s; "
                            "simplify it", param="response_format") from None
    except (ValueError, ImportError, RecursionError) as e:
        raise ApiError(400, str(e) if not isinstance(e, RecursionError) else
                       "response_format: the schema is nested too deeply to compile", param="response_format") from None


def _compile_grammar(server: Server, response_format: dict, eos_ids: list[int]):
    """(worker thread) Compile, then follow the grammar's first steps as each sequence will when it joins the batch
    (its first mask, the tokens the grammar forces, the mask after them): a grammar that hits one of llguidance's
    limits there (e.g. a thousand optional properties in any order: too many Earley items once '{' is read), or that
    this tokenizer cannot spell, is refused here, not found failing in the batch."""
    from refusion.decode.grammar import ResponseGrammar

    vocab_size = server.model.config.get_text_config().vocab_size
    with server.scheduler.tokenizer_lock:
        grammar = ResponseGrammar.compile(server.tokenizer, response_format, vocab_size, eos_ids)
    trial = grammar.state()
    trial.allowed()
    forced = trial.matcher.compute_ff_tokens()
    if forced and trial.matcher.consume_tokens(forced):
        trial.allowed()
    if trial.matcher.is_error():
        reason = trial.matcher.get_error().strip().splitlines()[0]  # the rest restates the grammar
        raise ValueError(f"response_format: the grammar engine cannot follow this schema with this model's "
                         f"tokenizer: {reason}")
    return grammar


def _check_schema_bounds(response_format: dict) -> None:
    """A 400 for a response_format nested deeper than MAX_SCHEMA_DEPTH or larger than MAX_SCHEMA_BYTES (walked
    level by level, so any depth is measured without recursion)."""
    depth, level = 0, [response_format]
    while level:
        depth += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise ApiError(400, f"response_format is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                           param="response_format")
        level = [child for value in level for child in
                 (value.values() if isinstance(value, dict) else value) if isinstance(child, (dict, list))]
    size = len(json.dumps(response_format))
    if size > MAX_SCHEMA_BYTES:
        raise ApiError(400, f"response_format is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES} are compiled",
                       param="response_format")


def request_config(server: Server, body, prompt_length: int) -> DecodeConfig:
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
        raise config_error(e, None, None) from None
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


def config_error(e: ValueError, prompt_param: str | None, too_long_param: str | None) -> ApiError:
    """A DecodeConfig / engine ValueError as a 400 naming the request field, by the error's type."""
    from refusion.decode.loop import PromptTooLong
    from refusion.model.special_tokens import MissingMaskToken

    message, code = str(e).replace("max_new_tokens", "max_tokens"), None
    if isinstance(e, ConfigError):
        param = OPENAI_NAMES.get(e.field, f"refusion.{e.field}")
    elif isinstance(e, MissingMaskToken):
        param = "refusion.strategy"
        message += " (this model can only be served with strategy 'autoregressive')"
    elif isinstance(e, PromptTooLong):
        param, code = too_long_param, CONTEXT_LENGTH_EXCEEDED
    else:
        param = prompt_param
    return ApiError(400, message, param=param, code=code)
