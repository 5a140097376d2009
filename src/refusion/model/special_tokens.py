"""The special tokens of a model, resolved once into one small frozen object (docs/DECODING.md, "Special tokens").

`refusion.load` resolves them when it loads a model and the tokenizer is at hand, and keeps the result in the
model's `ModelSetup` (`refusion.model.setup`: `setup_of(model).special_tokens`). A model built or loaded some other
way (plain transformers, the tiny test models) is resolved from its own configs, by the same function.
Nothing else in the package looks for token ids in `model.config`.
"""

from __future__ import annotations

from dataclasses import dataclass

MASK_TOKEN = "<|mask|>"
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
"""Chat end-of-turn tokens: an EOS id when the tokenizer's chat template uses them."""


class MissingMaskToken(ValueError):
    """The strategy asked for feeds the model mask tokens and the model has none."""


@dataclass(frozen=True)
class SpecialTokens:
    """The token ids that decoding and training need, read from the model's configs and its tokenizer."""

    mask_token_id: int | None
    """Id of <|mask|>, the token a masked slot holds; None for a plain AR model (then only strategy
    "autoregressive" can decode)."""

    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a response: the generation config's EOS ids, the tokenizer's EOS, and the chat template's
    end-of-turn token (docs/DECODING.md, "Special tokens")."""

    pad_token_id: int | None = None
    """The tokenizer's padding id (else the configs'); None when there is none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def eos_token_id(self) -> int | None:
        """The first EOS id, for interfaces that take a single one (lm-eval's `eot_token_id`)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def for_decoding(self, cfg) -> SpecialTokens:
        """These tokens with a DecodeConfig's explicit `mask_token_id` / `eos_token_id` in place of the model's;
        a clear error when `cfg.strategy` needs a mask token and there is none."""
        mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else self.mask_token_id
        eos_ids = self.eos_token_ids if cfg.eos_token_id is None else _as_ids(cfg.eos_token_id)
        if mask_id is None and cfg.uses_masks:
            raise MissingMaskToken(f"mask_token_id is unknown: the model has no {MASK_TOKEN} token, which strategy "
                             f"{cfg.strategy!r} needs. Pass DecodeConfig(mask_token_id=...), use "
                             "strategy='autoregressive' (or 'speculative' with draft_length=0), or turn the model "
                             "into a ReFusion model with `refusion train`")
        return SpecialTokens(mask_id, eos_ids, self.pad_token_id)


def resolve_special_tokens(model, tokenizer=None) -> SpecialTokens:
    """The special tokens of `model` (and its `tokenizer`, when given): the one place they are worked out.

    1. mask: the config's `mask_token_id` (how a ReFusion checkpoint records it), else the tokenizer's <|mask|>.
    2. EOS: the generation config's `eos_token_id` ids (else the config's), what transformers' `generate`
       stops on; then the tokenizer's EOS and the chat template's end-of-turn token, when not among them.
    3. pad: the tokenizer's pad id, else the generation config's, else the config's.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    generation_config = getattr(model, "generation_config", None)
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    # 1. mask
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        mask_id = getattr(config, "mask_token_id", None)
    if mask_id is None:
        mask_id = vocab.get(MASK_TOKEN)
    # 2. EOS
    eos_ids = list(_as_ids(getattr(generation_config, "eos_token_id", None)))
    if not eos_ids:
        eos_ids = list(_as_ids(getattr(config, "eos_token_id", None)))
    if tokenizer is not None:
        template = getattr(tokenizer, "chat_template", None) or ""
        extra = [tokenizer.eos_token_id] + [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in template]
        eos_ids += [t for t in dict.fromkeys(extra) if t is not None and t not in eos_ids]
    # 3. pad
    pad_id = getattr(tokenizer, "pad_token_id", None)
    for source in (generation_config, config):
        if pad_id is None:
            pad_id = getattr(source, "pad_token_id", None)
    return SpecialTokens(None if mask_id is None else int(mask_id), tuple(eos_ids),
                         None if pad_id is None else int(pad_id))


def _as_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
