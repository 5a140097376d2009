"""`Server`: what the HTTP handlers share (the model, its tokenizer, the server's decoding defaults, the
scheduler and the metrics). Built once by `app.create_app`."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    request_timeout: float | None = None
    """Seconds a generation request may take from arrival (None: no limit)."""
    engine: dict = field(default_factory=dict)
    """What decodes: {"dtype", "device", "setup"} (`engine_of`), shown in /v1/models and the start-up log."""

    @property
    def context_length(self) -> int | None:
        return getattr(self.model.config.get_text_config(), "max_position_embeddings", None)


def engine_of(model) -> dict:
    """The dtype, device and setup (kernels, draft table, row-exactness: `ModelSetup.describe`) in force."""
    from refusion.model.setup import setup_of

    parameter = next(model.parameters())
    return {"dtype": str(parameter.dtype).removeprefix("torch."), "device": str(parameter.device),
            "setup": setup_of(model).describe()}
