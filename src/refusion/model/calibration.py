"""What must be timed is timed once per machine and model, recorded beside the model cache, and reused.

A few choices need a clock: whether weight-major or MKL-packed products beat plain ones on this CPU (the linear
kernel of a model without native bf16: `kernels.choice`), and what a forward of each width costs (how many drafts
the exact mode verifies, so how many forwards a decode takes: `decode.costs`). Timed at every start, they followed
how busy the machine happened to be: the same command could take another kernel, and another number of forwards,
from one process to the next. So each is measured once and recorded in `calibration.json` beside the model cache
(`~/.cache/refusion/calibration.json`, or under `$REFUSION_CACHE`), under a key of everything that decides it: the CPU (model name and flags),
torch's version, the thread count, and what is measured (the model's shapes, dtype and kernels). Every later
process reads the recorded decision; `refusion calibrate` measures again. The dtype itself is never timed: it
follows the CPU's features (`loading.default_dtype`).

A record file that cannot be read is reported in one line and measured again (then rewritten); with the model
cache off (`REFUSION_CACHE=off`) nothing is recorded, and each process measures for itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from refusion.cache_dirs import cache_root

RECORD_FILE = "calibration.json"
"""The record's file name, beside the models' directory (`cache_dirs.cache_root()`: ~/.cache/refusion/)."""
FORMAT = 1
"""Bump when what is recorded changes meaning, so that older records are measured again."""

_remeasure = False  # inside `remeasuring()`: every lookup measures and records afresh


class CalibrationWarning(UserWarning):
    """The calibration record could not be read or written (it is measured again; nothing else changes)."""


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a decoding forward by width (batch 1) and what padding adds in a batch, measured on one model,
    its kernels and this machine."""

    widths: tuple[int, ...]
    """The widths timed, increasing, starting at 1."""
    seconds: tuple[float, ...]
    """Seconds of a forward of each of those widths (the fastest of the probe's repeats)."""
    padded_row: float = 0.0
    """Seconds each padding row adds to a batched forward: sequences of different widths are padded to the widest,
    and where the real rows alone go through the linear layers (the compact forward on a CPU), attention still runs
    over the padded layout. 0: padding is free (or was not measured)."""
    masking: float = 0.0
    """Seconds a batched forward with a mask (some sequence holding more than one token) costs beyond one without:
    an AR step over a plain context needs no mask. In `seconds` already at batch 1 (width 1 needs none, 4 does)."""

    def of(self, width: int) -> float:
        """Seconds of a forward of `width` tokens (interpolated between the measured widths)."""
        widths, seconds = self.widths, self.seconds
        for i in range(1, len(widths)):
            if width <= widths[i] or i == len(widths) - 1:
                w0, w1, s0, s1 = widths[i - 1], widths[i], seconds[i - 1], seconds[i]
                return s0 + (s1 - s0) * (width - w0) / (w1 - w0)
        return seconds[0]

    def of_batch(self, rows: int, batch: int, widest: int) -> float:
        """Seconds of a forward of `batch` sequences holding `rows` real tokens, padded to the `widest`."""
        masked = batch > 1 and widest > 1
        return self.of(rows) + self.padded_row * max(batch * widest - rows, 0) + self.masking * masked

    def describe(self) -> str:
        widths = ", ".join(f"{w}: {s * 1e3:.1f} ms" for w, s in zip(self.widths, self.seconds))
        return f"{widths}; in a batch, padding row {self.padded_row * 1e3:.2f} ms, mask {self.masking * 1e3:.1f} ms"

    def to_dict(self) -> dict:
        return {"widths": list(self.widths), "seconds": list(self.seconds), "padded_row": self.padded_row,
                "masking": self.masking}

    @classmethod
    def from_dict(cls, value: dict) -> ForwardCosts:
        return cls(tuple(int(w) for w in value["widths"]), tuple(float(s) for s in value["seconds"]),
                   float(value.get("padded_row", 0.0)), float(value.get("masking", 0.0)))


def record_path() -> Path | None:
    """Where the record lives; None when the model cache is off."""
    root = cache_root()
    return root.parent / RECORD_FILE if root is not None else None


def machine_key() -> dict:
    """What makes one machine time differently from another: the CPU (model name and flags), torch's version and
    the thread count its kernels run on."""
    import torch

    return {"cpu": cpu_model(), "flags": cpu_flags_digest(), "torch": torch.__version__,
            "threads": torch.get_num_threads()}


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; else the platform's processor string)."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags_digest() -> str:
    """A short digest of the CPU's feature flags (AMX, AVX512-BF16, ...: what the kernels can use)."""
    flags = next((line.split(":", 1)[1] for line in _cpuinfo_lines() if line.startswith(("flags", "Features"))), "")
    return hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16]


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def recorded(kind: str, key: dict, measure: Callable[[], object]):
    """The value recorded for (`kind`, this machine, `key`), else `measure()`, recorded for every later process.

    `measure` returns a JSON value (None included: "nothing to record but that it was measured"). The record is
    keyed by `machine_key()` and `key` together; `remeasuring()` makes every lookup measure again."""
    full = {"kind": kind, "format": FORMAT, "machine": machine_key(), **key}
    name = f"{kind}-{_digest(full)[:20]}"
    path = record_path()
    if path is not None and not _remeasure:
        entry = _read(path).get(name)
        if isinstance(entry, dict) and entry.get("key") == json.loads(json.dumps(full, default=str)):
            return entry.get("value")
    value = measure()
    if path is not None:
        _write(path, name, {"key": full, "value": value})
    return value


@contextlib.contextmanager
def remeasuring() -> Iterator[None]:
    """Within it, `recorded` measures again (and replaces the record) instead of reading it: `refusion calibrate`."""
    global _remeasure
    saved, _remeasure = _remeasure, True
    try:
        yield
    finally:
        _remeasure = saved


def _read(path: Path) -> dict:
    """The record's entries; {} when there is none, and (with a one-line warning) when it cannot be read."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        _warn(f"cannot read the calibration record {path} ({e.strerror or e}); measuring again")
        return {}
    try:
        record = json.loads(text)
        if not isinstance(record, dict) or not isinstance(record.get("entries"), dict):
            raise ValueError("not a calibration record")
    except ValueError:
        _warn(f"the calibration record {path} is unreadable (not a record refusion wrote); measuring again")
        return {}
    return record["entries"] if record.get("format") == FORMAT else {}


def _write(path: Path, name: str, entry: dict) -> None:
    """Add or replace one entry: the file read again just before (another process may have added entries), written
    to a temporary file and renamed over the record, so no reader sees half of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CalibrationWarning)  # reported when it was read
            entries = _read(path)
        entries[name] = entry
        fd, tmp = tempfile.mkstemp(prefix=".calibration-", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"format": FORMAT, "entries": entries}, f, indent=1, default=str)
        os.replace(tmp, path)
    except OSError as e:
        _warn(f"cannot write the calibration record {path} ({e.strerror or e}); this process measured for itself")


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _warn(message: str) -> None:
    warnings.warn(CalibrationWarning(message), stacklevel=3)


def structure_key(model) -> str:
    """A digest of what a model's forward computes with, not its values: every module's class and its parameters'
    and buffers' shapes and dtypes, and its config (what decides the cost of a forward and the kernels' speed)."""
    parts = []
    for name, module in model.named_modules():
        tensors = [(n, tuple(t.shape), str(t.dtype)) for n, t in [*module.named_parameters(recurse=False),
                                                                  *module.named_buffers(recurse=False)]]
        parts.append((name, type(module).__name__, tensors))
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    for volatile in ("_name_or_path", "transformers_version", "name_or_path"):
        settings.pop(volatile, None)
    return _digest({"modules": parts, "config": settings})
