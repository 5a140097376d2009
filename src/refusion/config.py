"""Frozen configuration dataclasses and named decoding presets.

Every field has a docstring; validation happens in ``__post_init__`` so that a bad value is reported,
with the allowed range, before any forward pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

STRATEGIES = ("refusion", "speculative", "autoregressive")
KV_CACHE_MODES = ("reuse", "recompute")


class ConfigError(ValueError):
    """A setting with a bad value. Carries the field's name, the value and what is allowed, so that every
    front end (CLI, server, Python) can name the field without parsing the message."""

    def __init__(self, field: str, value, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field}={value!r} is invalid: {allowed}")


def _require(ok: bool, field: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(field, value, allowed)


@dataclass(frozen=True)
class DecodeConfig:
    """Settings of one decoding run (ALGORITHM.md §2-3)."""

    max_new_tokens: int = 256
    """Most response tokens to return. The canvas is this rounded up to a whole number of slots."""

    slot_size: int = 8
    """k: tokens per slot, the unit of parallel decoding."""

    block_size: int = 32
    """b: the canvas is decoded left to right in blocks of b tokens; a positive multiple of slot_size.
    The last block is shorter when the canvas is not a multiple of b (it is always a whole number of slots);
    so a block longer than the canvas (max_new_tokens=8, block_size=32) is clipped to the canvas, one block
    (an extension: the paper's code requires the canvas to be a multiple of b)."""

    slot_threshold: float = 0.9
    """tau_slot: a slot is planned when the confidence of its first drafted token exceeds this."""

    token_threshold: float = 0.4
    """tau_token: a drafted token is accepted when its autoregressive probability exceeds this."""

    temperature: float = 0.0
    """0 drafts greedily; > 0 adds Gumbel noise to the planning logits (the infill step stays greedy)."""

    seed: int | None = None
    """Seed of the sampling generator (sequence i of a batch uses seed + i). Unused at temperature 0."""

    strategy: str = "refusion"
    """"refusion" (the paper's plan and infill), "speculative" (masked drafts verified by the model's own AR
    predictions: output identical to "autoregressive") or "autoregressive" (one token per forward, the baseline)."""

    draft_length: int = 4
    """speculative: drafted tokens verified per forward (the masks appended to each forward draft this many)."""

    predraft: bool = False
    """speculative: in each forward, draft the next tokens for every possible acceptance length (wider forwards,
    drafts ready whatever is accepted) instead of one chain after the drafts (no drafts after a rejection)."""

    fused_plan: bool = True
    """refusion: when a round commits every slot it selected, the next round's plan rides on that round's last
    forward as its own attention group: the same tokens, one forward fewer."""

    kv_cache: str = "reuse"
    """"reuse": slots completed in parallel keep their own KV (the paper's method); "recompute": their KV is
    recomputed in one extra forward after each parallel completion (the paper's Table 8 ablation)."""

    mask_token_id: int | None = None
    """Id of <|mask|>; None takes the model config's mask_token_id."""

    eos_token_id: int | list[int] | None = None
    """Token id(s) that end a response; None takes the model's generation config / config EOS."""

    def __post_init__(self) -> None:
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
                 "max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        _require(isinstance(self.slot_size, int) and self.slot_size >= 1,
                 "slot_size", self.slot_size, "must be an integer >= 1")
        _require(isinstance(self.block_size, int) and self.block_size >= 1 and self.block_size % self.slot_size == 0,
                 "block_size", self.block_size, f"must be a positive multiple of slot_size={self.slot_size}")
        for name in ("slot_threshold", "token_threshold"):
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and 0.0 <= value <= 1.0, name, value, "must be in [0, 1]")
        _require(isinstance(self.temperature, (int, float)) and self.temperature >= 0.0,
                 "temperature", self.temperature, "must be >= 0")
        _require(self.seed is None or isinstance(self.seed, int), "seed", self.seed, "must be an integer or None")
        _require(self.strategy in STRATEGIES, "strategy", self.strategy, f"must be one of {', '.join(STRATEGIES)}")
        _require(isinstance(self.draft_length, int) and self.draft_length >= 1,
                 "draft_length", self.draft_length, "must be an integer >= 1")
        for name in ("predraft", "fused_plan"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")
        _require(self.kv_cache in KV_CACHE_MODES, "kv_cache", self.kv_cache,
                 f"must be one of {', '.join(KV_CACHE_MODES)}")

    @property
    def canvas_length(self) -> int:
        """gen_length of the spec: max_new_tokens rounded up to a whole number of slots."""
        k = self.slot_size
        return -(-self.max_new_tokens // k) * k

    def replace(self, **changes) -> DecodeConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# Named decoding presets: the paper's per-task settings (ALGORITHM.md §5), the demo setting, and the embedded
# model's own (picked by a sweep on GSM8K, docs/BENCHMARKS.md; `refusion.default_decode_settings()`).
PRESETS: dict[str, dict] = {
    "demo": dict(slot_size=4, slot_threshold=0.6, token_threshold=0.3, block_size=16),
    "mmlu_pro": dict(slot_size=16, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "arc_challenge": dict(slot_size=8, slot_threshold=0.8, token_threshold=0.1, block_size=8),
    "gsm8k": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "math": dict(slot_size=32, slot_threshold=0.8, token_threshold=0.6, block_size=64),
    "gpqa": dict(slot_size=8, slot_threshold=0.8, token_threshold=0.2, block_size=16),
    "humaneval": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "mbpp": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.3, block_size=128),
    "refusion-smol": dict(slot_size=8, slot_threshold=0.7, token_threshold=0.3, block_size=16),
}


def preset(name: str) -> dict:
    """DecodeConfig keyword arguments of a named preset."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown: choose one of {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
