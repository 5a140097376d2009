"""What `generate` returns: sequences, statistics and (when asked) the decoding trace."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class SlotEvent:
    """One slot (or AR token run) in one round of the trace."""

    start: int
    """Position id of the slot's first token."""
    tokens: list[int]
    """Drafted tokens (for "planned"/"drafted") or committed tokens (for commits)."""
    score: float | None = None
    """Planning score (confidence of the first drafted token), when planned."""


def add_counts(total: dict[str, int], counts: dict[str, int]) -> dict[str, int]:
    """Add `counts` into `total`, key by key (new keys in first-seen order); returns `total`."""
    for key, n in counts.items():
        total[key] = total.get(key, 0) + n
    return total


@dataclass(kw_only=True)
class RoundAccounting:
    """Where a round's forwards went and, in the exact mode, how its drafts fared. Shared by the engine's
    `RoundTrace` and the trace file's record; given by keyword."""

    phase_forwards: dict[str, int] = field(default_factory=dict)
    """Where the round's forwards went: "prefill" (the prompt, exact and AR modes), "plan" (the first one
    carries the prompt), "verify", "complete" (parallel completion, KV recompute), "decode" (AR)."""
    fused_plan: bool = False
    """Whether the round's plan rode on the previous round's last forward (it cost no forward of its own)."""
    drafted: int = 0
    """speculative: drafted tokens verified in the round's forward."""
    accepted: int = 0
    """speculative: drafted tokens accepted (the round also commits the model's own next token)."""

    @property
    def tokens(self) -> int:
        """Tokens committed in the round (`committed` is a list of slots with `tokens`)."""
        return sum(len(s.tokens) for s in self.committed)


@dataclass(kw_only=True)
class RoundTrace(RoundAccounting):
    """What one round of decoding did for one sequence (docs/DECODING.md, paper §3). Built by keyword."""

    index: int
    """Round number, from 0."""
    block: int
    """Block being decoded."""
    masked_slots: list[int]
    """Start positions of the slots still masked in the block when the round began."""
    planned: list[SlotEvent]
    """Slots selected by the plan step, with their drafts and scores."""
    committed: list[SlotEvent]
    """Slots committed this round (tokens cut after EOS), in commit order."""
    how: str
    """"fast_accept", "parallel_completion", "speculative" or "autoregressive"."""
    forwards: int
    """Forward passes spent in this round (the first round includes the prompt)."""
    finished: bool = False
    """Whether EOS was committed in this round."""
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _Rates:
    """tokens_per_forward and tokens_per_second of a stats record with tokens, forwards and seconds."""

    tokens: int
    forwards: int
    seconds: float

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tokens_per_forward": self.tokens_per_forward,
                "tokens_per_second": self.tokens_per_second}


@dataclass
class SequenceStats(_Rates):
    """Statistics of one sequence of a batch."""

    tokens: int = 0
    """Response tokens returned (up to and including EOS)."""
    forwards: int = 0
    """Forward passes this sequence took part in (prefill included)."""
    rounds: int = 0
    """Plan-and-infill rounds (autoregressive: tokens)."""
    seconds: float = 0.0
    """Wall time from the start of the batch until this sequence finished."""
    finish_reason: str = "length"
    """"eos" or "length"."""
    phase_forwards: dict[str, int] = field(default_factory=dict)
    """Forwards per phase over all rounds: "plan", "verify", "complete" (see `RoundTrace.phase_forwards`)."""
    committed_by: dict[str, int] = field(default_factory=dict)
    """Tokens committed per kind of round: "fast_accept", "parallel_completion", "speculative", "autoregressive"."""
    drafted: int = 0
    """speculative: drafted tokens verified."""
    accepted: int = 0
    """speculative: drafted tokens accepted."""
    cached_tokens: int | None = None
    """Prompt tokens whose KV entries came from the prefix cache (not prefilled); None: decoded without one."""

    def add_round(self, rnd: RoundTrace) -> None:
        """Account for one round."""
        self.rounds += 1
        add_counts(self.phase_forwards, rnd.phase_forwards)
        add_counts(self.committed_by, {rnd.how: rnd.tokens})
        self.drafted += rnd.drafted
        self.accepted += rnd.accepted


@dataclass
class BatchStats(_Rates):
    """Statistics of the whole batch."""

    tokens: int = 0
    """Response tokens over all sequences."""
    forwards: int = 0
    """Batched forward passes run (one forward may serve many sequences)."""
    seconds: float = 0.0
    """Wall time of the batch, prefill included."""
    forward_seconds: float = 0.0
    """Time spent inside model forwards."""


@dataclass
class GenerationStats:
    per_sequence: list[SequenceStats]
    batch: BatchStats

    def to_dict(self) -> dict:
        return {"per_sequence": [s.to_dict() for s in self.per_sequence], "batch": self.batch.to_dict()}


@dataclass(frozen=True)
class TokenLogprob:
    """One response token's log-probability, and the most likely tokens of the distribution it was committed
    from (what `GenerationOutput.logprobs` holds)."""

    token: int
    """The committed token id."""
    logprob: float
    """Its log-probability."""
    top: list[tuple[int, float]]
    """(token id, log-probability) of the `DecodeConfig.logprobs` most likely tokens, most likely first
    (empty when `logprobs=0`)."""


@dataclass
class GenerationOutput:
    """Result of `refusion.generate`."""

    sequences: list[list[int]]
    """One list of generated ids per prompt (prompt excluded), up to and including the first EOS, or
    max_new_tokens long."""
    stats: GenerationStats
    traces: list[list[RoundTrace]] | None = field(default=None)
    """Per sequence, the rounds of decoding (only when `trace=True`)."""
    logprobs: list[list[TokenLogprob]] | None = field(default=None)
    """Per sequence, one entry per token of `sequences[i]` (aligned with it): the token's log-probability and the
    top alternatives of the distribution it was committed from (only when `DecodeConfig.logprobs` is set;
    docs/DECODING.md, "Logprobs")."""
