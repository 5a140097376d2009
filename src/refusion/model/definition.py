"""refusion's own definition of the model families it decodes most: Llama (SmolLM2), Mistral, Qwen2, Qwen3.

Why: importing transformers' modeling code costs 4-5 s of a cold start on a 2-core machine, more than loading a
small model's weights. This module needs torch and the standard library alone: a config built from config.json
(`DecoderConfig`), the modules (`CausalLM` and its parts, under transformers' attribute names and state-dict
keys), the functions transformers' modeling modules define under the same names (`apply_rotary_pos_emb`,
`repeat_kv`, `eager_attention_forward`, ...; `model.compact.CompactForward` finds them through the model's module),
the attention functions by implementation name (`ATTENTION_FUNCTIONS`), and a loader (`load_model`) that reads
model.safetensors itself, each tensor straight into its parameter's memory.

The parity guarantee: a model loaded here computes, operation for operation and in the same order, what
transformers 5.24's `LlamaForCausalLM` / `MistralForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` compute
from the same weights, so its logits are theirs bit for bit (fp32 and bf16; attention "sdpa", "eager" and
"refusion_exact"; no mask, a 2D padding mask or a 4D mask; tests/model/test_definition.py), and the compact forward
and the native layers run it unchanged, so decoding it gives transformers' model's tokens. Configs this
definition does not compute exactly (RoPE scaling, other activations, quantized weights, ...) are refused by
`supports`, and the loader then uses transformers.

What the forward supports, deliberately small: attention_mask None (causal), a 2D 0/1 padding mask (causal and
padding, as transformers builds it), a 4D mask used as given (or a dict of them by layer type), and a KV cache
with transformers' `update(key, value, layer_idx)` verb. It does not detect packed sequences from restarting
position ids (transformers does only when called with `use_cache=False`, no mask and no cache): pass a 4D mask.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from refusion.model.kernels.row_exact import (
    ADDITIVE_MASK_ATTENTION,
    EXACT_ATTENTION,
    EXACT_HALF_ATTENTION,
    exact_attention,
    exact_half_attention,
)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
"""The `model_type`s this module defines."""
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM"}
"""transformers' class of each family's causal LM (a config.json's `architectures` names it)."""
DEFAULT_ROPE_THETA = 10_000.0
"""transformers' `default_theta`: the RoPE base of a config that gives none."""
LAYER_TYPES = ("full_attention", "sliding_attention")

_QWEN_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, hidden_act="silu",
                      max_position_embeddings=32768, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                      tie_word_embeddings=False, use_sliding_window=False, sliding_window=4096,
                      max_window_layers=28, layer_types=None, attention_dropout=0.0, pad_token_id=None,
                      bos_token_id=None, eos_token_id=None)
FAMILY_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=None, hidden_act="silu", max_position_embeddings=2048,
                  initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True, pad_token_id=None, bos_token_id=1,
                  eos_token_id=2, pretraining_tp=1, tie_word_embeddings=False, attention_bias=False,
                  attention_dropout=0.0, mlp_bias=False, head_dim=None),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=None, hidden_act="silu",
                    max_position_embeddings=4096 * 32, initializer_range=0.02, rms_norm_eps=1e-6, use_cache=True,
                    pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                    sliding_window=4096, attention_dropout=0.0),
    "qwen2": _QWEN_DEFAULTS,
    "qwen3": _QWEN_DEFAULTS | dict(head_dim=128, attention_bias=False),
}
"""The value transformers 5.24's LlamaConfig / MistralConfig / Qwen2Config / Qwen3Config give a key that
config.json leaves out (then `DecoderConfig.from_dict` completes them as their `__post_init__` does)."""
BIASES = {"llama": ("attention_bias", "mlp_bias"), "mistral": (), "qwen2": (), "qwen3": ("attention_bias",)}
"""The bias switches each family's transformers modules read (Qwen2's q/k/v always have a bias, its o_proj and
every MLP none; Mistral has none)."""


# ----------------------------------------------------------------------------------------------------- config
class DecoderConfig:
    """A model's config.json as attributes, as transformers' config classes hold it: every key of the file, the
    family's defaults for the keys it leaves out (`FAMILY_DEFAULTS`, completed as transformers completes them),
    `rope_parameters` in transformers 5's form, and `_attn_implementation` (settable). Mutable (refusion records
    `mask_token_id` in it)."""

    def __init__(self, **values):
        self.__dict__.update(values)

    @classmethod
    def from_dict(cls, values: dict, attn_implementation: str = "sdpa") -> DecoderConfig:
        """The config of a config.json's dict (a supported one: `supports`)."""
        family = values["model_type"]
        settings = copy.deepcopy(FAMILY_DEFAULTS[family]) | {"mask_token_id": None} | copy.deepcopy(values)
        config = cls(**settings)
        if getattr(config, "head_dim", None) is None:  # Qwen2 has no default
            config.head_dim = config.hidden_size // config.num_attention_heads
        if config.num_key_value_heads is None:
            config.num_key_value_heads = config.num_attention_heads
        config.rope_parameters = rope_parameters_of(values)
        if family in ("qwen2", "qwen3"):
            config.sliding_window = config.sliding_window if config.use_sliding_window else None
            if config.layer_types is None:
                config.layer_types = ["sliding_attention" if config.sliding_window is not None
                                      and i >= config.max_window_layers else "full_attention"
                                      for i in range(config.num_hidden_layers)]
        config._attn_implementation = attn_implementation
        return config

    def get_text_config(self, *args, **kwargs) -> DecoderConfig:
        return self

    def to_dict(self) -> dict:
        """Every public setting (a copy), as config.json would hold it."""
        return copy.deepcopy({k: v for k, v in vars(self).items() if not k.startswith("_")})

    def __repr__(self) -> str:
        return f"DecoderConfig({json.dumps(self.to_dict(), sort_keys=True, default=str)})"


@dataclass
class GenerationConfig:
    """The token ids transformers' `generation_config` gives `generate` (refusion reads and sets them): from
    generation_config.json when the model has one, else from the config."""

    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None


def rope_parameters_of(values: dict) -> dict:
    """A config.json's RoPE settings in transformers 5's form, {"rope_type", "rope_theta", ...}: its
    `rope_scaling` or `rope_parameters` dict, its top-level `rope_theta` filling a missing base (else
    DEFAULT_ROPE_THETA), the type read from "rope_type" or the older "type" (else "default")."""
    parameters = dict(values.get("rope_scaling") or values.get("rope_parameters") or {})
    parameters.setdefault("rope_theta", values.get("rope_theta", DEFAULT_ROPE_THETA))
    parameters.setdefault("rope_type", parameters.get("type", "default"))
    return parameters


def supports(values: dict) -> str | None:
    """None when this definition computes the model of a config.json's dict exactly as transformers does, else
    a one-line reason (then load it with transformers)."""
    family = values.get("model_type")
    if family not in FAMILIES:
        return f"model_type {family!r} is not one of {', '.join(FAMILIES)}"
    architectures = values.get("architectures") or [CAUSAL_LM_CLASSES[family]]
    if CAUSAL_LM_CLASSES[family] not in architectures:
        return f"architectures {architectures} do not include {CAUSAL_LM_CLASSES[family]}"
    if values.get("hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act {values['hidden_act']!r} is not SiLU"
    if values.get("quantization_config"):
        return "quantized weights"
    if values.get("is_causal") is False:
        return "bidirectional attention (is_causal false)"
    rope = values.get("rope_scaling") or values.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        return "RoPE parameters per layer type"
    rope_type = rope_parameters_of(values)["rope_type"]
    if rope_type != "default":
        return f"RoPE type {rope_type!r} (only 'default', no scaling)"
    if "partial_rotary_factor" in values or "partial_rotary_factor" in rope:
        return "partial rotary embedding"
    for switch in ("attention_bias", "mlp_bias"):
        if values.get(switch) and switch not in BIASES[family]:
            return f"{switch} true, which {family} models do not have"
    return _layer_types_reason(values, family)


def _layer_types_reason(values: dict, family: str) -> str | None:
    layer_types = values.get("layer_types")
    if layer_types is None:
        return None
    if family not in ("qwen2", "qwen3"):
        return f"layer_types in a {family} config"
    if len(layer_types) != values.get("num_hidden_layers", 32) or set(layer_types) - set(LAYER_TYPES):
        return f"layer_types {sorted(set(layer_types))} (one of {', '.join(LAYER_TYPES)} per layer)"
    window = values.get("sliding_window", 4096) if values.get("use_sliding_window") else None
    if "sliding_attention" in layer_types and window is None:
        return "sliding_attention layers without a sliding window"
    return None


# -------------------------------------------------------------------------------- functions (transformers' names)
def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """q, k [B, H, T, D] rotated by cos, sin [B, T, D] (unsqueezed at `unsqueeze_dim` to broadcast over heads)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, H_kv, L, D] -> [B, H_kv * n_rep, L, D]: each key/value head repeated for the query heads sharing it."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Attention as matmul, softmax (fp32), matmul. query [B, H, T, D], key and value [B, H_kv, L, D],
    attention_mask additive [B, 1, T, L] or None -> ([B, T, H, D], weights)."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


def sdpa_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                           **kwargs):
    """torch's scaled_dot_product_attention called as transformers' `sdpa_attention_forward` calls it on a CPU or a
    CUDA GPU: grouped-query heads by `enable_gqa` without a mask, packed into the query's rows for one query row,
    else repeated; causal by `is_causal` when there is no mask. attention_mask boolean [B, 1, T, L] or None ->
    ([B, T, H, D], None)."""
    extra = {}
    q_length = query.shape[2]
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        if _gqa_in_sdpa(attention_mask, key, value):
            extra["enable_gqa"] = True
        elif q_length == 1 and not torch.compiler.is_compiling():
            query, attention_mask = _pack_gqa(query, groups), _pack_gqa(attention_mask, groups)
        else:
            key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    kv_length = key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and kv_length > q_length:  # causal from the first key: the keys past the queries are never seen
        key, value = key[:, :, :q_length, :], value[:, :, :q_length, :]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=is_causal, **extra)
    out = out.reshape(out.shape[0], -1, q_length, value.shape[-1])  # undoes `_pack_gqa`
    return out.transpose(1, 2).contiguous(), None


def _gqa_in_sdpa(attention_mask, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether transformers lets sdpa group the query heads itself (on a CPU or a CUDA GPU; its debugging switch
    TRANSFORMERS_SDPA_FORCE_GQA is not read: the native layers mirror this branch, `model.kernels.native`)."""
    return attention_mask is None and key.shape[-1] == value.shape[-1] <= 256


def _pack_gqa(hidden_states: torch.Tensor | None, n_rep: int) -> torch.Tensor | None:
    """One query row: [B, H, 1, D] -> [B, H_kv, n_rep, D] (a mask shared by the heads stays as it is)."""
    if hidden_states is None or hidden_states.shape[1] == 1:
        return hidden_states
    batch, heads, _, dim = hidden_states.shape
    return hidden_states.reshape(batch, heads // n_rep, n_rep, dim)


ATTENTION_FUNCTIONS = {"eager": eager_attention_forward, "sdpa": sdpa_attention_forward,
                       EXACT_ATTENTION: exact_attention, EXACT_HALF_ATTENTION: exact_half_attention}
"""The attention function of each `_attn_implementation` this definition runs (`model.compact` reads it too)."""


def causal_mask(attention: str, inputs: torch.Tensor, padding: torch.Tensor | None, past: int | None,
                window: int | None) -> torch.Tensor | None:
    """The mask transformers' `create_causal_mask` (or, with a `window`, `create_sliding_window_causal_mask`) builds
    for a forward of `inputs` [B, T, ...] after `past` cached tokens (None: no cache) and a 2D 0/1 `padding` mask
    (or None): [B, 1, T, L] boolean for sdpa (None where sdpa's `is_causal` gives the same), additive in the
    inputs' dtype for the others."""
    batch, q_length = inputs.shape[:2]
    device, q_offset = inputs.device, past or 0
    if past is not None:
        kv_length = past + q_length
    else:
        kv_length = padding.shape[-1] if padding is not None else q_length
    if padding is not None:
        padding = padding.to(device=device, dtype=torch.bool)
        if kv_length > padding.shape[-1]:
            padding = F.pad(padding, (0, kv_length - padding.shape[-1]))
        padding = padding[:, :kv_length]
    if attention == "sdpa" and _causal_alone(padding, q_length, kv_length, q_offset, window):
        return None
    q_index = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
    kv_index = torch.arange(kv_length, device=device)[None, None, None, :]
    seen = kv_index <= q_index  # [1, 1, T, L]
    if window is not None:
        seen = (kv_index > q_index - window) & seen
    if padding is not None:
        seen = seen & padding[:, None, None, :]  # [B, 1, T, L]
    seen = seen.expand(batch, -1, q_length, kv_length)
    if attention not in ADDITIVE_MASK_ATTENTION:
        return seen
    return torch.where(seen, torch.zeros((), device=device, dtype=inputs.dtype), torch.finfo(inputs.dtype).min)


def _causal_alone(padding: torch.Tensor | None, q_length: int, kv_length: int, q_offset: int,
                  window: int | None) -> bool:
    """Whether sdpa's `is_causal` (or no mask, for one query row) computes the causal mask (transformers'
    `_ignore_causal_mask_sdpa`)."""
    if window is not None and kv_length >= window:
        return False
    if (q_length == 1 or kv_length == q_length) and (padding is None or bool(padding.all())):
        return True
    return q_offset == 0 and (padding is None or (bool(padding[:, :q_length].all())
                                                  and not bool(padding[:, q_length:].any())))


# --------------------------------------------------------------------------------------------------- modules
class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and rounded back to the input's dtype before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class RotaryEmbedding(nn.Module):
    """(cos, sin) [B, T, head_dim] of position ids [B, T], in the dtype of `x`: RoPE without scaling."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.rope_type = "default"
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        # on the CPU even while the model is built on the meta device (the buffer is computed, not loaded)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim))
        self.attention_scaling = 1.0
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE (Qwen3: RMS norms on each head's query and key)."""

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        family = config.model_type
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = layer_type_of(config, layer_idx)
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        qkv_bias = True if family == "qwen2" else getattr(config, "attention_bias", False)
        o_bias = getattr(config, "attention_bias", False) if family != "qwen2" else False
        heads, kv_heads, hidden = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=o_bias)
        if family == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)  # [B, T, heads, D]
        query_states = self.q_proj(hidden_states).view(hidden_shape)
        key_states = self.k_proj(hidden_states).view(hidden_shape)
        if hasattr(self, "q_norm"):
            query_states, key_states = self.q_norm(query_states), self.k_norm(key_states)
        query_states, key_states = query_states.transpose(1, 2), key_states.transpose(1, 2)  # [B, heads, T, D]
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attention = ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, _ = attention(self, query_states, key_states, value_states, attention_mask,
                                   dropout=0.0 if not self.training else self.attention_dropout,
                                   scaling=self.scaling, sliding_window=self.sliding_window)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output)


def layer_type_of(config: DecoderConfig, layer_idx: int) -> str:
    """"full_attention" or "sliding_attention": the config's `layer_types` entry (Qwen2, Qwen3); Mistral's layers
    all slide when its config has a window; Llama's never do."""
    if config.model_type in ("qwen2", "qwen3"):
        return config.layer_types[layer_idx]
    sliding = config.model_type == "mistral" and config.sliding_window is not None
    return "sliding_attention" if sliding else "full_attention"


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, config: DecoderConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, cache=None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, position_embeddings, attention_mask, cache)
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        return residual + self.mlp(hidden_states)


@dataclass
class DecoderOutput:
    last_hidden_state: torch.Tensor
    """[B, T, hidden] after the final norm."""
    past_key_values: object = None
    """The cache the forward wrote to, or None."""


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    """[B, kept tokens, V]."""
    past_key_values: object = None
    """The cache the forward wrote to (when `use_cache`), or None."""


class DecoderModel(nn.Module):
    """Token embeddings, the decoder layers, the final norm (transformers' `model.model`)."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        # a weight given: no random init (on the meta device, `normal_` would import torch's compiler, ~2 s)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, **kwargs) -> DecoderOutput:
        """attention_mask: None (causal), a 2D [B, L] 0/1 padding mask, a 4D mask (used as given) or a dict of
        4D masks by layer type. past_key_values: a cache with `update(key, value, layer_idx)` (and
        `get_seq_length()` when position ids or the mask are to be derived), or None."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids or inputs_embeds")
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # [B, T, hidden]
        derived = position_ids is None or not _prepared(attention_mask)
        past = past_key_values.get_seq_length() if past_key_values is not None and derived else None
        if position_ids is None:
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + (past or 0)).unsqueeze(0)
        masks = self.layer_masks(attention_mask, hidden, past)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer, mask in zip(self.layers, masks):
            hidden = layer(hidden, position_embeddings, mask, past_key_values)
        return DecoderOutput(self.norm(hidden), past_key_values)

    def layer_masks(self, attention_mask, hidden: torch.Tensor, past: int | None) -> list:
        """Each layer's attention mask: a 4D mask as given (a dict of them by layer type), else the causal mask of
        its layer type (`causal_mask`), built once per type."""
        kinds = [layer.self_attn.layer_type for layer in self.layers]
        if isinstance(attention_mask, dict):
            return [attention_mask[kind] for kind in kinds]
        if _prepared(attention_mask):
            return [attention_mask] * len(kinds)
        windows = {layer.self_attn.layer_type: layer.self_attn.sliding_window for layer in self.layers}
        built = {kind: causal_mask(self.config._attn_implementation, hidden, attention_mask, past, window)
                 for kind, window in windows.items()}
        return [built[kind] for kind in kinds]


def _prepared(attention_mask) -> bool:
    """Whether a mask is used as given (4D, or a dict of 4D masks by layer type)."""
    return isinstance(attention_mask, dict) or (attention_mask is not None and attention_mask.dim() == 4)


class CausalLM(nn.Module):
    """A decoder and its LM head (transformers' `*ForCausalLM`, the same modules and state-dict keys). Built to be
    loaded (`load_model` builds it on the meta device and reads every weight): its weights are not initialised."""

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.generation_config = GenerationConfig(config.bos_token_id, config.eos_token_id, config.pad_token_id)
        self.tie_weights()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, logits_to_keep=0, inputs_embeds=None, **kwargs) -> CausalLMOutput:
        """Logits of the last `logits_to_keep` tokens (0: all; a tensor: those positions). See
        `DecoderModel.forward` for the masks and the cache; keywords transformers takes for outputs this forward
        does not compute (labels, attentions, hidden states) are refused."""
        unsupported = sorted(k for k, v in kwargs.items() if v is not None and v is not False and k != "return_dict")
        if unsupported:
            raise TypeError(f"refusion's model definition does not take {', '.join(unsupported)}")
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, inputs_embeds)
        return CausalLMOutput(self.lm_head(kept_rows(out.last_hidden_state, logits_to_keep)),
                              past_key_values if use_cache else None)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def get_decoder(self) -> DecoderModel:
        return self.model

    def tie_weights(self) -> None:
        """The LM head shares the embedding parameter when the config ties them."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(p for p in self.parameters() if p.is_floating_point()).dtype

    @torch.no_grad()
    def resize_token_embeddings(self, new_num_tokens: int, mean_resizing: bool = False) -> nn.Embedding:
        """Grow (or cut) the vocabulary to `new_num_tokens` rows: the embedding (and an untied LM head) keep their
        rows and get new ones drawn as transformers initialises them (normal, std `initializer_range`); a tied
        head stays tied. Returns the embedding. `mean_resizing` (transformers' sampling around the mean row) is
        not supported."""
        if mean_resizing:
            raise ValueError("resize_token_embeddings: mean_resizing=True is not supported by refusion's model "
                             "definition (set the new rows yourself)")
        embed = self.model.embed_tokens
        embed.weight = nn.Parameter(_resized(embed.weight, new_num_tokens, self.config.initializer_range))
        embed.num_embeddings = new_num_tokens
        if not self.config.tie_word_embeddings:
            head = self.lm_head
            head.weight = nn.Parameter(_resized(head.weight, new_num_tokens, self.config.initializer_range))
        self.tie_weights()
        self.lm_head.out_features = new_num_tokens
        self.config.vocab_size = self.vocab_size = self.model.vocab_size = new_num_tokens
        return embed


def kept_rows(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The hidden states whose logits a forward returns (transformers' `slice_logits_to_keep`): an int keeps the
    last that many rows (0: all), a 1D tensor those positions, a 2D one each row's positions (or a boolean mask's
    rows, flattened)."""
    if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
        if logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]
        return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)
    if isinstance(logits_to_keep, int):
        logits_to_keep = slice(-logits_to_keep, None)
    return hidden[:, logits_to_keep, :]


def _resized(weight: torch.Tensor, rows: int, std: float) -> torch.Tensor:
    """[rows, ...]: `weight`'s first rows, then rows drawn from normal(0, std)."""
    out = torch.empty(rows, *weight.shape[1:], dtype=weight.dtype, device=weight.device)
    kept = min(rows, weight.shape[0])
    out[:kept] = weight[:kept]
    out[kept:].normal_(0.0, std)  # (only the new rows: drawing a 49k-row vocabulary's took 0.2 s)
    return out


# --------------------------------------------------------------------------------------------------- loading
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
"""The safetensors dtype names this loader reads."""
MAX_HEADER_BYTES = 100 * 2**20
"""A safetensors header longer than this is taken for a damaged file."""
IGNORED_KEYS = ("rotary_emb.inv_freq",)
"""Checkpoint keys that transformers ignores too (buffers older checkpoints saved)."""


def load_model(directory: str | os.PathLike, dtype: torch.dtype,
               attn_implementation: str = "sdpa") -> CausalLM:
    """The model of a directory holding config.json and model.safetensors (or shards listed in
    model.safetensors.index.json), on the CPU, in eval mode, its weights in `dtype`.

    Nothing is allocated twice: the modules are built on the meta device, then each parameter is read from its
    file into memory of its own (converted where stored in another dtype), and a tied LM head shares the embedding
    parameter. Not mapped: a mapping of the file stays whole while any weight views it, so the pages of every weight
    a kernel re-lays (fused, packed) would stay resident beside the new copies (+0.4 GB at the embedded model's
    peak, measured); a weight read into its own memory is freed when it is replaced.

    Raises ValueError (one line naming the file) for a missing or damaged file, a config `supports` refuses, or
    an attention implementation other than those of `ATTENTION_FUNCTIONS`."""
    directory = Path(directory)
    values = read_json(directory / "config.json")
    reason = supports(values)
    if reason is not None:
        raise ValueError(f"{directory / 'config.json'}: refusion's model definition does not support {reason}")
    if attn_implementation not in ATTENTION_FUNCTIONS:
        raise ValueError(f"attn_implementation={attn_implementation!r}: refusion's model definition runs "
                         f"{', '.join(ATTENTION_FUNCTIONS)}")
    config = DecoderConfig.from_dict(values, attn_implementation)
    config._name_or_path = str(directory)
    with torch.device("meta"):
        model = CausalLM(config)
    weights, files = read_weights(directory, dtype)
    place_weights(model, weights, files)
    model.generation_config = read_generation_config(directory, config)
    return model.eval()


def read_json(path: Path) -> dict:
    """A JSON object file; ValueError naming it when it is missing or not one."""
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"could not load {path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not load {path}: {type(e).__name__}: {e}") from None
    if not isinstance(values, dict):
        raise ValueError(f"could not load {path}: not a JSON object")
    return values


def read_generation_config(directory: Path, config: DecoderConfig) -> GenerationConfig:
    """generation_config.json's token ids when the directory has one, else the config's."""
    path = directory / "generation_config.json"
    values = read_json(path) if path.is_file() else {}
    return GenerationConfig(*(values.get(k, getattr(config, k)) for k in ("bos_token_id", "eos_token_id",
                                                                          "pad_token_id")))


def read_weights(directory: Path, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], str]:
    """({name: tensor}, the files' names for messages) of model.safetensors or the shards of
    model.safetensors.index.json (`read_safetensors`)."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single, dtype), str(single)
    if not index.is_file():
        raise ValueError(f"could not load {directory}: no model.safetensors (nor model.safetensors.index.json)")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"could not load {index}: no weight_map")
    weights = {}
    for name in sorted(set(weight_map.values())):
        weights |= read_safetensors(directory / name, dtype)
    return weights, str(index)


def read_safetensors(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, each read into memory of its own (converted to `dtype` where it is
    floating point and stored in another). ValueError naming the file when it is missing or damaged."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            header, start = _header(file, size, path)
            return {name: _tensor(file, start, size, name, entry, path, dtype) for name, entry in header.items()}
    except OSError as e:  # missing, unreadable
        raise ValueError(f"could not load {path}: {e.strerror or e}") from None


def _header(file, size: int, path: Path) -> tuple[dict, int]:
    """(the header's tensor entries, where the data starts): 8 bytes of little-endian header length, the JSON
    header, then the data."""
    if size < 8:
        raise ValueError(f"could not load {path}: damaged safetensors file ({size} bytes)")
    length = int.from_bytes(file.read(8), "little")
    if length > min(MAX_HEADER_BYTES, size - 8):
        raise ValueError(f"could not load {path}: damaged safetensors file (header of {length} bytes in a file "
                         f"of {size})")
    try:
        header = json.loads(file.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"could not load {path}: damaged safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"could not load {path}: damaged safetensors header")
    header.pop("__metadata__", None)
    return header, 8 + length


def _tensor(file, start: int, size: int, name: str, entry, path: Path, dtype: torch.dtype) -> torch.Tensor:
    """One header entry's tensor (see `read_safetensors`)."""
    try:
        stored = SAFETENSORS_DTYPES[entry["dtype"]]
        shape = [int(n) for n in entry["shape"]]
        begin, end = (int(n) for n in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"could not load {path}: tensor {name!r} has an unreadable or unsupported entry "
                         f"{entry!r}") from None
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * stored.itemsize
    if begin < 0 or end - begin != nbytes or start + end > size:
        raise ValueError(f"could not load {path}: damaged safetensors file (tensor {name!r} at bytes "
                         f"{begin}..{end} of {size - start})")
    tensor = torch.empty(shape, dtype=stored)
    if nbytes:
        buffer = memoryview(tensor.view(-1).view(torch.uint8).numpy())
        if os.preadv(file.fileno(), [buffer], start + begin) != nbytes:
            raise ValueError(f"could not load {path}: damaged safetensors file (tensor {name!r} cut short)")
    return tensor.to(dtype) if stored.is_floating_point and stored != dtype else tensor


def place_weights(model: CausalLM, weights: dict[str, torch.Tensor], files: str) -> None:
    """Make each parameter of a model built on the meta device the checkpoint's tensor of its name (a tied LM
    head the embedding's); ValueError naming the files for a missing, unexpected or misshapen tensor."""
    tied = model.config.tie_word_embeddings
    expected = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    if tied:
        expected.discard("lm_head.weight")
    missing = sorted(expected - weights.keys())
    ignored = {"lm_head.weight"} if tied else set()
    unexpected = sorted(k for k in weights.keys() - expected - ignored if not k.endswith(IGNORED_KEYS))
    if missing or unexpected:
        listed = ", ".join([f"missing {k}" for k in missing[:3]] + [f"unexpected {k}" for k in unexpected[:3]])
        raise ValueError(f"could not load {files}: its tensors are not this model's ({listed})")
    for name in sorted(expected):
        owner_name, _, leaf = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if tuple(weights[name].shape) != tuple(owner._parameters[leaf].shape):
            raise ValueError(f"could not load {files}: {name} has shape {tuple(weights[name].shape)}, the config "
                             f"says {tuple(owner._parameters[leaf].shape)}")
        owner._parameters[leaf] = nn.Parameter(weights[name])
    model.tie_weights()
