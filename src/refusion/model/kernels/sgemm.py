"""fp32 products by MKL's packed sgemm: transformers' bits, without repacking the weight on every call.

An fp32 `F.linear` on an x86 CPU is an MKL sgemm. For a product of more than a few rows, MKL first copies the
weight into the layout its kernel streams (packing), on every call; decoding forwards of 16-64 rows (plan and
infill's blocks and slots, the exact mode's drafts, a batch) pay that copy each time. `torch.ops.mkl` packs a
weight once (`_mkl_reorder_linear_weight`) and multiplies by the packed copy (`_mkl_linear`): on a 2-core AMX
Xeon the layer products of SmolLM2-135M's shape at 32 rows cost 0.59 ms per layer packed against 0.92 ms plain,
and the LM head 8.5 ms against 10.1 (docs/archive/RESULTS-LEDGER.md: *Packed fp32 products*).

At most row counts that decoding uses the packed product is `F.linear` bit for bit: the same kernel, the same order
of summation (on that machine, for SmolLM2-135M's matrices: 16-56 rows for every one of them, from 4 rows for the
attention's, to 128 rows, as far as probed, for all but the down projection). At the others `F.linear` takes
another path (a small-matrix kernel below 16 rows, another blocking for the 1536-wide down projection from 57 rows)
that rounds differently. Which row counts match is a fact of the machine, the MKL build and the weight's shape,
so before its first product of each row count a layer multiplies random inputs of that many rows both ways and
compares them; from then on every layer of that shape multiplies packed at the row counts that matched and by
`F.linear` at the others. MKL also chooses by the thread count, so each thread count has its own record. A model
switched to `SgemmLinear` therefore computes what it computed before, bit for bit, faster: every guarantee of fp32 decoding (docs/DECODING.md,
Guarantees) holds unchanged.

`prepare` switches fp32 CPU models whose plain products it did not make weight-major (`model.kernels.narrow`) where the
probe also measures the packed product faster (`use_sgemm_linears`); `linear="sgemm"` pins it, `"plain"` keeps
`F.linear`. The packed copy lives beside the parameter (the state dict and training see the plain weight), is
rebuilt when the parameter changes, and doubles the weights' memory, so models above `MAX_PACKED_BYTES` are left
alone. Training, autograd and compiled forwards take `F.linear`.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from refusion.model.kernels.row_exact import MAX_PACKED_BYTES, packed_copy, speedup

MAX_ROWS = 256
"""Products of more rows than this (a long prefill) always take F.linear."""
SPEED_ROWS = 32
"""Rows of the timed products that decide whether packing pays (a block of plan and infill, a batch's forward)."""
MIN_GAIN = 1.1
"""Packed products are used only where the probe measures them at least this much faster."""
PACKED_FOR_ROWS = 64
"""The row count MKL packs a weight for (its layout depends on it; any row count can multiply by it): on the 2-core
AMX Xeon, packed for 64 rows the LM head multiplied 16-64 rows fastest (packed for 32, its products of 40 and 48
rows cost more than F.linear's)."""
NOT_PROBED, EXACT, INEXACT = 0, 1, 2
"""States of a row count in `SgemmLinear.exact` (the constants of decoder_layers.cpp)."""
_EXACT: dict[tuple[int, int, bool], torch.Tensor] = {}
"""The states (by thread count and row count) of each weight shape (in, out, bias), shared by its layers and by
the C++ layers."""


def thread_slots() -> int:
    """Rows of a state table: thread counts 0 .. this - 1 (a process with more threads takes F.linear)."""
    return max(os.cpu_count() or 1, torch.get_num_threads()) + 1


class SgemmLinear(nn.Linear):
    """nn.Linear whose fp32 CPU inference forwards multiply by an MKL-packed copy of its weight at the row counts
    where that gives F.linear's bits (probed on first use); other row counts, dtypes, training: F.linear."""

    exact: torch.Tensor
    """uint8 [thread_slots(), MAX_ROWS + 1], shared by the layers of this shape: per thread count and row count,
    NOT_PROBED, EXACT (the packed product is F.linear's bits) or INEXACT. MKL chooses its kernels by the thread
    count as well (on the 2-core Xeon, 576 x 576 products of 4-15 rows match with 2 threads, not with 1)."""

    packed_weight: torch.Tensor | None = None
    """The MKL-packed copy of the weight (`_packed`)."""

    packed_key: tuple | None = None
    """(data pointer, version) of the weight `packed_weight` was packed from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        threads = torch.get_num_threads()
        if (rows == 0 or rows > MAX_ROWS or threads >= self.exact.shape[0] or x.dtype != torch.float32
                or x.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling()):
            return F.linear(x, self.weight, self.bias)
        state = int(self.exact[threads, rows])
        if state == NOT_PROBED:
            state = self._probe(threads, rows)
        if state == INEXACT:
            return F.linear(x, self.weight, self.bias)
        return self._packed_product(x.reshape(rows, self.in_features)).view(*x.shape[:-1], self.out_features)

    def _probe(self, threads: int, rows: int) -> int:
        """Whether products of `rows` rows on `threads` threads give F.linear's bits packed (on random inputs of
        their own, so that no input decides it by chance), recorded for every layer of this shape."""
        generator = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, self.in_features, generator=generator)
        same = torch.equal(self._packed_product(x), F.linear(x, self.weight, self.bias))
        self.exact[threads, rows] = EXACT if same else INEXACT
        return int(self.exact[threads, rows])

    def _packed_product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkl._mkl_linear(flat, self._packed(), self._parameters["weight"], self._parameters["bias"],
                                         flat.shape[0])

    def _packed(self) -> torch.Tensor:
        """The packed weight, rebuilt when the parameter was written or replaced since it was packed."""
        return packed_copy(self, pack)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """MKL's packed copy of an fp32 [out, in] weight (usable for products of any number of rows)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)


@functools.cache
def sgemm_available() -> bool:
    """Whether this torch build multiplies by MKL-packed fp32 weights (a fact of the build: asked once)."""
    try:
        return bool(torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
                    and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


@torch.inference_mode()
def packed_speedup(layers: list[nn.Linear], rows: int = SPEED_ROWS, repeats: int = 3) -> float:
    """Time of F.linear over time of the packed product, `rows` rows through one layer of each shape in turn
    (fastest of interleaved repeats)."""
    one_each = list({(layer.in_features, layer.out_features): layer for layer in layers}.values())
    generator = torch.Generator().manual_seed(0)  # the caller's random state is left alone
    x = {layer.in_features: torch.randn(rows, layer.in_features, generator=generator) for layer in one_each}
    packed = [pack(layer.weight.detach()) for layer in one_each]

    def plain_pass() -> None:
        for layer in one_each:
            F.linear(x[layer.in_features], layer.weight, layer.bias)

    def packed_pass() -> None:
        for layer, w in zip(one_each, packed):
            torch.ops.mkl._mkl_linear(x[layer.in_features], w, layer.weight, layer.bias, rows)

    return speedup(plain_pass, packed_pass, repeats)


def use_sgemm_linears(model: nn.Module, force: bool | None = None) -> int:
    """Switch the plain linear layers of an fp32 CPU model to `SgemmLinear` where MKL packs weights and (unless
    `force`) the probe measures packed products faster; `force=False` switches nothing. Returns how many layers
    were switched."""
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    if force is False or not layers or not sgemm_available():
        return 0
    if any(layer.weight.device.type != "cpu" or layer.weight.dtype != torch.float32 for layer in layers):
        return 0
    if sum(layer.weight.numel() * 4 for layer in layers) > MAX_PACKED_BYTES:
        return 0
    if force is None and packed_speedup(layers) < MIN_GAIN:
        return 0
    for layer in layers:
        layer.__class__ = SgemmLinear
        key = (layer.in_features, layer.out_features, layer.bias is not None)
        layer.exact = _EXACT.setdefault(key, torch.zeros(thread_slots(), MAX_ROWS + 1, dtype=torch.uint8))
    return len(layers)
