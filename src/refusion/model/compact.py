"""A compact decoding forward for the model families refusion decodes most: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

transformers' forward of a decoder layer passes through decorators, keyword plumbing, an attention-interface lookup
and a module call per sub-layer: on a CPU, where a small model's one-token forward takes tens of milliseconds,
that Python is a tenth of the step. `CompactForward` runs the same operations in the same order on the model's own
modules, weights and functions (its linear layers, norms, rotary embedding and its application, attention
function, the mask-gated adapter), so its logits are transformers' bit for bit (tested logit for logit on every
supported family, fp32 and bf16), and skips the rest: the norms and linear layers inside the layers are called
through their `forward` (no hook dispatch; the embedding and the LM head stay module calls, so their hooks run),
the family's functions are looked up once, and KV entries go straight to the `SlotCache`.

Any other model, a model in training, or one with hooks on its sub-layers (offloading, peft's wrappers) decodes
through transformers' forward: `compact_forward(model)` returns None for it.

A batch of requests of different widths is one padded forward (left padding, `decode.forward.padded_inputs`). Given
the `Ragged` layout of its real tokens, the compact forward runs the embedding, norms, products and MLPs over
those rows alone and only attention over the padded layout (the rows scattered into it and gathered back): every
real row gets the operations it gets padded, and the padding rows, a third of a batch's rows on the engine
benchmark, cost no products. The LM head then computes only the logits the requests asked for.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from refusion.model.kernels.fused import LINEAR_NAMES, FusedProduct, base_of, fused_products
from refusion.model.kernels.native import native_layers

COMPACT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""`config.model_type`s whose decoder layers `CompactForward` runs (pre-norm attention and gated MLP, RoPE)."""

_last_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> the `CompactForward` `compact_forward` last built for it (a model refusion did not prepare has no setup
to keep one: its decoders share this one, so its fused weights are stacked and packed once, not per decode)."""


@dataclass(frozen=True)
class Ragged:
    """Where the real tokens of a padded [B, W] forward are: the compact forward computes those rows alone."""

    batch: int
    """B: the padded forward's rows (sequences)."""
    width: int
    """W: the padded forward's tokens per row."""
    real: torch.Tensor
    """[N] the flat indices (into B * W) of the real tokens, sequence by sequence, in order."""
    keep: torch.Tensor
    """[M] the indices (into the N real tokens) of the tokens whose logits are returned, in order."""
    split: tuple[int, ...] = ()
    """Each row's real tokens where sdpa runs row by row over them alone (`attention_split.splits_attention`); ():
    one call over the padded layout."""

    @classmethod
    def of(cls, counts: list[int], needs: list[int], width: int, device: torch.device, split: bool = False) -> Ragged:
        """The layout of a left-padded forward: row b holds counts[b] real tokens at its end and wants the logits
        of its last needs[b]. `split`: attention runs row by row (`attention_split.splits_attention` decides)."""
        real, keep, start = [], [], 0
        for b, (n, need) in enumerate(zip(counts, needs)):
            real.append(torch.arange((b + 1) * width - n, (b + 1) * width))
            keep.append(torch.arange(start + n - need, start + n))
            start += n
        return cls(len(counts), width, torch.cat(real).to(device), torch.cat(keep).to(device),
                   tuple(counts) if split else ())

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[B, W, ...] -> [1, N, ...]: the real rows of a padded tensor."""
        return x.reshape(self.batch * self.width, *x.shape[2:]).index_select(0, self.real)[None]

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, F] -> [B, W, F]: the real rows in their padded places, zeros at the padding."""
        flat = x.reshape(-1, x.shape[-1])
        out = flat.new_zeros(self.batch * self.width, flat.shape[-1])
        return out.index_copy_(0, self.real, flat).view(self.batch, self.width, -1)


class CompactForward:
    """logits = forward(input_ids, position_ids, attention_mask, cache, logits_to_keep), the decoding forward of a
    supported model over a `SlotCache` (see the module docstring)."""

    def __init__(self, model, fuse: bool = True, native: bool = True):
        """`fuse`: multiply q/k/v and gate/up by one product each where that is exact (`model.kernels.fused`); False: each
        layer on its own. `native`: run the layer loop in C++ where it applies (`model.kernels.native`: the same logits);
        False: always in Python. (benchmarks/linear_kernels.py compares each with the default.)"""
        inner = model.model
        self.embed, self.layers, self.norm, self.rotary = inner.embed_tokens, inner.layers, inner.norm, inner.rotary_emb
        self.lm_head = model.lm_head
        family = sys.modules[type(model).__module__]  # the family's modeling module: its own functions
        attention = model.config._attn_implementation
        self.attention = attention_function(model)
        self.rotate = family.apply_rotary_pos_emb
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")  # Qwen3
        self.layer_types = getattr(model.config, "layer_types", None)  # which mask each layer takes, when several
        self.attn_implementation = attention
        self.kernels = linear_kernels(self.layers)
        """Each linear layer with the kernel and row settings it had when the fused products were chosen."""
        self.fused = [fused_products(layer) if fuse else {} for layer in self.layers]
        self.native = native_layers(self) if native else None

    def runs(self, model) -> bool:
        """Whether this forward still runs `model`'s modules as they are: none replaced or switched to another
        kernel since it was built, the same attention implementation."""
        inner = model.model
        if (inner.embed_tokens is not self.embed or inner.layers is not self.layers or inner.norm is not self.norm
                or model.lm_head is not self.lm_head or len(self.layers) != len(self.fused)
                or model.config._attn_implementation != self.attn_implementation):
            return False
        return linear_kernels(self.layers) == self.kernels

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask, cache,
                 logits_to_keep: int, ragged: Ragged | None = None) -> torch.Tensor:
        """[B, logits_to_keep, V]: the logits of each row's last tokens; with `ragged` (the layout of the real
        tokens), [1, M, V]: the logits of `ragged.keep`'s tokens."""
        # a module call: the mask-gated adapter reads the mask rows (of the rows computed) in its pre-hook
        hidden = self.embed(input_ids if ragged is None else ragged.gather(input_ids))
        position_embeddings = self.rotary(hidden, position_ids)  # [B, W, D]: attention's padded layout
        if isinstance(attention_mask, dict):  # one mask per layer type
            layer_masks = [attention_mask[kind] for kind in self.layer_types]
        else:
            layer_masks = [attention_mask] * len(self.layers)
        if self.native is not None:
            out = self.native(hidden, position_embeddings, layer_masks, cache, ragged)
            if out is not None:
                return self._logits(out, logits_to_keep, ragged)
        for i, (layer, mask) in enumerate(zip(self.layers, layer_masks)):
            residual = hidden
            hidden = residual + self._attention(layer.self_attn, layer.input_layernorm.forward(hidden),
                                                position_embeddings, mask, cache, i, ragged)
            residual = hidden
            hidden = residual + self._mlp(layer.mlp, layer.post_attention_layernorm.forward(hidden),
                                          self.fused[i].get("mlp"))
        return self._logits(hidden, logits_to_keep, ragged)

    def _logits(self, hidden: torch.Tensor, logits_to_keep: int, ragged: Ragged | None) -> torch.Tensor:
        hidden = self.norm.forward(hidden)
        kept = hidden[:, -logits_to_keep:, :] if ragged is None else hidden[:, ragged.keep, :]
        return self.lm_head(kept)  # a module call: its hooks run (the adapter's)

    def _attention(self, attn: nn.Module, hidden: torch.Tensor, position_embeddings, mask, cache, index: int,
                   ragged: Ragged | None):
        fused = self.fused[index].get("self_attn")
        if fused is not None:
            query, key, value = fused(hidden)
        else:
            query, key, value = attn.q_proj.forward(hidden), attn.k_proj.forward(hidden), attn.v_proj.forward(hidden)
        if ragged is not None:  # attention reads the padded layout (the cache's columns are the batch's)
            query, key, value = ragged.scatter(query), ragged.scatter(key), ragged.scatter(value)
        input_shape = query.shape[:-1]
        hidden_shape = (*input_shape, -1, attn.head_dim)
        query, key = query.view(hidden_shape), key.view(hidden_shape)
        if self.qk_norm:
            query, key = attn.q_norm.forward(query), attn.k_norm.forward(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = value.view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query, key = self.rotate(query, key, cos, sin)
        key, value = cache.write(index, key, value)
        kwargs = {"sliding_window": attn.sliding_window} if getattr(attn, "sliding_window", None) else {}
        if ragged is not None and ragged.split and mask is not None:
            return attn.o_proj.forward(self._split_attention(attn, query, key, value, mask, ragged, kwargs))
        out, _ = self.attention(attn, query, key, value, mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        out = out.reshape(*input_shape, -1).contiguous()
        return attn.o_proj.forward(out if ragged is None else ragged.gather(out))

    def _split_attention(self, attn: nn.Module, query, key, value, mask, ragged: Ragged, kwargs) -> torch.Tensor:
        """[1, N, H * D]: attention row by row over each row's real (last) queries, what `ragged.gather` takes from
        the padded call's output (`Ragged.split`)."""
        parts, width = [], ragged.width
        for b, n in enumerate(ragged.split):
            if n == 0:
                continue
            rows_mask = mask if mask.shape[0] == 1 else mask[b: b + 1]
            if rows_mask.shape[2] == width:
                rows_mask = rows_mask[:, :, width - n:]
            out, _ = self.attention(attn, query[b: b + 1, :, width - n:], key[b: b + 1], value[b: b + 1], rows_mask,
                                    dropout=0.0, scaling=attn.scaling, **kwargs)
            parts.append(out.reshape(1, n, -1))
        return torch.cat(parts, 1)

    @staticmethod
    def _mlp(mlp: nn.Module, hidden: torch.Tensor, fused: FusedProduct | None) -> torch.Tensor:
        gate, up = fused(hidden) if fused is not None else (mlp.gate_proj.forward(hidden), mlp.up_proj.forward(hidden))
        return mlp.down_proj.forward(mlp.act_fn(gate) * up)


def compact_forward(model, built: CompactForward | None = None) -> CompactForward | None:
    """A `CompactForward` for `model`, or None when it decodes through transformers' forward (see the module
    docstring): another family, a model in training, or hooks on a sub-layer. `built`: one made earlier for this
    model (its setup's, whose fused weights are already built), returned while it still runs the model's modules."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) not in COMPACT_FAMILIES or model.training:
        return None
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return None
    if attention_function(model) is None:
        return None
    called = (inner.embed_tokens, model.lm_head)  # called as modules, so their hooks run
    for module in model.modules():
        if any(module is c for c in called):
            continue
        if module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None) is not None:
            return None
    for earlier in (built, _last_built.get(model)):
        if earlier is not None and earlier.runs(model):
            return earlier
    _last_built[model] = forward = CompactForward(model)
    return forward


def attention_function(model):
    """The attention function `model`'s layers call, looked up once: its family module's own (refusion's model
    definition keeps them in `ATTENTION_FUNCTIONS`; transformers' modeling modules have `eager_attention_forward`
    and the rest in transformers' registry), or None for an implementation neither knows."""
    family = sys.modules[type(model).__module__]
    name = model.config._attn_implementation
    own = getattr(family, "ATTENTION_FUNCTIONS", None)
    if own is not None:
        return own.get(name)
    if name == "eager":
        return family.eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(name)


def linear_kernels(layers: nn.ModuleList) -> list[tuple]:
    """(module, its computing layer's type, row padding, packed-copy row count) of every linear layer of the
    decoder layers: what the fused products were chosen for (a module replaced or switched changes it)."""
    kernels = []
    for layer in layers:
        for block, names in LINEAR_NAMES.items():
            for name in names:
                module = getattr(getattr(layer, block, None), name, None)
                base = base_of(module)
                kernels.append((module, type(base), getattr(base, "padded_rows", None),
                                getattr(base, "packed_from", None)))
    return kernels
