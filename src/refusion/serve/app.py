"""The OpenAI-compatible HTTP API, assembled: `create_app(model, tokenizer, ...)` builds a FastAPI app around one
`Scheduler` (the decoding thread) and its metrics.

The rooms, by job: `routes.py` (the endpoints and the four phases of a generation request), `translate.py`
(request -> decoding settings, token ids and jobs), `streaming.py` (scheduler events -> one response or
server-sent events), `errors.py` (OpenAI-style error bodies), `server.py` (what the handlers share),
`scheduler.py` (continuous batching), `metrics.py` (Prometheus).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI

from refusion.config import DecodeConfig
from refusion.serve.errors import add_error_handlers
from refusion.serve.metrics import ServerMetrics
from refusion.serve.routes import add_routes, document_request_bodies
from refusion.serve.scheduler import Scheduler
from refusion.serve.schemas import now
from refusion.serve.server import Server


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
    add_error_handlers(app)
    add_routes(app, server)
    document_request_bodies(app)
    return app


def _check_model_fits(model, config: DecodeConfig) -> None:
    """Fail at startup, not on the first request, when the default strategy cannot run on this model."""
    from refusion.model.setup import setup_of
    setup_of(model).special_tokens.for_decoding(config)
