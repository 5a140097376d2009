"""Structured output: a response constrained by a grammar (docs/DECODING.md, "Structured output").

`ResponseGrammar.compile(tokenizer, response_format, ...)` turns an OpenAI `response_format` (`{"type":
"json_object"}` or `{"type": "json_schema", "json_schema": {"schema": {...}}}`) into a grammar of the model's tokens
through llguidance; each sequence gets its own `GrammarState` (a matcher), which masks logits to the tokens the
grammar allows after the tokens consumed so far. The masks are applied where AR decoding decides a token: the AR
program's logits, and in the exact mode the verifying AR logits of every chain position (`mask_chain`), so that
both commit exactly what constrained AR decoding commits. Plan and infill decodes out of order and cannot be
constrained this way: it is refused (`check_strategy`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
"""The `response_format` types: "text" (no constraint), "json_object" (any JSON object), "json_schema"."""


COMPACT = {"whitespace_flexible": False}
"""llguidance's JSON options: JSON without free whitespace (`{"a":1}`), as OpenAI writes it; with free whitespace a
model can pad the text with spaces until it runs out of tokens."""


class UnsupportedStrategy(ValueError):
    """A response_format was asked of a strategy that cannot honour it (plan and infill)."""


def check_strategy(strategy: str) -> None:
    """Plan and infill commits slots out of order, so no left-to-right grammar state exists when it decides a
    token: only the AR and the exact mode can be constrained."""
    if strategy == "refusion":
        raise UnsupportedStrategy("response_format needs strategy 'speculative' or 'autoregressive': strategy "
                                  "'refusion' (plan and infill) decodes slots out of order, which a grammar cannot "
                                  "constrain")


def grammar_of(response_format: dict) -> dict | None:
    """The JSON schema a response_format constrains to (`{"type": "object"}` for json_object), or None for text.
    A malformed one is a ValueError naming what is wrong."""
    if not isinstance(response_format, dict) or response_format.get("type") not in RESPONSE_FORMATS:
        raise ValueError(f"response_format={response_format!r} is invalid: its type must be one of "
                         f"{', '.join(RESPONSE_FORMATS)}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
    return schema


_TOKEN_INFO: dict[tuple, tuple] = {}
"""llguidance's tokenizers, by (tokenizer id, vocab size, EOS ids): building one takes ~1 s for a 50k vocabulary."""


def _token_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """llguidance's view of the tokenizer (cached)."""
    key = (id(tokenizer), vocab_size, tuple(eos_token_ids))
    if key not in _TOKEN_INFO:
        _TOKEN_INFO[key] = (tokenizer, _build_token_info(tokenizer, vocab_size, eos_token_ids))
    return _TOKEN_INFO[key][1]  # the entry holds the tokenizer too: its id is not reused while cached


def _build_token_info(tokenizer, vocab_size: int, eos_token_ids: list[int]):
    """Straight from a byte-level tokenizer's `tokenizers` backend (the HF tokenizer JSON: transformers' fast
    tokenizers and refusion's own have one; what `llguidance.hf.from_tokenizer` reads, without importing
    transformers), else built from the vocabulary (each id's decoded text; special tokens marked as such)."""
    import copy

    import llguidance

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        backend = copy.copy(backend)
        backend.no_padding()
        backend.no_truncation()
        try:
            return llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab_size, eos_token=eos_token_ids)
        except ValueError:  # a decoder llguidance does not read (e.g. the character-level test tokenizer)
            pass
    special = set(tokenizer.all_special_ids)
    tokens = []
    for i in range(vocab_size):
        if i >= len(tokenizer) or i in special:
            tokens.append(b"\xff" + (tokenizer.convert_ids_to_tokens(i) or f"<unused{i}>").encode())
        else:
            tokens.append(tokenizer.decode([i]).encode("utf-8"))

    class Vocabulary:
        eos_token_id, bos_token_id = eos_token_ids[0], tokenizer.bos_token_id
        special_token_ids = sorted(special)

        def __init__(self):
            self.tokens = tokens

        def __call__(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=vocab_size,
                                  eos_token=eos_token_ids)


@dataclass(frozen=True)
class ResponseGrammar:
    """A compiled response grammar; `state()` starts a sequence's matcher."""

    token_info: object
    """llguidance.LLTokenizer."""
    grammar: str
    """llguidance's grammar text."""
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @staticmethod
    def compile(tokenizer, response_format: dict, vocab_size: int, eos_token_ids: list[int]) -> ResponseGrammar | None:
        """The grammar of `response_format` over a model of `vocab_size` logits; None for {"type": "text"}. A
        schema llguidance cannot compile is a ValueError."""
        import llguidance

        schema = grammar_of(response_format)
        if schema is None:
            return None
        if not eos_token_ids:
            raise ValueError("response_format needs an EOS token to end the response when the grammar is complete")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=COMPACT)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"response_format: the schema cannot be compiled: {error}")
        info = _token_info(tokenizer, vocab_size, list(eos_token_ids))
        return ResponseGrammar(info, grammar, vocab_size, tuple(eos_token_ids))

    def state(self) -> GrammarState:
        import llguidance
        return GrammarState(llguidance.LLMatcher(self.token_info, self.grammar), self.vocab_size, self.eos_token_ids)


class GrammarState:
    """One sequence's position in the grammar: the tokens consumed so far, and the masks that follow them."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: tuple[int, ...]):
        import llguidance.torch as llt
        self.matcher, self.vocab_size, self.eos_token_ids = matcher, vocab_size, set(eos_token_ids)
        self._bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (an EOS only once the grammar is complete)."""
        import llguidance.torch as llt
        llt.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        bits = torch.arange(32, dtype=torch.int32)
        words = self._bitmask[0]
        return ((words[:, None] >> bits) & 1).bool().flatten()[: self.vocab_size]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] logits with every token the grammar forbids next at -inf (a copy)."""
        return logits.masked_fill(~self.allowed().to(logits.device), float("-inf"))

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here (consumes nothing)."""
        return self.matcher.validate_tokens(tokens) if tokens else 0

    def before_eos(self, tokens: list[int]) -> list[int]:
        """The tokens before the first EOS: an EOS ends the response, the grammar reads nothing from it on."""
        return next((tokens[:i] for i, t in enumerate(tokens) if t in self.eos_token_ids), tokens)

    def consume(self, tokens: list[int]) -> int:
        """Advance past `tokens` (up to the first EOS); returns how many were consumed."""
        tokens = self.before_eos(tokens)
        if tokens and not self.matcher.consume_tokens(tokens):
            raise RuntimeError(f"the grammar refused tokens {tokens}: {self.matcher.get_error()}")
        return len(tokens)

    def rollback(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            raise RuntimeError(f"the grammar could not roll back {count} tokens")

    def mask_chain(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """logits [len(drafts) + 1, V], row i the AR prediction after the i-th draft (row 0: after the consumed
        tokens) -> each row masked by the grammar state after the drafts before it (the state is left as it was).
        Every draft must be valid here (`valid_prefix`)."""
        consumed, rows = 0, []
        for i in range(len(drafts) + 1):  # rows after an EOS draft are never read (the response ends there)
            rows.append(self.mask(logits[i]))
            if i < len(drafts):
                consumed += self.consume(drafts[: i + 1][consumed:])
        self.rollback(consumed)
        return torch.stack(rows)
