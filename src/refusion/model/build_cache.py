"""A disk cache of the models that `refusion.load` has to build (a GGUF file dequantized, an adapter merged).

Building the embedded model takes ~20 s on a laptop CPU (GGUF dequantization, peft merge); loading the
result back from safetensors takes well under a second. So the first `refusion.load()` saves what it built
(weights in the requested dtype, config, tokenizer) and later loads read it back.

* Location: `$REFUSION_CACHE/models/`, else `$XDG_CACHE_HOME/refusion/models/`, else `~/.cache/refusion/models/`;
  `REFUSION_CACHE=off` turns the cache off.
* Key: the identity of every input (path, size and mtime of the base files; the same plus a SHA-256 of each
  adapter file), the dtype, the versions of refusion, transformers, torch (and peft, gguf) and `FORMAT`.
  An entry for the same inputs under another key is stale: it is replaced, never used.
* Trust: an entry is used only when its manifest (written last) holds the same key and every listed file has
  the recorded size and SHA-256. A file that still has the size and modification time recorded when it was
  written is not hashed again (any write to it changes its modification time; hashing the weights took ~1 s of
  each cold start); one whose time differs (copied, touched, rewritten) is hashed and compared. Anything else
  (truncated or changed file, missing manifest, an entry that fails to load) is rebuilt. Entries are written into
  a temporary directory and renamed into place, so a crashed or concurrent build never leaves a half-written entry
  under the entry's name.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from refusion.cache_dirs import cache_root

FORMAT = 2
"""Bump when what is built (or how it is saved) changes, so that older entries are rebuilt."""
MANIFEST = "refusion_manifest.json"


def file_identity(path: Path, *, digest: bool = False) -> dict:
    """Name, size and mtime of a file (and its SHA-256 with `digest`): what says that an input has changed."""
    stat = path.stat()
    identity = {"name": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    if digest:
        identity["sha256"] = sha256_file(path)
    return identity


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of `packages` (read from their metadata, without importing them)."""
    found = {}
    for package in packages:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def cached_build(label: str, inputs: dict, key: dict, build: Callable[[], tuple], save: Callable[[tuple, Path], None],
                 load: Callable[[Path], tuple], read_back: Callable[[Path], bool] | None = None) -> tuple:
    """`load(entry)` of a verified cache entry, else `build()`, saved with `save(built, directory)`.

    Args:
        label: readable start of the entry's name ("refusion-smol-bfloat16").
        inputs: what is being built (paths, dtype); entries with the same inputs and another `key` are stale.
        key: the identity of the inputs' contents and of the code that builds them.
        read_back: where it says so of the entry just stored, `load(entry)` is returned instead of what was built
            (the same weights, loaded the way every later load will load them).
    """
    root = cache_root()
    if root is None:
        return build()
    family = f"{re.sub(r'[^A-Za-z0-9_.-]+', '-', label)}-{_digest(inputs)[:8]}"
    entry = root / f"{family}-{_digest({'inputs': inputs, 'key': key})[:16]}"
    problem = _check_entry(entry, inputs, key)
    if problem is None:
        try:
            return load(entry)
        except Exception as e:  # noqa: BLE001 - an entry that does not load is rebuilt, whatever the reason
            problem = f"does not load ({type(e).__name__})"
    if problem == "absent":
        _note(f"preparing {label} (first load only); caching it in {entry}")
    else:
        _note(f"the cached model {entry} {problem}: rebuilding it")
    built = build()
    _store(entry, inputs, key, built, save)
    _remove_stale(entry, family)
    if read_back is not None and _check_entry(entry, inputs, key) is None and read_back(entry):
        return load(entry)
    return built


def _check_entry(entry: Path, inputs: dict, key: dict) -> str | None:
    """None when the entry can be trusted, else what is wrong with it."""
    if not entry.is_dir():
        return "absent"
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return "has no readable manifest"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("inputs") != inputs \
            or manifest.get("key") != key:
        return "is stale"
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return "lists no files"
    for name, expected in files.items():
        path = entry / name
        try:
            stat = path.stat()
            if stat.st_size != expected["size"]:
                return f"has a truncated or changed file ({name})"
            if stat.st_mtime_ns != expected.get("mtime_ns") and sha256_file(path) != expected["sha256"]:
                return f"has a corrupted file ({name})"
        except (OSError, KeyError, TypeError):
            return f"is missing a file ({name})"
    return None


def _store(entry: Path, inputs: dict, key: dict, built: tuple, save: Callable[[tuple, Path], None]) -> None:
    """Write the entry atomically: into a temporary directory, manifest last, then renamed into place."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=entry.parent))
    except OSError as e:
        _note(f"cannot write the model cache in {entry.parent} ({e.strerror or e}); continuing without it")
        return
    try:
        save(built, tmp)
        files = {str(p.relative_to(tmp)): {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256_file(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file() and (stat := p.stat())}
        manifest = {"format": FORMAT, "inputs": inputs, "key": key, "files": files}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if entry.exists():
            _remove_dir(entry)
        with contextlib.suppress(OSError):  # another process stored it meanwhile: keep theirs (checked on load)
            os.rename(tmp, entry)
    except OSError as e:
        _note(f"cannot write the model cache in {entry.parent} ({e.strerror or e}); continuing without it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale(entry: Path, family: str) -> None:
    """Remove other entries of the same inputs (older keys): they can never be used again."""
    for other in entry.parent.glob(f"{family}-*"):
        if other != entry and other.is_dir():
            _remove_dir(other)


def _remove_dir(path: Path) -> None:
    """Rename aside, then delete: readers of the old entry keep their open files, nobody sees half of it."""
    trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.rename(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def _note(message: str) -> None:
    print(f"refusion: {message}", file=sys.stderr, flush=True)
