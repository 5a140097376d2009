"""One product for the linear layers that read the same input: q/k/v of an attention block, gate/up of an MLP.

On the CPU a decoding forward of a small model is a few rows through many small matrices, and each kernel call
has a fixed cost besides its weights' bytes (tens of microseconds for a oneDNN call on packed bf16 weights, even
for one row). A `FusedProduct` multiplies once by the members' weights stacked along the output features and
hands each member its columns, with a mask-gated adapter's update added to its own member's columns
(`MaskGatedLoRA.add_update`). Measured: docs/archive/RESULTS-LEDGER.md: *Fused products* (the kernel
calls themselves: the journal, "Fused products, fp64 KV entries, llama.cpp again").

A product over more output features only gives each member's own bits when the kernel sums every output over
the input features in the same order whatever the other outputs: true of the packed bf16 and int4 CPU kernels
measured so far, but a fact of the machine and torch build, so `fusion_is_exact` checks it once per kind and
shape on random weights, and members fuse only where it holds. The decoding forward that fuses
(`model.compact`) therefore keeps transformers' logits bit for bit, and every row stays as it would be alone.

Fused weights are built on the first call and follow the members: a packed product is re-packed when a member's
weight changes (the members drop their own packed copies, which they rebuild if called alone again); the int4
members' 4-bit weights become row slices of the fused one, stacked from theirs (no second copy; torch packs
rows in blocks, so this holds where each member's rows fill whole blocks, which the probe checks), and a changed
weight is refused as `Int4Linear` refuses it. Weight-major narrow products (`model.kernels.narrow`, fp32 on CPUs without
native bf16) fuse the same way: the members' weights become row slices of the stacked one (one copy, as for
int4; a member written in place writes the stacked weight, and a replaced one is stacked again), which the fused
product multiplies in forwards of at most `narrow.MAX_ROWS` rows, padded as the members pad theirs; wider
forwards (a prefill) take the members' own products. Where the members multiply by oneDNN-packed copies from some
row count on (`NarrowLinear.packed_from`), the fused product packs the stacked weight once instead (the members
drop their copies) and takes every forward from that count on, a prefill too. Plain fp32 products are left as they
are.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from refusion.model.kernels.extension import native_available
from refusion.model.kernels.gated_lora import MaskGatedLoRA
from refusion.model.kernels.int4 import (
    GROUP,
    STALE_BLOCKS,
    Int4Blocks,
    block_product,
    pack_fp32,
    takes_rows,
)
from refusion.model.kernels.narrow import MAX_ROWS as NARROW_MAX_ROWS
from refusion.model.kernels.narrow import narrow_product
from refusion.model.kernels.registry import BLOCK_KINDS, kernel_of_layer
from refusion.model.kernels.row_exact import (
    chunked_product,
    exact_rows,
    packed_product,
    reorder_weight,
    weight_key,
)

LINEAR_NAMES = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
"""A decoder layer's linear layers, by the block that holds them."""
FUSED_GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}
"""Sub-layers of a decoder layer whose linear layers read the same input, by the block that holds them."""
PROBE_ROWS = (1, 2, 5, 33)
"""Row counts `fusion_is_exact` compares (33: past the packed kernel's exact chunk of 32 rows); narrow products:
every count they multiply weight-major, 1..narrow.MAX_ROWS."""
FUSION_PROBE_VERSION = 1
"""Part of `fusion_is_exact`'s record key: bump when `probe_fusion` changes what it reports."""
PACKED_PROBE_ROWS = (*range(1, 34), 64, 100)
"""Row counts at which `fusion_is_exact` compares the packed copies of narrow products (any count takes them)."""


def base_of(layer: nn.Module) -> nn.Module:
    """The linear layer that computes a member's product (a mask-gated adapter's wrapped layer)."""
    return layer.base_layer if isinstance(layer, MaskGatedLoRA) else layer


def kind_of(layer: nn.Module) -> str | None:
    """The registered kernel of a layer whose products fuse ("packed", "int4", "int4-q8" or "narrow": `fuses`),
    else None."""
    kernel = kernel_of_layer(layer)
    return kernel.name if kernel is not None and kernel.fuses else None


class FusedProduct:
    """The products of `members` (linear layers over one input, each maybe wrapped in a `MaskGatedLoRA`) as one
    kernel call: `fused(x)` returns their outputs in order, views of one tensor."""

    def __init__(self, block: str, members: list[nn.Module], kind: str):
        self.block = block
        """The decoder layer's block the members are in (a key of FUSED_GROUPS)."""
        self.members = members
        self.bases = [base_of(m) for m in members]
        self.kind = kind
        self.in_features = self.bases[0].in_features
        self.splits = [b.out_features for b in self.bases]
        self.rows = exact_rows(self.in_features, sum(self.splits)) if kind == "packed" else None
        self.wrapped = [(i, m) for i, m in enumerate(members) if m is not self.bases[i]]
        """(position, member) of the members whose mask-gated update is added to their columns."""
        self.key: list | None = None
        """The members' weight and bias keys the fused weights were built from (`_keys`)."""
        self.weight: torch.Tensor | None = None
        """The stacked weights as the kernel takes them (oneDNN-packed bf16, or 4-bit blocks)."""
        self.scales: torch.Tensor | None = None
        """int4: the blocks' scales and zeros, stacked."""
        self.bias: torch.Tensor | None = None
        self.padded_rows: tuple[int, ...] = self.bases[0].padded_rows if kind == "narrow" else ()
        """narrow: the members' row padding (`NarrowLinear.padded_rows`), which the stacked product keeps."""
        self.packed_from: int = self.bases[0].packed_from if kind == "narrow" else 0
        """narrow: the members' `NarrowLinear.packed_from`; products of that many rows or more (a prefill too)
        multiply by `packed`, oneDNN's copy of the stacked weight."""
        self.packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.computes(x):
            return tuple(m.forward(x) for m in self.members)  # what the members' own forwards compute then
        self.refresh()
        flat = x.reshape(-1, self.in_features)
        if self.kind == "packed":
            out = chunked_product(flat, self.weight, self.bias, self.rows)
        elif self.kind == "narrow":
            out = narrow_product(flat, self.weight, self.bias, self.padded_rows, self.packed_from, self._packed)
        elif x.dtype == torch.float32:
            out = block_product(flat, self.weight, self.scales, self.bias, int8_rows=self.bases[0].int8_rows)
        else:
            out = torch._weight_int4pack_mm_for_cpu(flat.contiguous(), self.weight, GROUP, self.scales)
            if self.bias is not None:
                out = out + self.bias
        parts = out.view(*x.shape[:-1], out.shape[-1]).split(self.splits, -1)
        for i, member in self.wrapped:
            member.add_update(x, parts[i])
        return parts

    def computes(self, x: torch.Tensor) -> bool:
        """Whether the fused kernel takes this input: an inference forward on the CPU of bf16 rows (packed), of rows
        the blocks' kernel takes (int4: `int4.takes_rows`), or of at most narrow.MAX_ROWS rows of the weights'
        dtype (narrow; any number with packed copies)."""
        if x.device.type != "cpu" or torch.is_grad_enabled() or x.numel() == 0:
            return False
        if self.kind == "narrow":
            rows = x.numel() // self.in_features
            return x.dtype == self.bases[0]._parameters["weight"].dtype and (rows <= NARROW_MAX_ROWS
                                                                               or self.packed_from > 0)
        if self.kind in BLOCK_KINDS:
            return takes_rows(x, self.bases[0]._buffers["int4_scales"])
        return x.dtype == torch.bfloat16

    def _packed(self) -> torch.Tensor | None:
        """narrow: the packed copy of the stacked weight (built with it)."""
        return self.packed

    def refresh(self) -> None:
        """Bring the fused weights up to date with the members' (built on first use, rebuilt after a change)."""
        keys = self._keys()
        if keys != self.key:
            self._build(keys)

    def _keys(self) -> list:
        """What the fused weights must be rebuilt for: the members' weight keys (packed) or the keys their 4-bit
        blocks were switched for (int4; a member whose weight changed since is refused), and their bias keys (the
        stacked bias is a copy)."""
        weights = [weight_key(b._parameters["weight"]) for b in self.bases]  # the dicts read directly: every call
        if self.kind in BLOCK_KINDS and weights != [b.int4_key for b in self.bases]:
            raise RuntimeError(STALE_BLOCKS)
        biases = [b._parameters["bias"] for b in self.bases]
        return weights + [None if bias is None else weight_key(bias) for bias in biases]

    def _build(self, keys: list) -> None:
        self.key = keys
        biases = [b._parameters["bias"] for b in self.bases]
        self.bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
        if self.kind == "packed":
            stacked = torch.cat([b._parameters["weight"].detach() for b in self.bases])
            self.weight = torch.ops.mkldnn._reorder_linear_weight(stacked, None)
            for base in self.bases:  # the fused copy replaces theirs (rebuilt if a member is called alone)
                base.packed_weight, base.packed_key = None, None
            return
        if self.kind == "narrow":
            weights = [b._parameters["weight"] for b in self.bases]
            self.weight = stacked_rows(weights)  # stacked by an earlier product of these members: no copy
            if self.weight is None:
                with torch.inference_mode(False), torch.no_grad():  # a weight an inference tensor could not hold
                    self.weight = torch.cat([w.detach() for w in weights])
                    start = 0
                    for weight, rows in zip(weights, self.splits):  # each member reads its rows of the stacked weight
                        weight.data = self.weight[start:start + rows]
                        start += rows
                self.key = self._keys()  # the members' weights as they now stand
            if self.packed_from:
                self.packed = reorder_weight(self.weight)
                for base in self.bases:  # the fused copy replaces theirs (rebuilt if a member is called alone)
                    base.packed_weight, base.packed_key = None, None
            return
        self.weight = torch.cat([b._buffers["int4_weight"] for b in self.bases])  # packed row by row
        scales = [b._buffers["int4_scales"] for b in self.bases]  # bf16: [K/GROUP, N, 2]; fp32: [N, K/GROUP, 2]
        self.scales = torch.cat(scales, 1 if scales[0].dtype == torch.bfloat16 else 0).contiguous()
        start = 0
        for base, rows in zip(self.bases, self.splits):  # the members read their rows of the fused weight
            base._buffers["int4_weight"] = self.weight[start:start + rows]
            start += rows


def stacked_rows(weights: list[torch.Tensor]) -> torch.Tensor | None:
    """The one tensor whose consecutive blocks of rows the 2-D `weights` are, in order (a narrow product's stacked
    weight, which its members read), or None where they are not."""
    first = weights[0]
    offset = first.storage_offset()
    for weight in weights:
        if (not weight.is_contiguous() or weight.storage_offset() != offset
                or weight.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return None
        offset += weight.numel()
    return first.detach().as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


def fuse(block: str, members: list[nn.Module]) -> FusedProduct | None:
    """A `FusedProduct` of `members` (the linear layers FUSED_GROUPS names in `block`), or None when they cannot
    share one call: different kernels or inputs, a bias on some only, or a kernel whose fused product is not each
    member's own bit for bit here (`fusion_is_exact`)."""
    bases = [base_of(m) for m in members]
    kinds = {kind_of(b) for b in bases}
    if len(members) < 2 or len(kinds) != 1 or None in kinds:
        return None
    (kind,) = kinds
    if len({b.in_features for b in bases}) != 1 or len({b.bias is None for b in bases}) != 1:
        return None
    if len({(b.weight.device, b.weight.dtype) for b in bases}) != 1:
        return None
    if kind == "narrow" and len({(b.padded_rows, b.packed_from) for b in bases}) != 1:
        return None
    shapes = tuple(b.out_features for b in bases)
    packed = kind == "narrow" and bases[0].packed_from > 0
    if not fusion_is_exact(kind, bases[0].in_features, shapes, bases[0].bias is not None, bases[0].weight.dtype,
                           packed):
        return None
    return FusedProduct(block, members, kind)


def fused_products(layer: nn.Module) -> dict[str, FusedProduct]:
    """{block name: its `FusedProduct`} for the blocks of a decoder layer whose members fuse (`FUSED_GROUPS`)."""
    fused = {}
    for block_name, names in FUSED_GROUPS.items():
        block = getattr(layer, block_name, None)
        members = [getattr(block, name, None) for name in names]
        if block is not None and all(isinstance(m, nn.Module) for m in members):
            product = fuse(block_name, members)
            if product is not None:
                fused[block_name] = product
    return fused


@functools.cache
def fusion_is_exact(kind: str, in_features: int, out_features: tuple[int, ...], bias: bool,
                    dtype: torch.dtype = torch.bfloat16, packed: bool = False) -> bool:
    """Whether one `kind` product over weights of these shapes stacked gives, bit for bit, each one's own product
    (`probe_fusion`): probed once per machine and shape and recorded (`model.calibration`; the probe compares bits,
    so it gives the same answer every time, but it took ~0.4 s of every start). A recorded "exact" is checked
    before it is used, at one row count (`probe_fusion` over (1,)): a stale or edited record would void the
    exactness promise silently."""
    from refusion.model import calibration

    def parse(value) -> bool:
        calibration.require(isinstance(value, bool), "true or false")
        return value

    def check(exact: bool) -> str | None:
        if exact and not probe_fusion(kind, in_features, out_features, bias, dtype, packed, rows=(1,)):
            return "a product of one row differs"
        return None

    key = {"fused": kind, "shape": [list(out_features), in_features], "bias": bias, "dtype": str(dtype),
           "packed": packed, "version": FUSION_PROBE_VERSION}
    return calibration.recorded("fusion_is_exact", key,
                                lambda: probe_fusion(kind, in_features, out_features, bias, dtype, packed),
                                parse=parse, check=check)


@torch.no_grad()
def probe_fusion(kind: str, in_features: int, out_features: tuple[int, ...], bias: bool,
                 dtype: torch.dtype = torch.bfloat16, packed: bool = False, rows: tuple[int, ...] | None = None) -> bool:
    """Whether one `kind` product over weights of these shapes stacked gives, bit for bit, each one's own product,
    for every row count of PROBE_ROWS (narrow: 1..narrow.MAX_ROWS, in `dtype`, the weights' own, and with `packed`
    the products of oneDNN-packed copies too, at PACKED_PROBE_ROWS; random weights from a generator of its own);
    `rows`: at those row counts alone."""
    generator = torch.Generator().manual_seed(0)
    total = sum(out_features)
    if kind == "narrow":
        weights = torch.randn(total, in_features, generator=generator).to(dtype)
        stacked_bias = torch.randn(total, generator=generator).to(dtype) if bias else None
        biases = stacked_bias.split(out_features) if bias else [None] * len(out_features)
        x = torch.randn(max(PACKED_PROBE_ROWS), in_features, generator=generator).to(dtype)
        if not all(torch.equal(torch.cat([narrow_product(x[:n], w, b, ()) for w, b in
                                          zip(weights.split(out_features), biases)], -1),
                               narrow_product(x[:n], weights, stacked_bias, ()))
                   for n in rows or range(1, NARROW_MAX_ROWS + 1)):
            return False
        if not packed:
            return True
        alone = [reorder_weight(w.contiguous()) for w in weights.split(out_features)]
        together = reorder_weight(weights)
        return all(torch.equal(torch.cat([packed_product(x[:n], w, b) for w, b in zip(alone, biases)], -1),
                               packed_product(x[:n], together, stacked_bias)) for n in rows or PACKED_PROBE_ROWS)
    biases = torch.randn(total, generator=generator).to(torch.bfloat16) if bias else None
    x = torch.randn(max(PROBE_ROWS), in_features, generator=generator).to(torch.bfloat16)
    if kind == "packed":
        weights = torch.randn(total, in_features, generator=generator).to(torch.bfloat16)
        fused = torch.ops.mkldnn._reorder_linear_weight(weights, None)
        alone = [torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), None) for w in weights.split(out_features)]
        rows = [exact_rows(in_features, n) for n in out_features]
        fused_rows = exact_rows(in_features, total)

        def products(n: int):
            b = biases.split(out_features) if bias else [None] * len(out_features)
            own = torch.cat([chunked_product(x[:n], w, bb, r) for w, bb, r in zip(alone, b, rows)], -1)
            return own, chunked_product(x[:n], fused, biases, fused_rows)
    elif kind in BLOCK_KINDS and dtype == torch.float32:
        if not native_available():
            return False
        q = torch.randint(0, 16, (total, in_features), generator=generator, dtype=torch.int32)
        scale, offset = torch.rand(2, total, in_features // GROUP, generator=generator).half().float()
        fused, fused_dm = pack_fp32(Int4Blocks(q, scale, offset))
        parts = list(zip(fused.split(out_features), fused_dm.split(out_features)))
        x = x.float()

        def products(n: int):
            b = biases.float().split(out_features) if bias else [None] * len(out_features)
            q8 = kind == "int4-q8"
            own = torch.cat([block_product(x[:n], w, dm, bb, int8_rows=q8) for (w, dm), bb in zip(parts, b)], -1)
            return own, block_product(x[:n], fused, fused_dm, biases.float() if bias else None, int8_rows=q8)
    elif kind == "int4":
        q = torch.randint(0, 16, (total, in_features), generator=generator, dtype=torch.int32)
        scales = torch.rand(in_features // GROUP, total, 2, generator=generator).to(torch.bfloat16)
        alone = [torch._convert_weight_to_int4pack_for_cpu(part.contiguous(), 1) for part in q.split(out_features)]
        fused = torch.cat(alone)  # as `FusedProduct` builds it: right only where the packing is row by row
        own_scales = [part.contiguous() for part in scales.split(out_features, 1)]

        def products(n: int):
            own = torch.cat([torch._weight_int4pack_mm_for_cpu(x[:n], w, GROUP, s)
                             for w, s in zip(alone, own_scales)], -1)
            together = torch._weight_int4pack_mm_for_cpu(x[:n], fused, GROUP, scales)
            return (own + biases, together + biases) if bias else (own, together)
    else:
        return False
    return all(torch.equal(*products(n)) for n in rows or PROBE_ROWS)
