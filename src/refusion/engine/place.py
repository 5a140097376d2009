"""Where the engine lives and who it is: its owner-only directory, its socket, its start lock and log, the
keep-alive setting, and the identity a client compares with its own before it talks to an engine.

The standard library only: the client imports this on every command.
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

DIR_ENV = "REFUSION_ENGINE_DIR"
"""Overrides the engine's directory (default: $XDG_RUNTIME_DIR/refusion, else /tmp/refusion-UID)."""
KEEP_ALIVE_ENV = "REFUSION_KEEP_ALIVE"
"""Default of --keep-alive: how long the engine keeps a model loaded after its last answer."""
DEFAULT_KEEP_ALIVE = 300.0
"""Seconds: ollama's default, long enough for a conversation's pauses, short enough not to hold memory for hours."""
SOCKET, START_LOCK, LOG = "engine.sock", "start.lock", "engine.log"
IDENTITY_PREFIXES = ("REFUSION_", "OMP_", "MKL_", "ONEDNN_", "DNNL_", "ATEN_", "TORCH_", "HF_", "TRANSFORMERS_",
                     "XDG_CACHE_HOME", "PYTHONPATH", "CUDA_VISIBLE_DEVICES")
"""Environment variables that can change what an engine loads or computes: an engine started under other values
is not the one a command asked for."""
IDENTITY_IGNORED = (DIR_ENV, KEEP_ALIVE_ENV, "REFUSION_API_KEY", "REFUSION_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS",
                    "TRANSFORMERS_VERBOSITY")
"""...but these, which say where the engine is, how long it stays and what it logs, not what it computes."""
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def engine_dir(create: bool = True) -> Path:
    """The engine's directory, created owner-only (0700) when missing. A directory another user owns, or that
    others may enter, is refused: whoever can enter it could talk to the engine or replace its socket."""
    path = _default_dir()
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        info = path.lstat()
    except FileNotFoundError:
        return path
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ValueError(f"refusing the engine directory {path}: it must be a directory owned by you and closed to "
                         f"others (chmod 700 {path}), or set {DIR_ENV}")
    return path


def _default_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV]).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "refusion"
    return Path("/tmp") / f"refusion-{os.getuid()}"


def socket_path(directory: Path | None = None) -> Path:
    return (directory or engine_dir()) / SOCKET


def parse_keep_alive(text: str | float | None) -> float:
    """Seconds from "300", "90s", "5m", "1h" (0: no engine, decode in-process); None: the environment's, else the
    default. A bad value is a ValueError naming it."""
    if text is None:
        text = os.environ.get(KEEP_ALIVE_ENV, "").strip() or DEFAULT_KEEP_ALIVE
        where = KEEP_ALIVE_ENV
    else:
        where = "--keep-alive"
    if isinstance(text, (int, float)):
        return float(text)
    value = text.strip().lower()
    scale = UNITS.get(value[-1:])
    number = value[:-1] if scale is not None else value
    try:
        seconds = float(number) * (scale or 1.0)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{where}={text} is invalid: give seconds (300), or a duration such as 90s, 5m or 1h; "
                         "0 decodes in-process")
    return seconds


def identity() -> dict:
    """What makes an engine the one this command would be: refusion's version and source (an edit or an upgrade
    restarts the engine), the Python running it and the environment that changes what it computes."""
    from refusion import __version__

    env = {k: v for k, v in sorted(os.environ.items())
           if k.startswith(IDENTITY_PREFIXES) and k not in IDENTITY_IGNORED}
    python = [sys.prefix, os.path.realpath(sys.executable)]  # `python` and `python3` of one environment are one
    return {"version": __version__, "source": source_digest(), "python": python, "env": env}


def source_digest() -> str:
    """A digest of the installed package's files (path, size, modification time): ~2 ms, no file read."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".cpp", ".json", ".yaml")):
                info = os.stat(os.path.join(folder, name))
                digest.update(f"{folder}/{name}:{info.st_size}:{info.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]
