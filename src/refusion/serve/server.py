"""`Server`: what the HTTP handlers share (the model, its tokenizer, the server's decoding defaults, the
scheduler and the metrics). Built once by `app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass

from refusion.config import DecodeConfig
from refusion.serve.metrics import ServerMetrics
from refusion.serve.scheduler import Scheduler


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
