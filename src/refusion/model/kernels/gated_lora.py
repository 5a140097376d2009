"""The mask-gated LoRA layer: a low-rank update applied only at the rows of a forward that hold `<|mask|>`.

Used at inference by mask-gated adapters (`refusion.model.adapter`, docs/TRAINING.md "Mask-gated adapters") and, as
the same gate on peft's layers, in training (`adapter.gate_lora_at_masks`).
"""

from __future__ import annotations

import torch
from torch import nn

from refusion.model.kernels.extension import native_extension
from refusion.model.kernels.narrow import MAX_ROWS


class MaskRows:
    """The mask positions of the forward in progress, read from its input ids by a pre-hook on the model's
    input embeddings (every forward that passes `input_ids` goes through it first)."""

    def __init__(self, model, mask_token_id: int):
        self.mask_token_id = mask_token_id
        self.dense = None
        """[B, S, 1] bool: which positions hold the mask token."""
        self.rows = None
        """Flat indices (into B * S) of those positions."""
        self.kernel = True
        """Whether the updates are computed by `mask_update` where it takes them (on the CPU); False: by ATen's
        products, as before it (`benchmarks/drafters.py --aten-updates` compares the two)."""
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._read)

    def _read(self, module, args, kwargs=None):
        input_ids = args[0] if args else (kwargs or {})["input"]
        is_mask = input_ids == self.mask_token_id
        self.dense = is_mask.unsqueeze(-1)
        # compiled forwards have fixed shapes: no row list (its length depends on the data), the gate at every row
        self.rows = None if torch.compiler.is_compiling() else is_mask.reshape(-1).nonzero().squeeze(1)

    @property
    def gated(self) -> bool:
        """Whether the update is computed at every row times the 0/1 gate: in a narrow forward (at most MAX_ROWS
        positions, fewer ops than selecting the rows) and in a compiled one (fixed shapes)."""
        return self.dense is not None and (self.rows is None or self.dense.numel() <= MAX_ROWS)


def mask_rows_of(module: nn.Module) -> MaskRows | None:
    """The `MaskRows` that the mask-gated layers in `module` read, or None where it has none."""
    return next((m.mask_rows for m in module.modules() if isinstance(m, MaskGatedLoRA)), None)


def mask_update(x: torch.Tensor, rows: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                out: torch.Tensor) -> bool:
    """`out[rows] += (x[rows] @ lora_a) @ lora_b` by the native extension's loops (model/kernels/csrc, *mask updates*), on
    the CPU outside autograd; False (nothing done) where they do not take these inputs, or the extension is off.
    The C++ layers call the same loops for the same inputs, so every path gives a mask row the same bits; a row's
    result depends on that row alone. Why (two ATen products per adapted layer are mostly dispatch) and what it
    saves: docs/DECODING.md, *Mask-gated updates*."""
    if x.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    extension = native_extension()
    return extension is not None and extension.mask_update(x, rows, lora_a, lora_b, out)


class MaskGatedLoRA(nn.Module):
    """A linear layer plus a LoRA update applied only at the mask rows (inference; the base layer is untouched).

    The update is computed in fp32 whatever the base's dtype (`mask_update` on the CPU; elsewhere ATen products):
    it only ever touches mask rows, whose predictions are drafts."""

    def __init__(self, base: nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                 mask_rows: MaskRows):
        super().__init__()
        self.base_layer = base
        self.register_buffer("lora_a", lora_a.t().contiguous().float(), persistent=False)  # [in, r]
        self.register_buffer("lora_b", (lora_b.float() * scaling).t().contiguous(), persistent=False)  # [r, out]
        self.mask_rows = mask_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the wrapped layer is this module's own: no hooks to dispatch
        return self.add_update(x, self.base_layer.forward(x))

    def add_update(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add the update at the mask rows of `x` to `out`, the base layer's output for `x` (or a view of its
        columns in a larger product: `model.kernels.fused`), in place; returns `out`."""
        rows = self.mask_rows.rows
        if self.mask_rows.dense is None or (rows is not None and rows.numel() == 0):
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if self.mask_rows.kernel and rows is not None and mask_update(flat_x, rows, self.lora_a, self.lora_b, flat_out):
            return out
        if self.mask_rows.gated:  # every row times the 0/1 gate (a clean row gets + 0: its base output exactly)
            low = torch.mm(flat_x.to(self.lora_a.dtype), self.lora_a).mul_(self.mask_rows.dense.reshape(-1, 1))
            if flat_out.dtype == low.dtype:
                flat_out.addmm_(low, self.lora_b)
            else:
                flat_out.add_(torch.mm(low, self.lora_b).to(flat_out.dtype))
        else:
            low = torch.mm(flat_x.index_select(0, rows).to(self.lora_a.dtype), self.lora_a)
            flat_out.index_add_(0, rows, torch.mm(low, self.lora_b).to(flat_out.dtype))
        return out
