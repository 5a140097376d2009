"""Experiment trackers of a training run (`refusion train --report-to tensorboard,wandb`), through accelerate.

Each tracker receives what metrics.jsonl records at each logged step (loss, loss_ar, loss_mdm, lr, epoch,
tokens, tokens_per_s), at that optimizer step, and the run's TrainConfig as hyperparameters. Nothing leaves
the machine unless asked: tensorboard writes event files to OUTPUT/TRACKER_PROJECT, wandb runs offline (in
OUTPUT/wandb; `wandb sync` uploads it later) unless WANDB_MODE is set, mlflow writes to OUTPUT/mlruns unless
MLFLOW_TRACKING_URI is set; the other trackers follow their own settings.
"""

from __future__ import annotations

import os
from pathlib import Path

TRACKERS = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow", "comet_ml": "comet_ml",
            "aim": "aim", "clearml": "clearml", "dvclive": "dvclive", "swanlab": "swanlab", "trackio": "trackio"}
"""accelerate's tracker names -> the pip package each needs."""
TRACKER_PROJECT = "refusion"
"""The project (wandb, mlflow experiment) / run folder (tensorboard: OUTPUT/refusion) that runs log to."""


def check_trackers(names: tuple[str, ...]) -> None:
    """A one-line error for a tracker whose package is missing (accelerate would skip it silently)."""
    import accelerate.utils

    for name in names:
        if not getattr(accelerate.utils, f"is_{name}_available")():
            raise ValueError(f"--report-to {name} needs the {TRACKERS[name]} package: pip install {TRACKERS[name]}")


def keep_offline(names: tuple[str, ...], output: Path) -> None:
    """Environment defaults that keep the trackers local (values the user set are kept)."""
    if "wandb" in names:
        os.environ.setdefault("WANDB_MODE", "offline")
    if "mlflow" in names:
        os.environ.setdefault("MLFLOW_TRACKING_URI", (Path(output).resolve() / "mlruns").as_uri())


def init_kwargs(names: tuple[str, ...], output: Path) -> dict:
    """Per-tracker keywords of `Accelerator.init_trackers`: the run is named after its output directory."""
    kwargs = {}
    if "wandb" in names:
        kwargs["wandb"] = {"dir": str(output), "name": Path(output).name}
    return kwargs


def hyperparameters(config: dict) -> dict:
    """The config as scalars, as every tracker takes them (tensorboard's hparams refuse tuples and None)."""
    def scalar(value):
        if isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, (tuple, list)):
            return ",".join(map(str, value))
        return str(value)

    return {key: scalar(value) for key, value in config.items()}


def step_metrics(metrics: dict) -> dict:
    """What a metrics.jsonl line records, less the step (given to the tracker as the step)."""
    return {key: value for key, value in metrics.items() if key != "step"}
