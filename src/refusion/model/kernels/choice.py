"""Which linear kernel a model gets (`choose_linear_kernel`), and whether its forwards are row-exact.

"auto" decides by what the machine is, never by how busy it is: bf16 weights on a CPU with native bf16 (AMX or
AVX512-BF16, where packed products are exact row by row: deterministic probes) are packed (`row_exact`). fp32
weights loaded from a GGUF file's 4-bit blocks, on a CPU whose refusion block kernel is vectorized (AVX2 and FMA),
multiply by those blocks (`int4`: the same weights bit for bit, summed in another order as the other fp32 kernels
sum them, at a fraction of the bytes). Elsewhere the choice between weight-major (`narrow`), MKL-packed (`sgemm`)
and plain products needs a clock; it is timed once per machine and model and recorded (`model.calibration`), and
every later process applies the recorded decision without timing anything.
"""

from __future__ import annotations

from pathlib import Path

from refusion.model import calibration
from refusion.model.calibration import require, whole
from refusion.model.kernels.registry import (
    BLOCK_KINDS,
    check_linear,
    kernel,
    kernel_of_layer,
    linear_kernel_of,
)

PINNED = "pinned by the caller"
PROBE_VERSION = 2
"""Part of the linear-kernel decision's record key: bump when `measured_choice` changes what it decides. 2: packed
copies from the first row count where they win by MIN_PACKED_GAIN and never lose after (`narrow.packed_from_times`)."""
CHOICES = ("plain", "narrow", "sgemm")
"""The kernels a recorded decision may name (`measured_choice`)."""


def choose_linear_kernel(model, linear: str = "auto", weights_file: str | Path | None = None) -> tuple[str, str]:
    """Switch the model's plain linear layers to the kernel `linear` asks for ("auto": see the module docstring);
    returns (the kernel, why)."""
    from refusion.model.kernels.narrow import use_narrow_linears
    from refusion.model.kernels.row_exact import use_packed_linears
    from refusion.model.kernels.sgemm import use_sgemm_linears

    check_linear(linear)
    if linear in BLOCK_KINDS:
        switched, total = use_shipped_int4(model, weights_file, int8_rows=linear == "int4-q8")
        use_packed_linears(model)  # the layers the file does not ship in 4 bits (embedding / LM head, adapters)
        return linear, f"{PINNED}: {switched} of {total} linear layers multiply by the file's blocks"
    if linear == "plain":
        return "plain", PINNED
    if linear == "auto":
        chosen = fp32_blocks(model, weights_file)
        if chosen is not None:
            return chosen
    if linear in ("auto", "packed"):
        if use_packed_linears(model):
            return "packed", (PINNED if linear == "packed" else
                              "bf16 on a CPU with native bf16: weights packed once, products row-exact")
        if linear == "packed":
            raise ValueError("linear='packed' needs bf16 weights on a CPU whose torch packs them (AMX or "
                             "AVX512-BF16; this model or this machine has neither); use 'auto', 'plain' or 'narrow'")
    if linear == "sgemm":
        if use_sgemm_linears(model, force=True):
            return "sgemm", PINNED
        raise ValueError("linear='sgemm' needs fp32 weights on a CPU whose torch has MKL (this model or this "
                         "machine has neither); use 'auto', 'plain' or 'narrow'")
    if linear == "narrow":
        use_narrow_linears(model, force=True)
        return "narrow", PINNED
    return recorded_choice(model)


def recorded_choice(model) -> tuple[str, str]:
    """"auto" where packing does not apply: the probes' decision for this machine and model, read from the
    calibration record, else timed now (`measured_choice`) and recorded."""
    from refusion.model.kernels.narrow import plain_linears

    layers = plain_linears(model)
    if not layers or any(layer.weight.device.type != "cpu" for layer in layers):
        return "plain", "not a CPU model: its layers as transformers runs them"
    measured_now = []
    decision = calibration.recorded("linear_kernel", {"model": calibration.structure_key(model),
                                                      "version": PROBE_VERSION},
                                    lambda: measured_now.append(True) or measured_choice(model), parse=parse_choice)
    if not measured_now:
        apply_choice(model, decision)
    return describe_choice(decision, measured_now=bool(measured_now))


def measured_choice(model) -> dict:
    """Time the probes on the model's own weights, switch its layers to what they find fastest, and return the
    decision as `apply_choice` reads it: {"linear", "padded_rows", "packed_from"}."""
    from refusion.model.kernels.narrow import NarrowLinear, use_narrow_linears
    from refusion.model.kernels.sgemm import use_sgemm_linears

    if not use_narrow_linears(model):
        use_sgemm_linears(model)
    narrow = next((m for m in model.modules() if isinstance(m, NarrowLinear)), None)
    return {"linear": linear_kernel_of(model),
            "padded_rows": list(getattr(narrow, "padded_rows", ()) or ()) if narrow is not None else None,
            "packed_from": int(getattr(narrow, "packed_from", 0) or 0) if narrow is not None else None}


def parse_choice(value) -> dict:
    """A recorded decision as `measured_choice` returns it, checked: a ValueError (or TypeError) for one of the
    wrong type or range (an unknown kernel, a row padding that is not a count at least as large as the rows it pads)."""
    require(isinstance(value, dict), "a dict")
    require(value.get("linear") in CHOICES, f"linear: one of {', '.join(CHOICES)}")
    padded_rows, packed_from = value.get("padded_rows"), value.get("packed_from")
    require(padded_rows is None or isinstance(padded_rows, list), "padded_rows: a list or null")
    for count, rows in enumerate(padded_rows or ()):  # a product of `count` rows computed with `rows`
        whole(rows, count)
    if packed_from is not None:
        whole(packed_from, 0)
    return {"linear": value["linear"], "padded_rows": padded_rows, "packed_from": packed_from}


def apply_choice(model, decision: dict) -> None:
    """Switch the model's plain layers as a recorded decision (`parse_choice`) says (nothing timed)."""
    from refusion.model.kernels.narrow import use_narrow_linears
    from refusion.model.kernels.sgemm import use_sgemm_linears

    name = decision["linear"]
    if name == "narrow":
        use_narrow_linears(model, force=True, padded_rows=tuple(decision.get("padded_rows") or ()) or None,
                           packed_from=decision.get("packed_from") or None)
    elif name == "sgemm":
        use_sgemm_linears(model, force=True)


def describe_choice(decision, *, measured_now: bool) -> tuple[str, str]:
    """(kernel, why) of a recorded or just measured decision."""
    when = "measured now and recorded" if measured_now else "recorded for this machine"
    name = decision.get("linear", "plain") if isinstance(decision, dict) else "plain"
    if name == "narrow":
        packed_from = decision.get("packed_from")
        return "narrow", (f"the probe measured few-token products faster weight-major on this CPU ({when})"
                          + (f", and from {packed_from} rows by weights packed once for oneDNN" if packed_from else ""))
    if name == "sgemm":
        return "sgemm", f"fp32 on a CPU with MKL: weights packed once, products F.linear's bits (measured faster; {when})"
    return "plain", f"weights that fit in the CPU cache, or weight-major and packed products measured no faster ({when})"


def fp32_blocks(model, weights_file: str | Path | None) -> tuple[str, str] | None:
    """"auto" for an fp32 CPU model loaded from a GGUF file: ("int4", why) where the file's 4-bit blocks are the
    model's weights and refusion's block kernel runs vectorized here (facts of the file and the CPU, no timing);
    None otherwise (no GGUF, no 4-bit blocks, weights that are not the file's, another dtype or device)."""
    import torch

    from refusion.model.kernels.int4 import blocks_vectorized

    parameter = next(model.parameters())
    if (weights_file is None or not str(weights_file).endswith(".gguf") or parameter.device.type != "cpu"
            or parameter.dtype != torch.float32 or not blocks_vectorized()):
        return None
    try:
        switched, total = use_shipped_int4(model, weights_file)
    except ValueError:  # no 4-bit blocks in the file, or weights that are no longer the file's (a merged adapter)
        return None
    return "int4", (f"fp32 weights of a GGUF file's blocks on a CPU with AVX2: {switched} of {total} linear layers "
                    "multiply by the blocks (the same weights, a fraction of the bytes)")


def use_shipped_int4(model, weights_file: str | Path | None, int8_rows: bool = False) -> tuple[int, int]:
    """Switch the layers a GGUF file ships in blocks to `Int4Linear` (`int8_rows`: `Int4Q8Linear`, the kernel
    "int4-q8"); returns (switched, linear layers in all). Raises a one-line ValueError when that cannot be done."""
    import torch
    from torch import nn

    from refusion.model.kernels.extension import native_available
    from refusion.model.kernels.int4 import (
        Int4Linear,
        Int4Q8Linear,
        int4_available,
        shipped_int4,
        use_int4_linears,
    )

    parameter = next(model.parameters())
    if int8_rows and (parameter.dtype != torch.float32 or not native_available()):
        raise ValueError("linear='int4-q8' rounds fp32 rows to 8 bits in refusion's C++ extension: load with "
                         "dtype='float32' on a machine that builds it (or use linear='int4')")
    if weights_file is None or not str(weights_file).endswith(".gguf"):
        raise ValueError("linear='int4' multiplies by the 4-bit blocks of a GGUF file (Q4_0 / Q4_1): load a .gguf "
                         "model (or the embedded one, whose base is one)")
    if parameter.device.type != "cpu" or parameter.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError("linear='int4' multiplies on the CPU, in fp32 or bf16: load with device='cpu' and "
                         "dtype='float32' or 'bfloat16'")
    if parameter.dtype == torch.bfloat16 and not int4_available():
        raise ValueError("linear='int4' in bf16 runs torch's int4 CPU kernel, which this torch build lacks: load "
                         "with dtype='float32'")
    total = sum(isinstance(m, nn.Linear) for m in model.modules())
    switched = use_int4_linears(model, shipped_int4(weights_file, model), Int4Q8Linear if int8_rows else Int4Linear)
    if switched == 0:
        raise ValueError(f"linear='int4': {weights_file} has no Q4_0 / Q4_1 weights of this model's linear layers")
    return switched, total


def forwards_row_exact(model, linear: str, attention: str) -> bool:
    """Whether every row of the model's forwards is computed bit for bit as it would be alone: exact attention (over
    fp64 or fp16 entries), and every linear layer multiplying by a row-exact kernel (`LinearKernel.rows_match`) of
    which `linear` is one."""
    from torch import nn

    from refusion.model.kernels.row_exact import EXACT_ATTENTIONS

    if attention not in EXACT_ATTENTIONS or not kernel(linear).rows_match():
        return False
    kernels = {kernel_of_layer(m) for m in model.modules() if isinstance(m, nn.Linear)}
    return all(k is not None and k.rows_match() for k in kernels)
