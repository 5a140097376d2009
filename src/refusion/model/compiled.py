"""Compiled forwards: the model's forward through `torch.compile`, over a few fixed shapes a whole decode reuses.

A decode runs forwards of many widths (one token in AR decoding, 1 + drafts in the exact mode, slots and masks in
plan and infill) over a cache that fills up. A compiled graph is specialised to its shapes, so the decoder keeps
them few: the cache has fixed shapes (`SlotCache(static=...)`: the whole buffer is attended, a forward writes at
columns given by an index tensor), its capacity is rounded up to a multiple of `CAPACITY_STEP`, and a forward is
padded up to the next of `WIDTH_BUCKETS` (padding tokens are invisible to every other token and leave nothing in the
cache). Forwards wider than the last bucket (prompts) run eager over the same cache. On a GPU the graphs are
replayed as CUDA graphs (`mode="reduce-overhead"`): one launch per forward instead of one per kernel.

What compiling costs and buys is measured, not assumed (docs/BENCHMARKS.md); it is off unless asked for
(`refusion.load(compile=True)`, `--compile`). The compiler's own cache (torch's inductor cache, on disk) makes a
second process compile faster; CUDA graphs are recorded again in every process.
"""

from __future__ import annotations

import torch

WIDTH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
"""Widths a compiled forward is specialised for; a forward is padded up to the next one, a wider one runs eager."""

CAPACITY_STEP = 256
"""A compiled decode's KV capacity is a multiple of this, so requests of similar lengths share graphs."""


def compile_model(model, *, backend: str = "inductor", mode: str | None = None):
    """`model` wrapped by `torch.compile` (nothing is compiled until the first call): shapes static, and on a GPU
    replayed as CUDA graphs. `backend`: torch.compile's ("inductor"; "aot_eager" traces without generating code)."""
    from refusion.model.kernels.row_exact import PackedLinear

    for module in model.modules():  # compiled forwards read the packed weights, they do not pack them
        if isinstance(module, PackedLinear):
            module._packed()
    if mode is None and backend == "inductor":
        device = next(model.parameters()).device
        mode = "reduce-overhead" if device.type == "cuda" else "default"
    return torch.compile(model, backend=backend, mode=mode, dynamic=False)


RECOMPILE_LIMIT = 64
"""Graphs one compiled model may hold (torch's default, 8, is reached by widths times batch sizes as a batch's
sequences finish one by one); past it, forwards run uncompiled."""


def run_compiled(compiled, **inputs):
    """One forward of the compiled model. Its outputs live until the next compiled forward (CUDA graphs reuse
    their output buffers): copy what must outlive it."""
    torch.compiler.cudagraph_mark_step_begin()
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
        return compiled(**inputs)


def bucket_width(width: int) -> int | None:
    """The compiled width a forward of `width` tokens runs at, or None when it is wider than every bucket."""
    return next((bucket for bucket in WIDTH_BUCKETS if bucket >= width), None)


def static_capacity(needed: int) -> int:
    """`needed` KV columns rounded up to a multiple of CAPACITY_STEP."""
    return -(-needed // CAPACITY_STEP) * CAPACITY_STEP
