"""The compact forward's decoder layers in C++: the same operations, without Python between them.

A one-token forward of SmolLM2-135M calls ~2,400 ATen operations besides its 121 products; called one by one from
Python each costs a few microseconds of interpreter and dispatch on top of its work, about a third of a decoding step
on a 2-core CPU. `NativeLayers` runs a `CompactForward`'s layer loop in a small C++ extension
(`csrc/decoder_layers.cpp`): the products through the same ATen kernels (packed bf16, int4, packed fp32, weight-major,
plain; fused or not, with a mask-gated adapter's updates), and what lies between them in a few fused passes that
compute every element with the operations and roundings of the Python loop's chain of ATen operations (bf16 widened to
fp32, each result rounded back as ATen rounds it, no FMA contraction): the norm with the residual add before it, a
mask-gated update added to its product's output, rotary embedding with the KV entries written where `SlotCache.write`
writes them, and exact attention over the cache's fp64 entries (products of bf16 numbers, exact in fp64, summed in an
order of its own, which does not change an exact sum; ATen's own sum and softmax for the reductions whose order does
matter). SiLU and sdpa stay ATen's. Its logits are the Python loop's bit for bit (tests/model/test_native.py), so
every guarantee of the compact forward (transformers' logits, rows as they would be alone) holds unchanged; measured
in docs/archive/RESULTS-LEDGER.md: *Native decoder layers*.

It applies to models on the CPU, under inference (no autograd), whose attention is exact attention (the row-exact
setup, the default where bf16 products are exact) or transformers' sdpa (the fp32 default elsewhere), whose products
are packed, int4, packed fp32 (`model.kernels.sgemm`), weight-major (`model.kernels.narrow`) or plain, with a SiLU MLP; anything else
runs the Python loop (and compiles nothing). The layers read the weights the Python loop would: packed and fused
weights are rebuilt when a weight is written or replaced, a layer switched to another kernel is followed, and an int4
layer's changed weight is refused as `Int4Linear` refuses it. The forward releases the GIL, so a server's other
threads run meanwhile.

The extension is built on first use (`model.kernels.extension`: ~30 s with g++, once per machine, torch version and
source). Where it cannot be built (no compiler) decoding runs the Python loop with one warning; `REFUSION_NATIVE=0`
skips it.
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

from refusion.model.kernels.extension import native_extension
from refusion.model.kernels.fused import LINEAR_NAMES, FusedProduct, base_of
from refusion.model.kernels.gated_lora import MaskGatedLoRA, mask_rows_of
from refusion.model.kernels.int4 import GROUP
from refusion.model.kernels.narrow import MAX_ROWS as NARROW_MAX_ROWS
from refusion.model.kernels.registry import BLOCK_KINDS, kernel_of_layer
from refusion.model.kernels.registry import kernel as registered_kernel
from refusion.model.kernels.row_exact import EXACT_ATTENTION, EXACT_HALF_ATTENTION, SOFTMAX_COLUMNS

ATTENTIONS = {EXACT_ATTENTION: 0, "sdpa": 1, EXACT_HALF_ATTENTION: 2}
"""The attention implementations the C++ layers compute (the constants of decoder_layers.cpp): exact attention,
transformers' sdpa function as it runs on a CPU, and exact attention over fp16 entries."""


def silu_types() -> tuple[type, ...]:
    """The MLP activations the C++ layers compute (F.silu): torch's, and transformers' where its modeling code is
    loaded (a transformers model's is; refusion's own model definition uses torch's)."""
    activations = sys.modules.get("transformers.activations")
    return (nn.SiLU,) if activations is None else (nn.SiLU, activations.SiLUActivation)


class NativeLayers:
    """A `CompactForward`'s decoder layers as one C++ call (see the module docstring). Called as
    `native(hidden, position_embeddings, masks, cache)` (masks: one per layer), it returns the hidden states after
    the last layer, or None when this forward runs the Python loop."""

    def __init__(self, compact, extension):
        self.compact = compact
        self.extension = extension
        self.mask_rows = mask_rows_of(compact.layers)
        """The adapter's record of the forward's mask rows (its updates read it), or None without an adapter."""
        self.sources: list[tuple[dict, str, torch.Tensor]] = []
        """(module's parameter or buffer dict, name, tensor) of every tensor the C++ layers read: one replaced or
        written since the stack was built means a rebuild (the stack's `fresh` checks, in C++)."""
        self.kinds: list[tuple[nn.Module, type]] = []
        """(linear layer, its type when built): a layer switched to another kernel since means a rebuild (`fresh`)."""
        self.bf16_only = False
        """Whether the stack has packed or int4 products, which multiply bf16 only (set when it is built)."""
        self.stack = None
        attn = compact.layers[0].self_attn
        self.kv_layout = (attn.config.num_key_value_heads, attn.head_dim)
        self.attention = ATTENTIONS[attn.config._attn_implementation]

    def __call__(self, hidden: torch.Tensor, position_embeddings, masks: list, cache,
                 ragged=None) -> torch.Tensor | None:
        """`ragged`: the `compact.Ragged` layout of a padded forward's real rows, which `hidden` holds alone."""
        if hidden.device.type != "cpu" or torch.is_grad_enabled() or hidden.numel() == 0:
            return None
        if self.stack is None or not self.stack.fresh():
            self.stack = self._build() if layers_supported(self.compact.layers) else None
            if self.stack is None:  # a layer was switched to a kernel the C++ layers do not compute
                return None
        if self.bf16_only and hidden.dtype != torch.bfloat16:
            return None  # packed and int4 layers fall back to F.linear then
        storage = cache.native_storage(*self.kv_layout, hidden.dtype)
        if storage is None:
            return None
        keys, values, start = storage
        cos, sin = position_embeddings
        rows = self.mask_rows
        dense, listed = (rows.dense, rows.rows) if rows is not None else (None, None)
        active = dense is not None and not (listed is not None and listed.numel() == 0)
        real, batch, width, split = ((None, hidden.shape[0], hidden.shape[1], ()) if ragged is None
                                     else (ragged.real, ragged.batch, ragged.width, ragged.split))
        return self.stack.forward(hidden, cos, sin, masks, keys, values, start, active,
                                  active and rows.gated, active and rows.kernel, dense, listed, real, batch, width,
                                  list(split))

    def _build(self):
        """The C++ stack of the layers as their modules stand now (packed and fused weights brought up to date)."""
        ext = self.extension
        self.sources, self.kinds = [], []
        layers = []
        for layer, fused in zip(self.compact.layers, self.compact.fused):
            attn, mlp = layer.self_attn, layer.mlp
            qkv = ([self._fused(fused["self_attn"])] if "self_attn" in fused
                   else [self._product(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)])
            gate_up = ([self._fused(fused["mlp"])] if "mlp" in fused
                       else [self._product(m) for m in (mlp.gate_proj, mlp.up_proj)])
            q_norm, k_norm = (self._norm(attn.q_norm), self._norm(attn.k_norm)) if self.compact.qk_norm else (None, None)
            layers.append(ext.Layer(self._norm(layer.input_layernorm), self._norm(layer.post_attention_layernorm),
                                    q_norm, k_norm, qkv, self._product(attn.o_proj), gate_up,
                                    self._product(mlp.down_proj), attn.head_dim, attn.scaling, self.attention,
                                    attn.num_key_value_groups, SOFTMAX_COLUMNS))
        self.bf16_only = any(kernel_of_layer(base).dtypes == ("bfloat16",) for base, _ in self.kinds)
        return ext.Stack(layers, self.sources, self.kinds)

    def _watch(self, tensors: dict, name: str) -> torch.Tensor | None:
        """A module's parameter or buffer (from its `_parameters` or `_buffers`), recorded among the sources."""
        tensor = tensors[name]
        if tensor is not None:
            self.sources.append((tensors, name, tensor))
        return tensor

    def _norm(self, norm: nn.Module):
        return self.extension.Norm(self._watch(norm._parameters, "weight"), norm.variance_epsilon)

    def _updates(self, wrapped: list[tuple[int, MaskGatedLoRA]]) -> list:
        """The mask-gated updates of (position in the product's output, member) pairs."""
        return [self.extension.Update(i, self._watch(m._buffers, "lora_a"), self._watch(m._buffers, "lora_b"))
                for i, m in wrapped]

    def _base(self, member: nn.Module) -> nn.Module:
        base = base_of(member)
        self.kinds.append((base, type(base)))
        self._watch(base._parameters, "weight")
        self._watch(base._parameters, "bias")
        return base

    def _product(self, member: nn.Module):
        """A lone linear layer (maybe wrapped in a mask-gated adapter) as the C++ layers compute it."""
        base = self._base(member)
        weight, bias = base._parameters["weight"], base._parameters["bias"]
        kernel = kernel_of_layer(base)  # the registry's entry: its name, its constant in decoder_layers.cpp
        packed = exact = scales = torch.empty(0)
        rows, low_rows, padded = 0, 0, []  # the row counts of packed (ExactRows) or narrow products
        if kernel.name == "sgemm":
            packed, exact = base._packed(), base.exact
        elif kernel.name == "packed":
            weight, rows, low_rows = base._packed(), base.exact_rows.high, base.exact_rows.low
        elif kernel.name in BLOCK_KINDS:
            weight, _, scales = base.blocks()
        elif kernel.name == "narrow":
            rows, low_rows, padded = NARROW_MAX_ROWS, base.packed_from, list(base.padded_rows)
            packed = base._packed() if base.packed_from else packed
        return self.extension.Product(kernel.native_code, weight, scales, bias, rows, low_rows, GROUP,
                                      [base.out_features],
                                      self._updates([(0, member)] if member is not base else []), packed, exact,
                                      padded)

    def _fused(self, product: FusedProduct):
        """A fused product as the C++ layers compute it (its stacked weights brought up to date)."""
        for member in product.members:
            self._base(member)
        product.refresh()
        kind = registered_kernel(product.kind).native_code
        scales = product.scales if product.scales is not None else torch.empty(0)
        if product.kind == "narrow":  # low: the rows from which the packed copy multiplies (0: none)
            rows, low_rows = NARROW_MAX_ROWS, product.packed_from
        else:
            rows, low_rows = (product.rows.high, product.rows.low) if product.rows else (0, 0)
        packed = product.packed if product.packed is not None else torch.empty(0)
        return self.extension.Product(kind, product.weight, scales, product.bias, rows, low_rows, GROUP,
                                      product.splits, self._updates(product.wrapped), packed, torch.empty(0),
                                      list(product.padded_rows))


def native_layers(compact) -> NativeLayers | None:
    """`NativeLayers` for a `CompactForward`, or None where the C++ layers do not apply (see the module docstring)
    or the extension cannot be built."""
    layers = compact.layers
    config = layers[0].self_attn.config
    attention = config._attn_implementation
    if attention not in ATTENTIONS or getattr(config, "attn_logit_softcapping", None):
        return None
    if any(p.device.type != "cpu" for p in layers.parameters()):  # a GPU's step is its kernels, not Python
        return None
    if attention == "sdpa" and not runs_own_sdpa(compact) and not sdpa_as_on_a_cpu():
        return None
    if not layers_supported(layers):
        return None
    extension = native_extension()
    return NativeLayers(compact, extension) if extension is not None else None


def layers_supported(layers: nn.ModuleList) -> bool:
    """Whether every decoder layer has a SiLU MLP, causal attention, and linear layers of the kinds the C++ layers
    compute (every registered kernel, maybe wrapped in a mask-gated adapter)."""
    for layer in layers:
        if type(layer.mlp.act_fn) not in silu_types() or not getattr(layer.self_attn, "is_causal", True):
            return False
        members = [getattr(getattr(layer, block), name) for block, names in LINEAR_NAMES.items() for name in names]
        if any(kernel_of_layer(base_of(m)) is None for m in members):
            return False
    return True


def runs_own_sdpa(compact) -> bool:
    """Whether the compact forward calls the sdpa function of refusion's own model definition (`model.definition`):
    the CPU branch of transformers' that the C++ layers mirror, whatever transformers would choose."""
    from refusion.model.definition import sdpa_attention_forward

    return compact.attention is sdpa_attention_forward


def sdpa_as_on_a_cpu() -> bool:
    """Whether transformers' sdpa function takes the branches the C++ layers mirror: not forced to grouped-query
    kernels (TRANSFORMERS_SDPA_FORCE_GQA) and no XPU, MPS or NPU torch (whose branches differ)."""
    from transformers.integrations import sdpa_attention as sdpa

    if os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA", "0") == "1":
        return False
    return not any(getattr(sdpa, flag, True) for flag in
                   ("_is_torch_xpu_available", "_is_torch_mps_available", "_is_torch_npu_available"))
