"""What must be timed is timed once per machine and model, recorded beside the model cache, and reused.

A few choices need a clock: whether weight-major or MKL-packed products beat plain ones on this CPU (the linear
kernel of a model without native bf16: `kernels.choice`), and what a forward of each width costs (how many drafts
the exact mode verifies, so how many forwards a decode takes: `decode.costs`); one compares bits but costs ~0.1 s a
weight shape (the row counts at which packed bf16 products are row-exact: `kernels.row_exact.exact_rows`). Timed at
every start, they followed how busy the machine happened to be: the same command could take another kernel, and
another number of forwards, from one process to the next. So each is measured once and recorded in
`calibration.json` beside the model cache (`~/.cache/refusion/calibration.json`, or under `$REFUSION_CACHE`), under
a key of everything that changes its answer (`entry_key`): the machine (`machine_key`: the CPU's model name and
flags, torch's and refusion's versions, the thread count, and the CPU dispatch: ATen's capability, the environment
variables that cap oneDNN's and MKL's instruction sets or fix MKL's code path, fp32 matmul precision) and what is
measured (the model's shapes, dtype and kernels, the native extension's build tag, the GPU and its CUDA and driver
versions, the probe's own version). Every later process reads the recorded decision; `refusion calibrate` measures
again, `refusion calibrate --show` prints what is recorded for this machine.

What is read is checked before it is used: each kind's `parse` rejects a value of the wrong type or range (a
hand-edited or damaged entry), and a kind may `check` a recorded value against the machine (`exact_rows` multiplies
once at its recorded row count); either way the entry is reported in one line and measured again. A record file
that cannot be read is reported in one line and measured again (then rewritten).

Processes that start together measure once: a lookup that finds nothing takes a lock beside the record
(`calibration.json.lock`: `filelock`, else `fcntl.flock`), reads again (another process may have measured
meanwhile), measures only if still nothing is there, and writes the record atomically (a temporary file renamed
over it) before letting go. With the model cache off (`REFUSION_CACHE=off`) nothing is recorded, and each process
measures for itself.
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from refusion.cache_dirs import cache_root
from refusion.model.attention_split import splits_attention

RECORD_FILE = "calibration.json"
"""The record's file name, beside the models' directory (`cache_dirs.cache_root()`: ~/.cache/refusion/)."""
FORMAT = 2
"""Bump when what is recorded changes meaning, so that older records are measured again. 2: entries keyed by
refusion's version, the CPU dispatch and (where they matter) the native build tag and the GPU."""
LOCK_SECONDS = 900.0
"""How long a process waits for another's measurement (the lock beside the record) before measuring for itself."""
DISPATCH_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_CPU_ISA_HINTS",
                "DNNL_CPU_ISA_HINTS", "ONEDNN_DEFAULT_FPMATH_MODE", "DNNL_DEFAULT_FPMATH_MODE",
                "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "MKL_DEBUG_CPU_TYPE", "TORCH_MKLDNN_MATMUL_MIN_DIM")
"""Environment variables that change which code the CPU kernels run (so their speed and their bits): part of
`machine_key` where set."""

T = TypeVar("T")
_remeasure = False  # inside `remeasuring()`: every lookup measures and records afresh
_MISSING = object()
_held = threading.local()  # this thread holds the record's lock (a measurement inside another's reads it freely)
_reported: set[str] = set()  # records whose bad entries this process already reported (one line each)


class CalibrationWarning(UserWarning):
    """The calibration record could not be read or written, or holds an entry that is not valid (it is measured
    again; nothing else changes)."""


@dataclass(frozen=True)
class ForwardCosts:
    """Seconds of a decoding forward by width (batch 1) and what padding adds in a batch, measured on one model,
    its kernels and this machine."""

    widths: tuple[int, ...]
    """The widths timed, increasing, starting at 1."""
    seconds: tuple[float, ...]
    """Seconds of a forward of each of those widths (the fastest of the probe's repeats), above 0, never less for a
    wider forward."""
    padded_row: float = 0.0
    """Seconds each padding row adds to a batched forward: sequences of different widths are padded to the widest,
    and where the real rows alone go through the linear layers (the compact forward on a CPU), attention still runs
    over the padded layout. 0: padding is free (or was not measured)."""
    masking: float = 0.0
    """Seconds a batched forward with a mask (some sequence holding more than one token) costs beyond one without:
    an AR step over a plain context needs no mask. In `seconds` already at batch 1 (width 1 needs none, 4 does)."""
    attention: float = 0.0
    """Seconds each row of a forward (real or padding: attention runs over the padded layout) pays per cached column
    beyond `probe_context`: `seconds` were timed over that many, and a batch's rows attend over the whole layout,
    its longest context and its holes. 0: not measured."""
    probe_context: int = 0
    """The cached columns over which `seconds`, `padded_row` and `masking` were timed: a step over a longer layout
    pays `attention` for every row and column beyond them, and the mask in proportion. 0: not scaled."""
    probe_batch: int = 0
    """The sequences of the forwards that timed `masking`: a larger batch pays it in proportion (the mask and the
    masked attention are per sequence). 0: not scaled."""
    split_attention: bool = False
    """Whether the forward runs attention row by row over the real queries where
    `attention_split.splits_attention` says so (the compact forward with sdpa on a CPU): the padding then pays no
    attention per column."""

    def of(self, width: int) -> float:
        """Seconds of a forward of `width` tokens (interpolated between the measured widths, extrapolated beyond the
        last two)."""
        widths, seconds = self.widths, self.seconds
        if len(widths) == 1:
            return seconds[0]
        i = min(max(bisect.bisect_left(widths, width), 1), len(widths) - 1)
        w0, w1, s0, s1 = widths[i - 1], widths[i], seconds[i - 1], seconds[i]
        return s0 + (s1 - s0) * (width - w0) / (w1 - w0)

    def of_batch(self, rows: int, batch: int, widest: int, columns: int = 0) -> float:
        """Seconds of a forward of `batch` sequences holding `rows` real tokens, padded to the `widest`, over a cache
        layout of `columns` columns (0: the probe's). Attention and masking grow with a longer layout and a larger
        batch than the probe's, never shrink below what was timed: on the embedded model, 7-8 masked sequences over
        200-300 columns took 15-50 % more than the unscaled costs said, and drafts were verified where they lost to
        AR (docs/archive/BENCHMARKS-JOURNAL.md, *One computing thread*)."""
        masked = batch > 1 and widest > 1
        padding = self.padded_row * max(batch * widest - rows, 0)
        attending = batch * widest  # queries of attention's padded layout
        if self.split_attention and masked and splits_attention(batch, rows, widest,
                                                                max(columns, self.probe_context) + widest):
            attending = rows
        return (self.of(rows) + padding + self.attention * attending * self._beyond(columns)
                + self._mask(batch, columns) * masked)

    def least_of_batch(self, rows: int, batch: int, columns: int = 0) -> float:
        """The least `of_batch(rows, batch, widest, columns)` can be for any widest > 1 that holds `rows`: no
        padding, attention over the real rows alone (every layout attends over at least those). What a step that
        verifies a draft costs at the least (`decode.costs.draft_counts` rules out a step where no draft can pay
        by it)."""
        return self.of(rows) + self.attention * rows * self._beyond(columns) + self._mask(batch, columns) * (batch > 1)

    def _beyond(self, columns: int) -> int:
        """Cached columns beyond the probe's, which every attending row pays `attention` for."""
        return max(columns - self.probe_context, 0) if self.probe_context else 0

    def _mask(self, batch: int, columns: int) -> float:
        """What a mask costs a batched forward: `masking`, in proportion to a longer layout and a larger batch than
        the probe's, never less."""
        spread = (self.probe_context + self._beyond(columns)) / self.probe_context if self.probe_context else 1.0
        crowd = max(batch / self.probe_batch, 1.0) if self.probe_batch else 1.0
        return self.masking * spread * crowd

    def describe(self) -> str:
        widths = ", ".join(f"{w}: {s * 1e3:.1f} ms" for w, s in zip(self.widths, self.seconds))
        return f"{widths}; in a batch, padding row {self.padded_row * 1e3:.2f} ms, mask {self.masking * 1e3:.1f} ms"

    def to_dict(self) -> dict:
        return {"widths": list(self.widths), "seconds": list(self.seconds), "padded_row": self.padded_row,
                "masking": self.masking, "attention": self.attention, "probe_context": self.probe_context,
                "probe_batch": self.probe_batch, "split_attention": self.split_attention}

    @classmethod
    def from_dict(cls, value: dict) -> ForwardCosts:
        """The costs of a recorded dict; a ValueError (or TypeError) naming what is wrong with a value of the wrong
        type or range (widths not increasing from 1, a non-positive or decreasing time, a negative extra)."""
        require(isinstance(value, dict), "not a dict")
        widths, seconds = value["widths"], value["seconds"]
        require(isinstance(widths, list) and isinstance(seconds, list) and len(widths) == len(seconds) >= 1,
                "widths and seconds: lists of the same length")
        widths = [whole(w, 1) for w in widths]
        require(widths[0] == 1 and all(a < b for a, b in zip(widths, widths[1:])), "widths: increasing from 1")
        seconds = [real(s, 0.0) for s in seconds]
        require(seconds[0] > 0 and all(a <= b for a, b in zip(seconds, seconds[1:])),
                "seconds: above 0, never less for a wider forward")
        return cls(tuple(widths), tuple(seconds), real(value.get("padded_row", 0.0), 0.0),
                   real(value.get("masking", 0.0), 0.0), real(value.get("attention", 0.0), 0.0),
                   whole(value.get("probe_context", 0), 0),
                   whole(value.get("probe_batch", 0), 0), flag(value.get("split_attention", False)))


def require(condition: bool, what: str) -> None:
    """A ValueError saying `what` a recorded value should be, unless `condition`: the parsers' one check."""
    if not condition:
        raise ValueError(what)


def flag(value) -> bool:
    """`value` when it is a bool, else a ValueError."""
    require(type(value) is bool, f"{value!r}: true or false")
    return value


def whole(value, low: int = 0, high: int | None = None) -> int:
    """`value` when it is an int (not a bool) in [low, high], else a ValueError."""
    require(type(value) is int and value >= low and (high is None or value <= high),
            f"{value!r}: an integer >= {low}" + (f" and <= {high}" if high is not None else ""))
    return value


def real(value, low: float = 0.0) -> float:
    """`value` as a float when it is a finite number (not a bool) >= low, else a ValueError."""
    require(type(value) in (int, float) and math.isfinite(value) and value >= low,
            f"{value!r}: a finite number >= {low}")
    return float(value)


def record_path() -> Path | None:
    """Where the record lives; None when the model cache is off."""
    root = cache_root()
    return root.parent / RECORD_FILE if root is not None else None


def machine_key() -> dict:
    """What makes one machine (or one process's setting of it) time or compute differently from another: the CPU
    (model name and flags), torch's and refusion's versions, the thread count its kernels run on and the CPU
    dispatch (`cpu_dispatch`)."""
    import torch

    return {"cpu": cpu_model(), "flags": cpu_flags_digest(), "torch": torch.__version__,
            "refusion": refusion_version(), "threads": torch.get_num_threads(), "dispatch": cpu_dispatch()}


def refusion_version() -> str:
    """refusion's `__version__` (read from the package, which is imported whenever this module is: importing it
    here would run back up the layers)."""
    return str(getattr(sys.modules.get("refusion"), "__version__", "unknown"))


def cpu_dispatch() -> dict:
    """Which code torch's CPU kernels run: ATen's vector capability, the fp32 matmul precision (oneDNN may multiply
    fp32 in bf16), whether oneDNN is on, and the environment variables of DISPATCH_ENV that are set."""
    import torch

    capability = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", lambda: None)()
    return {"capability": capability, "matmul_precision": torch.get_float32_matmul_precision(),
            "mkldnn": bool(torch.backends.mkldnn.enabled),
            "env": {name: os.environ[name] for name in DISPATCH_ENV if name in os.environ}}


def device_key(device) -> dict:
    """What a GPU adds to the key of a measurement on it: its name and compute capability, CUDA's (or ROCm's)
    version and the driver's; {} for the CPU (the machine key says it all)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return {"type": device.type} if device.type != "cpu" else {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"type": "cuda", "gpu": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "cuda": torch.version.cuda or torch.version.hip, "driver": driver_version()}


def driver_version() -> str | None:
    """The GPU driver's version (CUDA's driver API through torch, else NVML); None where neither says."""
    import torch

    get = getattr(torch._C, "_cuda_getDriverVersion", None)
    if get is not None:
        with contextlib.suppress(Exception):
            return str(get())
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        return str(pynvml.nvmlSystemGetDriverVersion())
    return None


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


def entry_key(kind: str, key: dict) -> dict:
    """The whole key of an entry: its kind, the record's format, this machine (`machine_key`) and `key` (what is
    measured), as JSON reads it back."""
    return json.loads(json.dumps({"kind": kind, "format": FORMAT, "machine": machine_key(), **key}, default=str))


def recorded(kind: str, key: dict, measure: Callable[[], object], parse: Callable[[object], T] | None = None,
             check: Callable[[T], str | None] | None = None) -> T:
    """The value recorded for (`kind`, this machine, `key`), else `measure()`, recorded for every later process.

    `measure` returns a JSON value (None included: "nothing to record but that it was measured"). `parse` turns a
    JSON value into what is returned, raising ValueError, TypeError or KeyError for one of the wrong type or range
    (default: the value as it is); `check`, given a recorded value (never one just measured), says why it does
    not hold on this machine (None: it holds). A recorded value `parse` rejects or `check` faults is reported in
    one line and measured again. The record is keyed by `entry_key`; `remeasuring()` makes every lookup measure
    again. A lookup that finds nothing measures under the record's lock (see the module docstring)."""
    parse = parse or (lambda value: value)
    full = entry_key(kind, key)
    name = f"{kind}-{_digest(full)[:20]}"
    path = record_path()
    if path is None:
        return parse(measure())
    rejected = _MISSING
    if not _remeasure:
        found, rejected = _lookup(path, name, full, parse, check)
        if found is not _MISSING:
            return found
    with _locked(path):
        if not _remeasure:  # another process may have measured while this one waited for the lock
            found, _ = _lookup(path, name, full, parse, check, skip=rejected)
            if found is not _MISSING:
                return found
        value = measure()
        parsed = parse(value)  # a probe's own answer: one that does not parse is a bug, raised
        _write(path, name, {"key": full, "value": value})
    return parsed


def _lookup(path: Path, name: str, full: dict, parse, check, skip=_MISSING) -> tuple[object, object]:
    """(the parsed recorded value or _MISSING, the raw value rejected or _MISSING). `skip`: a raw value already
    rejected by this process (the same entry read again: missing, without a second report)."""
    entry = _read(path).get(name)
    if not isinstance(entry, dict) or entry.get("key") != full or "value" not in entry:
        return _MISSING, _MISSING
    value = entry["value"]
    if skip is not _MISSING and value == skip:
        return _MISSING, value
    try:
        parsed = parse(value)
    except (KeyError, TypeError, ValueError) as e:
        _report_bad(path, f"the calibration record {path} holds an invalid {full['kind']} entry ({_shorten(value)}: "
                          f"{_reason(e)}); measuring again")
        return _MISSING, value
    fault = check(parsed) if check is not None else None
    if fault is not None:
        _warn(f"the recorded {full['kind']} {_shorten(value)} does not hold on this machine ({fault}); measuring "
              f"again")
        return _MISSING, value
    return parsed, _MISSING


def _report_bad(path: Path, message: str) -> None:
    """One line per record and process for its invalid entries (each is measured again)."""
    if str(path) not in _reported:
        _reported.add(str(path))
        _warn(message)


def _reason(error: Exception) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"missing {text}" if isinstance(error, KeyError) else text or type(error).__name__


def _shorten(value, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def remeasuring() -> Iterator[None]:
    """Within it, `recorded` measures again (and replaces the record) instead of reading it: `refusion calibrate`."""
    global _remeasure
    saved, _remeasure = _remeasure, True
    try:
        yield
    finally:
        _remeasure = saved


def recorded_here() -> list[dict]:
    """The record's entries for this machine as it is set now (`machine_key`: threads, dispatch, versions): each
    {"kind", "key" (the entry's own key, the machine's left out), "value"}, sorted by kind. Nothing is measured."""
    path = record_path()
    if path is None:
        return []
    machine = entry_key("", {})["machine"]
    entries = [e for e in _read(path).values() if isinstance(e, dict) and isinstance(e.get("key"), dict)
               and e["key"].get("machine") == machine and e["key"].get("format") == FORMAT]
    return sorted(({"kind": e["key"].get("kind"), "value": e.get("value"),
                    "key": {k: v for k, v in e["key"].items() if k not in ("kind", "format", "machine")}}
                   for e in entries), key=lambda e: (str(e["kind"]), json.dumps(e["key"], sort_keys=True)))


def describe_entry(entry: dict) -> str:
    """One line of `recorded_here()`'s: the kind, its key's short form and the value."""
    key = ", ".join(f"{k} {_short_key_value(v)}" for k, v in entry["key"].items())
    return f"{entry['kind']} [{key}]: {json.dumps(entry['value'], default=str)}"


def _short_key_value(value) -> str:
    if isinstance(value, str) and len(value) > 16 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a digest (a model's structure)
    return json.dumps(value, separators=(",", ":"), default=str)


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
        _report_bad(path, f"the calibration record {path} is unreadable (not a record refusion wrote); measuring "
                          f"again")
        return {}
    return record["entries"] if record.get("format") == FORMAT else {}


def _write(path: Path, name: str, entry: dict) -> None:
    """Add or replace one entry (under the record's lock): the file read again just before (another process may
    have added entries), written to a temporary file and renamed over the record, so no reader sees half of it."""
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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold the record's lock (`calibration.json.lock` beside it): one process measures and writes at a time. A
    measurement inside another's (this thread holds it already) goes on; a lock that cannot be taken (a read-only
    folder, LOCK_SECONDS of waiting) is reported in one line and the process measures for itself."""
    if getattr(_held, "depth", 0):
        _held.depth += 1
        try:
            yield
        finally:
            _held.depth -= 1
        return
    lock = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = _file_lock(path.with_name(path.name + ".lock"))
    except (OSError, TimeoutError) as e:
        _warn(f"cannot lock the calibration record {path} ({getattr(e, 'strerror', None) or e}); measuring "
              f"without waiting for other processes")
    _held.depth = 1
    try:
        yield
    finally:
        _held.depth = 0
        if lock is not None:
            lock.release()


class _Lock:
    """A held lock on a file: `release()` lets it go."""

    def __init__(self, release: Callable[[], None]):
        self.release = release


def _file_lock(lock_file: Path) -> _Lock:
    """Take the lock on `lock_file`, waiting up to LOCK_SECONDS (a TimeoutError after): `filelock` where it is
    installed, else `fcntl.flock`."""
    try:
        import filelock
    except ImportError:
        return _flock(lock_file)
    lock = filelock.FileLock(str(lock_file), timeout=LOCK_SECONDS)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise TimeoutError(f"another process held it for over {LOCK_SECONDS:.0f} s") from None
    return _Lock(lock.release)


def _flock(lock_file: Path) -> _Lock:
    import fcntl

    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(f"another process held it for over {LOCK_SECONDS:.0f} s") from None
            time.sleep(0.05)

    def release() -> None:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    return _Lock(release)


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
