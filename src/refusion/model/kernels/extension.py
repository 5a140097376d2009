"""The C++ extension of refusion (`csrc/`), built and loaded here for the modules that call it: the compact forward's
decoder layers (`model.kernels.native`), the mask-gated adapter's updates (`model.kernels.gated_lora`) and fp32
products by a GGUF file's blocks (`model.kernels.int4`).

It is compiled once per machine, torch version and source (~30 s with g++; `ninja` is a dependency) into torch's
extension directory (`TORCH_EXTENSIONS_DIR`, else ~/.cache/torch_extensions) and loaded from there afterwards.
Where it cannot be built (no compiler) its callers run their Python paths with one warning; `REFUSION_NATIVE=0`
skips it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

from refusion.cache_dirs import OFF_VALUES

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "decoder_layers.cpp", CSRC / "block_products.cpp")
"""The extension's translation units (`block_products.h` is read into its build tag with them)."""
HEADERS = (CSRC / "block_products.h",)
EXTENSION = "refusion_native"
"""The extension's module name (and its folder under torch's extension directory)."""
NATIVE_ENV = "REFUSION_NATIVE"
"""Set to 0 (or off) to decode without the extension (nothing is compiled)."""
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
"""OpenMP for ATen's parallel loops in the extension, on Linux, where torch's own libgomp serves them (elsewhere
they run on one thread: the same results)."""
CFLAGS = ["-O3", "-ffp-contract=off", *OPENMP]
"""Compiler flags: no contraction of a product and a sum into an FMA (the fused kernels round as ATen's
operations do)."""
STALE_LOCK_SECONDS = 600
"""A build lock older than this is left over from a build that was stopped (Ctrl-C during the first run, a killed
process): torch waits on such a lock forever, so it is removed. A build takes ~30-60 s."""


@functools.cache
def native_extension():
    """The compiled extension module, built on first use (see the module docstring); None where it cannot be."""
    if os.environ.get(NATIVE_ENV, "").strip().lower() in OFF_VALUES:
        return None
    built = build_directory() / f"{EXTENSION}.so"
    if built.exists() and not (built.parent / "lock").exists():  # built for this source: imported as it is
        try:
            return _import_built(built)
        except ImportError:  # a damaged file: torch's build below checks and rebuilds it
            pass
    try:
        from torch.utils import cpp_extension

        # torch's extension directory (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions), one folder per source
        directory = Path(cpp_extension._get_build_directory(EXTENSION, verbose=False)) / build_tag()
        directory.mkdir(parents=True, exist_ok=True)
        remove_stale_lock(directory / "lock")
        if not (directory / f"{EXTENSION}.so").exists():
            print("refusion: compiling the native decoder layers (once per machine and torch version, ~30 s)",
                  file=sys.stderr, flush=True)
        return cpp_extension.load(EXTENSION, [str(path) for path in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=list(OPENMP),
                                  build_directory=str(directory), verbose=False)  # copies: load extends them
    except Exception as e:  # no compiler, no ninja, a build error: the Python loop decodes the same tokens
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        warnings.warn(f"refusion: the native decoder layers could not be built ({reason}); decoding runs the "
                      f"Python layer loop (same tokens, slower)", stacklevel=2)
        return None


def build_directory() -> Path:
    """The folder torch's `load` builds this source in (`cpp_extension._get_build_directory` plus `build_tag`),
    worked out without importing `cpp_extension`."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        from torch import _appdirs

        root = os.path.join(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")),
                            f"{python}_{accelerator}")
    return Path(root) / EXTENSION / build_tag()


def _import_built(path: Path):
    """The extension built at `path` imported directly: importing torch's `cpp_extension` and letting its `load`
    re-check the build through ninja took ~0.2 s of every cold start, where the folder's tag already names the
    source, flags and versions it was built from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(EXTENSION, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[EXTENSION] = module
    return module


@functools.cache
def build_tag() -> str:
    """The extension's build tag: `source_tag` of its files (the folder it is built in, and part of the
    calibration record's key for what it computes)."""
    return source_tag(CSRC)


def source_tag(csrc: Path) -> str:
    """A digest of the extension's files in `csrc` (this tree's, or an earlier checkout's), the compiler flags, and
    torch's and Python's versions."""
    source = b"".join((csrc / path.name).read_bytes() for path in (*SOURCES, *HEADERS))
    return hashlib.sha256(source + " ".join(CFLAGS).encode() + torch.__version__.encode()
                          + sys.version.encode()).hexdigest()[:16]


def remove_stale_lock(lock: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Remove a build lock older than `max_age` seconds (a stopped build's); True when one was removed."""
    import time

    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age <= max_age:
        return False
    lock.unlink(missing_ok=True)
    print(f"refusion: removed a build lock left {age / 60:.0f} min ago by a stopped build ({lock})",
          file=sys.stderr, flush=True)
    return True


def native_available() -> bool:
    """Whether the C++ layers run in this process (built or loaded; not turned off by REFUSION_NATIVE=0)."""
    return native_extension() is not None


def native_tag() -> str | None:
    """`build_tag()` of the extension running in this process; None where none runs (`native_available`)."""
    return build_tag() if native_available() else None
