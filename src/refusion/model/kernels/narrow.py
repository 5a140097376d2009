"""Narrow forwards on the CPU: linear layers that multiply weight-major when a forward has few rows.

Decoding forwards carry a handful of tokens (one in AR decoding, a few drafts or masks in the parallel modes).
On some CPU BLAS builds, `x @ W.T` for 2-32 rows costs about twice a one-row product, while the same product
taken weight-major, `(W @ x.T).T`, costs what one row costs: the forward is memory-bound either way, and only
the second form reads the weights once without repacking them. Wide forwards are then nearly as cheap as AR
ones, which is what the parallel modes need. Which form is faster depends on the CPU, the BLAS and the dtype,
so `use_narrow_linears` times both on the model's own weights and switches only when weight-major wins.

The switch changes the class of each plain `nn.Linear` to `NarrowLinear` (same parameters, same state dict);
forwards of more rows than `MAX_ROWS` (prefill, training) take the usual path.

Some BLAS kernels are also slower for some row counts than for a few more (on a 2-core AVX2 EPYC, fp32: a whole
forward of one row cost 1.15x one of two, three rows 1.11x four), so the probe also times 1..`PAD_PROBE_ROWS` rows and a narrow product is
padded with zero rows up to the count that is fastest, where that saves at least `MIN_PAD_GAIN`.

Weight-major is the cheap form for one or two rows, not for more: where oneDNN's fp32 kernel over a weight packed
once into its layout beats it from some row count on (`packed_rows_from`; 3-5 rows on a 2-core AVX-512 EPYC, 1.4-1.9x
faster up to a prefill), products of that many rows or more multiply by such a copy (`NarrowLinear.packed_from`).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import nn

from refusion.model.kernels.row_exact import MAX_PACKED_BYTES, packed_copy, packed_product, reorder_weight

MAX_ROWS = 32
"""Forwards of up to this many rows (batch x tokens) multiply weight-major; wider ones use F.linear."""
PROBE_ROWS = 4
"""Rows of the timed products that decide whether weight-major wins (a typical drafting forward)."""
MIN_GAIN = 1.15
"""Weight-major is used only when the probe finds it at least this much faster."""
PROBE_BYTES = 64 * 2**20
"""The probe streams at least this many bytes of weights (more than a CPU cache holds), or all of them."""
PAD_PROBE_ROWS = 8
"""Row counts 1..this are timed to choose the padding of narrow products; wider ones are never padded."""
MIN_PAD_GAIN = 1.1
"""A product is padded to more rows only when those are at least this much faster."""
PACKED_PROBE_ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
"""Row counts at which `packed_rows_from` times oneDNN's packed products against the weight-major ones."""
MIN_PACKED_GAIN = 1.1
"""Products from some row count on use the packed copy only where it is at least this much faster at that count
(and no slower at any probed count after it)."""


class NarrowLinear(nn.Linear):
    """nn.Linear whose forward of at most MAX_ROWS rows computes (W @ x.T).T, and of `packed_from` rows or more
    (where set) multiplies by a oneDNN-packed copy of the weight."""

    padded_rows: tuple[int, ...] = ()
    """padded_rows[r]: the rows a product of r rows is computed with (zero rows added); r where absent."""

    packed_from: int = 0
    """Inference products of at least this many rows (any number, a prefill too) multiply by a oneDNN-packed copy
    of the weight (`packed_weight`), where `packed_rows_from` found it faster; 0: never."""

    packed_weight: torch.Tensor | None = None
    """The oneDNN-packed copy of the weight (`row_exact.packed_copy`), built on first use."""

    packed_key: tuple | None = None
    """(data pointer, version) of the weight `packed_weight` was packed from."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return narrow_product(x, self.weight, self.bias, self.padded_rows, self.packed_from, self._packed)

    def _packed(self) -> torch.Tensor:
        """The packed weight, rebuilt when the parameter was written or replaced since it was packed."""
        return packed_copy(self, reorder_weight)


def narrow_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, padded_rows: tuple[int, ...],
                   packed_from: int = 0, packed=None) -> torch.Tensor:
    """x @ weight.T (+ bias) as `NarrowLinear` computes it, for inputs of the weight's dtype: by the packed copy
    (`packed()`) from `packed_from` rows on in eager inference (0: never; compiled forwards keep the products they
    were compiled with), else weight-major for at most MAX_ROWS rows,
    padded with zero rows to padded_rows[rows]; F.linear otherwise. (A fused narrow product, `model.kernels.fused`, calls it
    with its members' weights stacked.)"""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or x.dtype != weight.dtype:
        return F.linear(x, weight, bias)
    if (0 < packed_from <= rows and not torch.is_grad_enabled() and x.device.type == "cpu"
            and not torch.compiler.is_compiling()):
        return packed_product(x.reshape(rows, x.shape[-1]), packed(), bias).view(*x.shape[:-1], weight.shape[0])
    if rows > MAX_ROWS:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = padded_rows[rows] if rows < len(padded_rows) else rows
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[1])])
    out = _weight_major_product(weight, flat, rows)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The modules of a model whose class is exactly nn.Linear (subclasses compute something else)."""
    return [m for m in model.modules() if type(m) is nn.Linear]


@torch.inference_mode()
def weight_major_speedup(layers: list[nn.Linear], rows: int = PROBE_ROWS, repeats: int = 3) -> float:
    """Time of x @ W.T over time of (W @ x.T).T, for `rows` rows through every layer in turn (the weights
    stream from memory as in a forward; one matrix alone would sit in cache). Median of interleaved repeats."""
    inputs = _probe_inputs(layers, rows, "weight_major_speedup")
    plain, major = [], []
    for _ in range(repeats):
        plain.append(_seconds_through(layers, _plain_product, inputs, rows))
        major.append(_seconds_through(layers, _weight_major_product, inputs, rows))
    return _median(plain) / max(_median(major), 1e-9)


@torch.inference_mode()
def weight_major_row_times(layers: list[nn.Linear], max_rows: int = PAD_PROBE_ROWS, repeats: int = 3) -> list[float]:
    """Seconds of weight-major products of 1..max_rows rows through every layer in turn (median of interleaved
    repeats); element r - 1 is r rows."""
    inputs = _probe_inputs(layers, max_rows, "weight_major_row_times")
    times = [[] for _ in range(max_rows)]
    for _ in range(repeats):
        for rows in range(1, max_rows + 1):
            times[rows - 1].append(_seconds_through(layers, _weight_major_product, inputs, rows))
    return [_median(t) for t in times]


def _probe_inputs(layers: list[nn.Linear], rows: int, caller: str) -> dict:
    """One random [rows, in_features] input per (in_features, dtype) of the layers, from a generator of its own
    (the caller's random state is left alone)."""
    if not layers:
        raise ValueError(f"{caller} needs at least one linear layer to time")
    generator = torch.Generator(layers[0].weight.device).manual_seed(0)
    inputs = {}
    for layer in layers:
        key = (layer.in_features, layer.weight.dtype)
        if key not in inputs:
            inputs[key] = torch.randn(rows, layer.in_features, generator=generator,
                                      device=layer.weight.device).to(layer.weight.dtype)
    return inputs


def _seconds_through(layers: list[nn.Linear], form, inputs: dict, rows: int) -> float:
    """Seconds of one product of `rows` rows through every layer in turn, in the given form."""
    start = time.perf_counter()
    for layer in layers:
        form(layer.weight, inputs[layer.in_features, layer.weight.dtype][:rows])
    return time.perf_counter() - start


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def row_padding(times: list[float], min_gain: float = MIN_PAD_GAIN) -> tuple[int, ...]:
    """From the times of 1..n rows: for each row count r (index r; 0 for index 0), the count in r..min(2r, n) that
    is fastest, when it beats r's own time by min_gain, else r itself."""
    padding = [0]
    for rows in range(1, len(times) + 1):
        best = min(range(rows, min(2 * rows, len(times)) + 1), key=lambda r: times[r - 1])
        padding.append(best if times[best - 1] * min_gain <= times[rows - 1] else rows)
    return tuple(padding)


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


def _weight_major_product(weight: torch.Tensor, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """(W @ x.T).T, its first `rows` rows (all: None) copied out alone (the rows of zero padding never are: a
    transposed copy of a whole head's logits costs more than the rows wanted)."""
    return torch.mm(weight, x.t()).t()[:rows].contiguous()


@torch.inference_mode()
def packed_rows_from(layers: list[nn.Linear], padded_rows: tuple[int, ...], repeats: int = 3) -> int:
    """The fewest rows from which products by oneDNN-packed copies of the weights beat the weight-major ones (padded
    as `padded_rows` says) by MIN_PACKED_GAIN at every count of PACKED_PROBE_ROWS from there, timed through every
    layer in turn (the fastest of interleaved repeats); 0 where no such count is, or this torch cannot pack."""
    try:
        pairs = [(layer.weight, reorder_weight(layer.weight.detach())) for layer in layers]
    except (AttributeError, RuntimeError):
        return 0  # no oneDNN in this build, or none for this dtype
    inputs = _probe_inputs(layers, 2 * max(PACKED_PROBE_ROWS), "packed_rows_from")

    def seconds(rows: int, packed: bool) -> float:
        padded = padded_rows[rows] if rows < len(padded_rows) else rows
        start = time.perf_counter()
        for weight, copy in pairs:
            x = inputs[weight.shape[1], weight.dtype]
            if packed:
                packed_product(x[:rows], copy, None)
            else:
                _weight_major_product(weight, x[:padded], rows)
        return time.perf_counter() - start

    major, packed = [], []
    for rows in PACKED_PROBE_ROWS:
        times = {False: [], True: []}
        for _ in range(repeats):
            for form in times:
                times[form].append(seconds(rows, packed=form))
        major.append(min(times[False]))
        packed.append(min(times[True]))
    return packed_from_times(major, packed)


def packed_from_times(major: list[float], packed: list[float], min_gain: float = MIN_PACKED_GAIN) -> int:
    """From the times of weight-major and packed products at PACKED_PROBE_ROWS: the fewest of those rows at which
    the packed ones are at least min_gain faster and from which they are never slower; 0 where none is. (Asking for
    the gain at every count from there kept 5-7 rows weight-major on E5, 1.15-1.5x slower there, because at 16 and
    32 rows the two forms cost the same.)"""
    for i, rows in enumerate(PACKED_PROBE_ROWS):
        if packed[i] * min_gain <= major[i] and all(p <= m for m, p in zip(major[i:], packed[i:], strict=True)):
            return rows
    return 0


def use_narrow_linears(model: nn.Module, force: bool | None = None,
                       padded_rows: tuple[int, ...] | None = None, packed_from: int | None = None) -> int:
    """Make the plain linear layers of a CPU model multiply weight-major in narrow forwards, when that is faster
    here (force=True: always; False: never), with the row padding the probe finds fastest (or `padded_rows`, see
    NarrowLinear), and by oneDNN-packed copies of the weights from the row count where the probe finds those faster
    (or from `packed_from`; by the probe only for a model whose weights fit MAX_PACKED_BYTES, as the copies double
    them; with force=True only where given). Returns how many layers were switched."""
    layers = plain_linears(model)
    if not layers or force is False:
        return 0
    if force is None:
        if any(layer.weight.device.type != "cpu" for layer in layers):
            return 0
        if _bytes(layers) < PROBE_BYTES:
            return 0  # weights that fit in a CPU cache are not streamed: narrow forwards are cheap as they are
        probed = _probe_layers(layers)
        if weight_major_speedup(probed) < MIN_GAIN:
            return 0
        if padded_rows is None:
            padded_rows = row_padding(weight_major_row_times(probed))
        if packed_from is None and _bytes(layers) <= MAX_PACKED_BYTES:
            packed_from = packed_rows_from(probed, padded_rows or ())
    for layer in layers:
        layer.__class__ = NarrowLinear
        if padded_rows:
            layer.padded_rows = padded_rows
        if packed_from:
            layer.packed_from = packed_from
    return len(layers)
