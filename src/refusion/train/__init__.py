"""Training: the hybrid AR + masked-diffusion objective (docs/TRAINING.md) and the trainer.

Heavy modules (transformers, accelerate, peft) are imported on first use.
"""

from refusion.train.config import TrainConfig

__all__ = ["TrainConfig", "train", "merge_adapter"]


def __getattr__(name):
    if name in ("train", "merge_adapter"):
        from refusion.train import trainer
        return getattr(trainer, name)
    raise AttributeError(f"module 'refusion.train' has no attribute {name!r}")
