"""The OpenAI-compatible HTTP API, assembled: `create_app(model, tokenizer, ...)` builds a FastAPI app around one
`Scheduler` (the decoding thread) and its metrics.

The rooms, by job: `routes.py` (the endpoints and the four phases of a generation request), `translate.py`
(request -> decoding settings, token ids and jobs), `streaming.py` (scheduler events -> one response or
server-sent events), `errors.py` (OpenAI-style error bodies), `server.py` (what the handlers share),
`access.py` (API key, CORS), `scheduler.py` (continuous batching), `metrics.py` (Prometheus),
`settings.py` (the command's settings).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI

from refusion.config import DecodeConfig
from refusion.serve.access import add_access
from refusion.serve.errors import add_error_handlers
from refusion.serve.metrics import ServerMetrics
from refusion.serve.routes import add_routes, document_request_bodies
from refusion.serve.scheduler import Scheduler
from refusion.serve.schemas import now
from refusion.serve.server import Server, engine_of
from refusion.serve.settings import PREFIX_CACHE_MB

log = logging.getLogger("refusion.serve")


def create_app(model, tokenizer, *, config: DecodeConfig | None = None, model_name: str = "refusion",
               max_batch_size: int = 8, max_queue: int = 64, api_key: str | None = None,
               cors_origins: tuple[str, ...] = (), request_timeout: float | None = None,
               prefix_cache_mb: int = PREFIX_CACHE_MB) -> FastAPI:
    """A FastAPI app serving `model`; its scheduler thread starts and stops with the app (lifespan). `api_key`,
    `cors_origins`, `request_timeout` and `prefix_cache_mb` are `ServeConfig`'s fields (serve/settings.py)."""
    from refusion.decode.prefix_cache import prefix_cache_for
    from refusion.model.setup import setup_of

    config = config or DecodeConfig()
    _check_model_fits(model, config)
    metrics = ServerMetrics()
    prefix_cache, prefix_line = prefix_cache_for(model, setup_of(model), prefix_cache_mb)
    scheduler = Scheduler(model, tokenizer, max_batch_size=max_batch_size, max_queue=max_queue, observer=metrics,
                          prefix_cache=prefix_cache)
    server = Server(model, tokenizer, config, model_name, scheduler, now(), metrics, request_timeout=request_timeout,
                    engine=engine_of(model))
    metrics.watch(queue_depth=lambda: len(scheduler.waiting), batch_size=lambda: len(scheduler.live),
                  kv_cache_usage=lambda: _kv_cache_usage(server), model_name=model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        log.info("serving %s: %s on %s, %s; %s", model_name, server.engine["dtype"], server.engine["device"],
                 server.engine["setup"], prefix_line)
        scheduler.start()
        try:
            yield
        finally:
            scheduler.stop()

    app = FastAPI(title="refusion", description="OpenAI-compatible ReFusion server", lifespan=lifespan)
    app.state.server = server
    add_error_handlers(app)
    add_access(app, api_key=api_key, cors_origins=tuple(cors_origins))
    add_routes(app, server)
    document_request_bodies(app)
    return app


def _kv_cache_usage(server: Server) -> float:
    """The share of the most the KV cache will hold (every batch row at the model's context length) that the running
    sequences hold now; without a known context length, the share of batch rows in use."""
    rows = server.scheduler.max_batch_size
    if server.context_length is None:
        return len(server.scheduler.live) / rows
    return min(server.scheduler.held_tokens() / (rows * server.context_length), 1.0)


def _check_model_fits(model, config: DecodeConfig) -> None:
    """Fail at startup, not on the first request, when the default strategy cannot run on this model."""
    from refusion.model.setup import setup_of
    setup_of(model).special_tokens.for_decoding(config)
