"""Narrow forwards on the CPU: linear layers that multiply weight-major when a forward has few rows.

Decoding forwards carry a handful of tokens (one in AR decoding, a few drafts or masks in the parallel modes).
On some CPU BLAS builds, `x @ W.T` for 2-32 rows costs about twice a one-row product, while the same product
taken weight-major, `(W @ x.T).T`, costs what one row costs: the forward is memory-bound either way, and only
the second form reads the weights once without repacking them. Wide forwards are then nearly as cheap as AR
ones, which is what the parallel modes need. Which form is faster depends on the CPU, the BLAS and the dtype,
so `use_narrow_linears` times both on the model's own weights and switches only when weight-major wins.

The switch changes the class of each plain `nn.Linear` to `NarrowLinear` (same parameters, same state dict);
forwards of more rows than `MAX_ROWS` (prefill, training) take the usual path.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32
"""Forwards of up to this many rows (batch x tokens) multiply weight-major; wider ones use F.linear."""
PROBE_ROWS = 4
"""Rows of the timed products that decide whether weight-major wins (a typical drafting forward)."""
MIN_GAIN = 1.15
"""Weight-major is used only when the probe finds it at least this much faster."""
PROBE_BYTES = 64 * 2**20
"""The probe streams at least this many bytes of weights (more than a CPU cache holds), or all of them."""


class NarrowLinear(nn.Linear):
    """nn.Linear whose forward of at most MAX_ROWS rows computes (W @ x.T).T."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or rows > MAX_ROWS or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        out = _weight_major_product(self.weight, x.reshape(rows, x.shape[-1]))
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The modules of a model whose class is exactly nn.Linear (subclasses compute something else)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


@torch.inference_mode()
def weight_major_speedup(layers: list[nn.Linear], rows: int = PROBE_ROWS, repeats: int = 3) -> float:
    """Time of x @ W.T over time of (W @ x.T).T, for `rows` rows through every layer in turn (the weights
    stream from memory as in a forward; one matrix alone would sit in cache). Median of interleaved repeats."""
    if not layers:
        raise ValueError("weight_major_speedup needs at least one linear layer to time")
    inputs = {}
    generator = torch.Generator(layers[0].weight.device).manual_seed(0)  # the caller's random state is left alone
    for layer in layers:
        key = (layer.in_features, layer.weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, layer.in_features, generator=generator, device=layer.weight.device).to(
                layer.weight.dtype)
    plain, major = [], []
    for _ in range(repeats):
        for products, form in ((plain, _plain_product), (major, _weight_major_product)):
            start = time.perf_counter()
            for layer in layers:
                form(layer.weight, inputs[layer.in_features, layer.weight.dtype])
            products.append(time.perf_counter() - start)
    return sorted(plain)[repeats // 2] / max(sorted(major)[repeats // 2], 1e-9)


def _probe_layers(layers: list[nn.Linear]) -> list[nn.Linear]:
    """The first layers holding PROBE_BYTES of weights (all of them in a smaller model)."""
    chosen, total = [], 0
    for layer in layers:
        chosen.append(layer)
        total += _bytes([layer])
        if total >= PROBE_BYTES:
            break
    return chosen


def _bytes(layers: list[nn.Linear]) -> int:
    return sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)


def _plain_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def _weight_major_product(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()


def use_narrow_linears(model: nn.Module, force: bool | None = None) -> int:
    """Make the plain linear layers of a CPU model multiply weight-major in narrow forwards, when that is faster
    here (force=True: always; False: never). Returns how many layers were switched."""
    layers = plain_linears(model)
    if not layers or force is False:
        return 0
    if force is None:
        if any(layer.weight.device.type != "cpu" for layer in layers):
            return 0
        if _bytes(layers) < PROBE_BYTES:
            return 0  # weights that fit in a CPU cache are not streamed: narrow forwards are cheap as they are
        if weight_major_speedup(_probe_layers(layers)) < MIN_GAIN:
            return 0
    for layer in layers:
        layer.__class__ = NarrowLinear
    return len(layers)
