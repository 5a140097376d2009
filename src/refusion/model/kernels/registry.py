"""The one registry of linear kernels: each one's name, layer class, what it runs on, and whether it is row-exact.

`LINEAR_KERNELS` is the only place that maps a layer's class to a kernel: `prepare(linear=...)` and `--linear`
take its names (`LINEAR_CHOICES`), a model's setup reads its kernel off its layers (`linear_kernel_of`), the fused
products and the C++ layers ask `kernel_of_layer` (`native_code` is the constant of `csrc/decoder_layers.cpp`).

This module imports neither torch nor the kernels (the command line's `--help` reads the names); a kernel's class
is imported when asked for (`LinearKernel.layer_class`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class LinearKernel:
    """One linear kernel: a subclass of nn.Linear that multiplies its own way (same parameters, same state dict)."""

    name: str
    """What `prepare(linear=...)`, `--linear` and `Kernels.linear` call it."""
    class_path: str
    """"module:Class" of the layer class that multiplies by it (`layer_class` imports it)."""
    devices: tuple[str, ...]
    """Devices it runs on."""
    dtypes: tuple[str, ...]
    """Weight dtypes it multiplies ("*": any)."""
    needs: str
    """What the CPU and the torch build must have, in words ("": nothing more than torch)."""
    available: str | None
    """"module:function" answering whether this machine and torch build run it (a fact of the machine: no timing);
    None: wherever torch runs."""
    row_exact: bool
    """Whether each row of a product is computed bit for bit as it would be alone (with `row_exact.EXACT_ATTENTION`,
    forwards are then row-exact: `ModelSetup.row_exact`)."""
    rows_probe: str | None
    """"module:function" that checks row-exactness on this machine where the kernel's own code may not give it
    (deterministic: random inputs compared bit for bit, never timed); None: `row_exact` as stated."""
    native_code: int
    """Its product kind in the C++ decoder layers (`csrc/decoder_layers.cpp`)."""
    fuses: bool
    """Whether q/k/v and gate/up layers of this kernel are multiplied as one product (`fused`)."""
    auto: bool
    """Whether `linear="auto"` may choose it (int4: for fp32 GGUF models only, whose weights it keeps bit for bit;
    in bf16 it changes the numbers and is only pinned, as int4-q8, which rounds the rows, always is)."""
    summary: str
    """One line: what it does."""

    @property
    def layer_class(self) -> type:
        """The layer class (imported on first use)."""
        return _resolve(self.class_path)

    def is_available(self) -> bool:
        """Whether this machine and torch build run it."""
        return self.available is None or bool(_resolve(self.available)())

    def rows_match(self) -> bool:
        """Whether it is row-exact here (`row_exact`, confirmed by `rows_probe` where there is one)."""
        return self.row_exact and (self.rows_probe is None or bool(_resolve(self.rows_probe)()))


_KERNELS = "refusion.model.kernels"

LINEAR_KERNELS: tuple[LinearKernel, ...] = (
    LinearKernel("plain", "torch.nn:Linear", ("cpu", "cuda", "mps"), ("*",), "", None, row_exact=False,
                 rows_probe=None, native_code=0, fuses=False, auto=True,
                 summary="nn.Linear as transformers runs it"),
    LinearKernel("packed", f"{_KERNELS}.row_exact:PackedLinear", ("cpu",), ("bfloat16",),
                 "native bf16 (AMX tiles, or AVX512-BF16) and oneDNN", f"{_KERNELS}.row_exact:packing_available",
                 row_exact=True, rows_probe=None, native_code=1, fuses=True, auto=True,
                 summary="bf16 weights packed once by oneDNN, products at the row counts where every row is exact"),
    LinearKernel("narrow", f"{_KERNELS}.narrow:NarrowLinear", ("cpu",), ("*",), "", None, row_exact=False,
                 rows_probe=None, native_code=4, fuses=True, auto=True,
                 summary="weight-major products in few-row forwards (chosen where the probe measures them faster)"),
    LinearKernel("sgemm", f"{_KERNELS}.sgemm:SgemmLinear", ("cpu",), ("float32",), "MKL",
                 f"{_KERNELS}.sgemm:sgemm_available", row_exact=False, rows_probe=None, native_code=3, fuses=False,
                 auto=True, summary="fp32 weights packed once for MKL: F.linear's bits, faster"),
    LinearKernel("int4", f"{_KERNELS}.int4:Int4Linear", ("cpu",), ("bfloat16", "float32"),
                 "a GGUF file's Q4_0 / Q4_1 blocks; bf16: torch's int4 CPU kernel; fp32: refusion's C++ extension",
                 None, row_exact=True, rows_probe=f"{_KERNELS}.int4:int4_rows_match", native_code=2, fuses=True,
                 auto=True, summary="products by the GGUF file's 4-bit blocks (other rounding than the plain weights)"),
    LinearKernel("int4-q8", f"{_KERNELS}.int4:Int4Q8Linear", ("cpu",), ("float32",),
                 "a GGUF file's Q4_0 / Q4_1 blocks and refusion's C++ extension", f"{_KERNELS}.extension:native_available",
                 row_exact=True, rows_probe=f"{_KERNELS}.int4:int8_rows_match", native_code=5, fuses=True,
                 auto=False, summary="the GGUF file's blocks times rows rounded to 8-bit blocks, in integers, as "
                 "llama.cpp multiplies (other numbers than the base model's)"),
)
"""Every linear kernel. A model whose layers run several reports the last of them (int4 leaves the layers its file
does not ship packed; no other two share a model)."""

BLOCK_KINDS: tuple[str, ...] = ("int4", "int4-q8")
"""The kernels whose layers multiply by a GGUF file's blocks (`int4.Int4Linear` and its subclass `Int4Q8Linear`)."""

LINEAR_CHOICES: tuple[str, ...] = ("auto", *(k.name for k in LINEAR_KERNELS))
"""What `prepare(linear=...)` and `--linear` accept: "auto" chooses (`choice.choose_linear_kernel`); a kernel's
name pins it."""


def check_linear(linear: str) -> None:
    """A one-line ValueError unless `linear` is one of LINEAR_CHOICES (checked before a load, not after it)."""
    if linear not in LINEAR_CHOICES:
        raise ValueError(f"linear={linear!r} is invalid: must be one of {', '.join(LINEAR_CHOICES)}")


def kernel(name: str) -> LinearKernel:
    """The registered kernel called `name` (KeyError naming the choices otherwise)."""
    for entry in LINEAR_KERNELS:
        if entry.name == name:
            return entry
    raise KeyError(f"no linear kernel {name!r}: one of {', '.join(k.name for k in LINEAR_KERNELS)}")


def kernel_of_layer(layer) -> LinearKernel | None:
    """The kernel a layer multiplies by (its exact class), or None for a module that is no registered kernel's."""
    return _by_class().get(type(layer))


def linear_kernel_of(model) -> str:
    """The name of the kernel a model's linear layers run (the last in LINEAR_KERNELS that any of them runs)."""
    found = {kernel_of_layer(m) for m in model.modules()}
    return next((k.name for k in reversed(LINEAR_KERNELS) if k in found), "plain")


@functools.cache
def _by_class() -> dict[type, LinearKernel]:
    return {k.layer_class: k for k in LINEAR_KERNELS}


def _resolve(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)
