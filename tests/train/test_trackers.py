"""`refusion train --report-to`: the trackers receive what metrics.jsonl records; a missing package is one line."""

from __future__ import annotations

import json

import pytest

from refusion.train.config import TrainConfig
from refusion.train.trackers import check_trackers, hyperparameters


def _config(tiny_dir, data_file, output, **changes) -> TrainConfig:
    values = dict(model=str(tiny_dir), data=(str(data_file),), output=str(output), batch_size=4, lr=3e-3,
                  max_length=128, save_every=0, num_workers=0, mixed_precision="no", seed=0)
    return TrainConfig(**{**values, **changes})


def _metrics(output) -> list[dict]:
    return [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]


def test_tensorboard_receives_the_metrics_jsonl_values(tiny_dir, data_file, tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from refusion.train.trainer import train

    out = tmp_path / "out"
    train(_config(tiny_dir, data_file, out, max_steps=3, report_to=("tensorboard",)))
    events = list((out / "refusion").glob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in out.rglob("*"))
    logged = EventAccumulator(str(out / "refusion")).Reload()
    metrics = _metrics(out)
    for key in ("loss", "loss_ar", "loss_mdm", "lr", "epoch", "tokens", "tokens_per_s"):
        scalars = logged.Scalars(key)
        assert [s.step for s in scalars] == [m["step"] for m in metrics] == [1, 2, 3]
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in metrics], rel=1e-6), key


def test_a_missing_tracker_package_is_a_one_line_error(tiny_dir, data_file, tmp_path, monkeypatch, capsys):
    import accelerate.utils

    from refusion.train.cli import main

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    with pytest.raises(ValueError, match=r"pip install wandb"):
        check_trackers(("wandb",))
    code = main(["--model", str(tiny_dir), "--data", str(data_file), "--output", str(tmp_path / "o"),
                 "--report-to", "tensorboard,wandb"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == "refusion train: error: --report-to wandb needs the wandb package: pip install wandb"
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_report_to_is_validated_and_read_from_recipes(tmp_path):
    with pytest.raises(ValueError, match="report_to"):
        TrainConfig(model="m", data=("d",), output="o", report_to=("tensorbored",))
    config = TrainConfig.from_dict({"model": "m", "data": "d", "output": "o", "report_to": "tensorboard"})
    assert config.report_to == ("tensorboard",)
    params = hyperparameters(config.to_dict())
    assert params["report_to"] == "tensorboard" and params["slot_sizes"] == "4,8,16,32"
    assert all(isinstance(v, (bool, int, float, str)) for v in params.values()), json.dumps(params, default=str)
