"""Frozen configuration dataclasses and named decoding presets.

Every field has a docstring; validation happens in ``__post_init__`` so that a bad value is reported,
with the allowed range, before any forward pass.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import types
import typing
import warnings
from dataclasses import dataclass

STRATEGIES = ("refusion", "speculative", "autoregressive")
KV_CACHE_MODES = ("reuse", "recompute")
MODEL_FIELDS = ("mask_token_id", "eos_token_id")
"""DecodeConfig fields that describe the model rather than one request: the CLI and Python set them, the server
takes them from the model it serves."""
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
"""Error code of a prompt that, with the tokens asked for, does not fit the model's context (OpenAI's code): the
server answers it, the engine's chat client reads it."""
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "temperature": "temperature", "seed": "seed", "logprobs": "logprobs"}
"""DecodeConfig fields that a server request sets through the standard OpenAI field of this name (the others go in
its `"refusion"` extension object)."""
STRATEGY_FIELDS: dict[str, tuple[str, ...]] = {
    "refusion": ("slot_size", "block_size", "slot_threshold", "token_threshold", "fused_plan", "kv_cache"),
    "speculative": ("draft_length", "draft_threshold", "lookup_length", "table_length", "predraft"),
}
"""DecodeConfig fields that one strategy alone reads; every other field is read by every strategy."""
MAX_TOP_LOGPROBS = 20
"""The most alternatives `DecodeConfig.logprobs` may ask for per token (OpenAI's bound on `top_logprobs`)."""
MIN_TEMPERATURE = 1e-4
"""The smallest sampling temperature (0 is greedy): logits divided by less can overflow to inf."""


class IgnoredSetting(UserWarning):
    """A DecodeConfig field was set that the chosen strategy never reads (its value changes nothing)."""


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
    """Settings of one decoding run (docs/DECODING.md: each step of plan and infill, and "Settings").

    Each field, with its type and the docstring under it, is also a `--flag` of generate / eval / bench / serve,
    a field of the server's `"refusion"` request object, an lm-eval model argument and a `refusion bench` sweep
    axis: adding a field here adds it to all of them (docs/DECODING.md, "Settings")."""

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
    """0 is greedy; > 0 samples: refusion adds Gumbel noise to the planning logits (the infill step stays greedy),
    autoregressive and speculative sample every token from softmax(logits / temperature)."""

    seed: int | None = None
    """Sampling seed (sequence i of a batch uses seed + i; autoregressive and speculative draw each position's noise
    from the seed and the position alone, so the text is the same whatever the batch and the drafts verified).
    Unused at temperature 0."""

    logprobs: int | None = None
    """Record each response token's log-probability (the model's distribution it was committed from, at temperature
    1) and the `logprobs` most likely alternatives (0: the token's alone; at most 20); None: off (no cost)."""

    strategy: str = "refusion"
    """"refusion" (the paper's plan and infill), "speculative" (masked drafts verified by the model's own AR
    predictions: output identical to "autoregressive") or "autoregressive" (one token per forward, the baseline)."""

    draft_length: int = 4
    """speculative: drafted tokens verified per forward (the masks appended to each forward draft this many; 0: no
    masks, the drafts come from prompt lookup and the draft table only)."""

    draft_threshold: float = 0.0
    """speculative: a draft is verified only when the distribution it is drawn from peaks at this or higher (the
    drafts after it are dropped too): an unlikely draft widens the forward and is seldom accepted. Never changes
    the output, only the forwards' widths."""

    lookup_length: int = 0
    """speculative: when the last tokens (3, else 2) occurred earlier in the prompt or the response, draft up to
    this many tokens by copying what followed them (prompt lookup), instead of the masks' drafts; 0: never.
    Never changes the output."""

    table_length: int = 0
    """speculative: when prompt lookup finds nothing, draft up to this many tokens from the model's draft table
    (what the model's own answers usually write after the last tokens: `refusion.model.draft_table`), instead
    of the masks' drafts; 0, or a model without a table: never. Never changes the output."""

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
        for name in ("max_new_tokens", "slot_size"):
            _require(_is_int(getattr(self, name)) and getattr(self, name) >= 1, name, getattr(self, name),
                     "must be an integer >= 1")
        _require(_is_int(self.block_size) and self.block_size >= 1 and self.block_size % self.slot_size == 0,
                 "block_size", self.block_size, f"must be a positive multiple of slot_size={self.slot_size}")
        for name in ("slot_threshold", "token_threshold", "draft_threshold"):
            value = getattr(self, name)
            _require(_is_number(value) and 0.0 <= value <= 1.0, name, value, "must be a number in [0, 1]")
        _require(_is_number(self.temperature) and (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE),
                 "temperature", self.temperature, f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}")
        _require(self.seed is None or _is_int(self.seed), "seed", self.seed, "must be an integer or None")
        _require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
                 "logprobs", self.logprobs, f"must be None (off) or an integer in [0, {MAX_TOP_LOGPROBS}]")
        _require(isinstance(self.strategy, str) and self.strategy in STRATEGIES, "strategy", self.strategy,
                 f"must be one of {', '.join(STRATEGIES)}")
        for name in ("draft_length", "lookup_length", "table_length"):
            _require(_is_int(getattr(self, name)) and getattr(self, name) >= 0,
                     name, getattr(self, name), "must be an integer >= 0")
        for name in ("predraft", "fused_plan"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "must be true or false")
        _require(isinstance(self.kv_cache, str) and self.kv_cache in KV_CACHE_MODES, "kv_cache", self.kv_cache,
                 f"must be one of {', '.join(KV_CACHE_MODES)}")
        _require(self.mask_token_id is None or _is_id(self.mask_token_id),
                 "mask_token_id", self.mask_token_id, "must be a token id (an integer >= 0) or None")
        eos = self.eos_token_id
        _require(eos is None or _is_id(eos) or (isinstance(eos, (list, tuple)) and all(map(_is_id, eos))),
                 "eos_token_id", eos, "must be a token id, a list of token ids, or None")
        for name in self.ignored_fields():
            warnings.warn(IgnoredSetting(ignored_message(name, getattr(self, name), self.strategy)), stacklevel=3)

    def ignored_fields(self) -> list[str]:
        """Fields set (to other than their default) that this config's strategy never reads."""
        return [name for name in ignored_by(self.strategy) if getattr(self, name) != _DEFAULTS[name]]

    def for_strategy(self, strategy: str) -> DecodeConfig:
        """This config with another strategy, the fields the new strategy ignores back at their defaults."""
        defaults = {name: _DEFAULTS[name] for name in ignored_by(strategy)}
        return dataclasses.replace(self, strategy=strategy, **defaults)

    @property
    def canvas_length(self) -> int:
        """gen_length of the spec: max_new_tokens rounded up to a whole number of slots."""
        k = self.slot_size
        return -(-self.max_new_tokens // k) * k

    @property
    def uses_masks(self) -> bool:
        """Whether decoding feeds the model mask tokens: plan and infill, and the exact mode with draft_length > 0
        (with 0 it drafts from the text and the draft table only, and runs on any model)."""
        return self.strategy == "refusion" or (self.strategy == "speculative" and self.draft_length > 0)

    @staticmethod
    def from_preset(name: str, **settings) -> DecodeConfig:
        """The config of a named preset with `settings` set on top (a preset may hold settings of several
        strategies: those the resulting strategy ignores are dropped, unless given here)."""
        return layered_config(name, explicit=settings)

    def replace(self, **changes) -> DecodeConfig:
        """This config with `changes` (unknown names are a ConfigError listing the settings)."""
        check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_id(value) -> bool:
    return _is_int(value) and value >= 0


def check_names(settings: dict) -> None:
    """A ConfigError for the first name in `settings` that is not a DecodeConfig field."""
    for name, value in settings.items():
        _require(name in _DEFAULTS, name, value, f"unknown setting; the settings are {', '.join(_DEFAULTS)}")


def ignored_by(strategy: str) -> tuple[str, ...]:
    """The fields `strategy` never reads: those another strategy alone reads (`STRATEGY_FIELDS`)."""
    return tuple(name for owner, names in STRATEGY_FIELDS.items() if owner != strategy for name in names)


def ignored_settings(settings: dict, strategy: str) -> dict:
    """The settings (those given, not None) that `strategy` never reads."""
    ignored = ignored_by(strategy)
    return {name: value for name, value in settings.items() if value is not None and name in ignored}


def owner_of(name: str) -> str | None:
    """The strategy that alone reads field `name`, or None when every strategy reads it."""
    return next((owner for owner, names in STRATEGY_FIELDS.items() if name in names), None)


def ignored_message(name: str, value, strategy: str) -> str:
    """The one line that says a setting does nothing under `strategy`."""
    return (f"{name}={value!r} is ignored by strategy={strategy!r}: only strategy={owner_of(name)!r} reads it")


# Named decoding presets: the paper's per-task settings (docs/DECODING.md, "Settings"), the demo setting, and the embedded
# model's own (`refusion.default_decode_settings()`): the exact mode, which was the fastest on it in
# benchmarks/decode_modes.py, with the plan-and-infill settings a GSM8K sweep picked for `--strategy refusion`. A
# preset may hold the settings of several strategies: `DecodeConfig.from_preset` keeps those of the strategy chosen.
PRESETS: dict[str, dict] = {
    "demo": dict(slot_size=4, slot_threshold=0.6, token_threshold=0.3, block_size=16),
    "mmlu_pro": dict(slot_size=16, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "arc_challenge": dict(slot_size=8, slot_threshold=0.8, token_threshold=0.1, block_size=8),
    "gsm8k": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "math": dict(slot_size=32, slot_threshold=0.8, token_threshold=0.6, block_size=64),
    "gpqa": dict(slot_size=8, slot_threshold=0.8, token_threshold=0.2, block_size=16),
    "humaneval": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.4, block_size=128),
    "mbpp": dict(slot_size=32, slot_threshold=0.9, token_threshold=0.3, block_size=128),
    # the exact mode drafting from the text (prompt lookup, up to 8 copied tokens) and, when there is nothing to
    # copy, from the model's draft table (up to 16 tokens), without masks: on a 2-core AMX CPU the masks' drafts cost
    # more than they gave (docs/archive/RESULTS-LEDGER.md: *Masks' drafts in the exact mode*); for plan and
    # infill, the fastest of a k x tau_slot sweep (*Plan and infill on refusion-smol*; tau_slot 0.3 was faster still
    # with v4 and v5 but looped more, on the README's own example among others). Both were chosen on the tuning
    # prompts that BENCHMARKS.md names under "Prompts".
    "refusion-smol": dict(strategy="speculative", draft_length=0, predraft=False, lookup_length=8, table_length=16,
                          slot_size=2, slot_threshold=0.5, token_threshold=0.3, block_size=16),
}


def preset(name: str) -> dict:
    """DecodeConfig keyword arguments of a named preset, as stored (with the settings of every strategy it tunes:
    `DecodeConfig.from_preset(name)` builds its config)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown: choose one of {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])


def layered_settings(*layers: str | dict | None, explicit: dict | None = None) -> dict:
    """DecodeConfig keyword arguments from layers applied in order, each overriding the ones before: a preset
    name, or a dict of fields in which None means "not set"; then `explicit`, what the user set. None layers are
    skipped; an unknown field is a ConfigError. A field that the resulting strategy ignores is dropped when a layer
    set it (a preset holds settings of several strategies) and kept when the user did, so that the DecodeConfig
    warns about it. The one place where presets, model defaults and flags are merged."""
    settings: dict = {}
    explicit = {name: value for name, value in (explicit or {}).items() if value is not None}
    for layer in [*layers, explicit]:
        values = preset(layer) if isinstance(layer, str) else layer or {}
        check_names(values)
        settings.update({name: value for name, value in values.items() if value is not None})
    ignored = ignored_by(settings.get("strategy", _DEFAULTS["strategy"]))
    return {name: value for name, value in settings.items() if name in explicit or name not in ignored}


def layered_config(*layers: str | dict | None, explicit: dict | None = None) -> DecodeConfig:
    """The DecodeConfig of `layered_settings(*layers, explicit=explicit)`; every explicit field the strategy ignores
    warns (IgnoredSetting), even one set to its default value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", IgnoredSetting)
        cfg = DecodeConfig(**layered_settings(*layers, explicit=explicit))
    for name, value in ignored_settings(explicit or {}, cfg.strategy).items():
        warnings.warn(IgnoredSetting(ignored_message(name, value, cfg.strategy)), stacklevel=2)
    return cfg


# ------------------------------------------------------------------------------------------------------------
# fields as data: the command line, the server schema, the lm-eval arguments and the sweep axes read these

@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of dataclass `cls`, by field name, on one line."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


@functools.cache
def field_types(cls) -> dict[str, object]:
    """The type of each field of dataclass `cls` (its annotation, evaluated)."""
    return typing.get_type_hints(cls)


def value_type(annotation) -> tuple[object, bool]:
    """(the type a value is written in, whether None is allowed): `int | None` -> (int, True)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
        return annotation if not optional else typing.Union[tuple(args)], optional  # noqa: UP007
    return annotation, False


def is_scalar(annotation) -> bool:
    """Whether values of this type are one int, float, str or bool (optionally None)."""
    return value_type(annotation)[0] in (int, float, str, bool)


def parse_value(annotation, text: str):
    """A value of type `annotation` from its text on a command line or in a sweep: numbers, strings,
    true/false, "none" where None is allowed, comma-separated integers for `tuple[int, ...]` and `int | list[int]`.
    A ValueError says "not a valid <type>"."""
    kind, optional = value_type(annotation)
    text = text.strip()
    if optional and text.lower() == "none":
        return None
    if kind is bool:
        if text.lower() in ("true", "1", "yes", "on"):
            return True
        if text.lower() in ("false", "0", "no", "off"):
            return False
        raise ValueError(f"{text!r} is not a valid bool (true or false)")
    if kind in (int, float, str):
        try:
            return kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a valid {kind.__name__}") from None
    try:
        ids = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{text!r} is not a valid list of integers (e.g. 2,7)") from None
    if typing.get_origin(kind) is tuple:
        return tuple(ids)
    return ids[0] if len(ids) == 1 else ids
