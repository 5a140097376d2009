"""One sequence's decoding state (`Sequence`), the forward it asks for (`Forward`), and the steps every program
shares.

A program (`refusion.decode.programs`) is a generator. Each time it needs the model it yields a `Forward` (its new
tokens, their position ids and groups) and receives the logits of those tokens; the batching loop (`loop.py`) runs
the forwards of every live sequence of a batch together. Before a forward, the exact mode's program may yield a
`DraftBound` (the most its drafts could be worth), and receives whether any draft could pay in the step; then a
`DraftOffer`, and receives how many of its drafts the step verifies. Between forwards a program commits, retains or
discards its pending KV entries through `Sequence`, which owns its row of the `SlotCache`.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import torch

from refusion.config import DecodeConfig
from refusion.decode.acceptance import AcceptanceByFrequency
from refusion.decode.cache import SlotCache
from refusion.decode.grammar import GrammarState
from refusion.decode.infill import cut_after_first_eos
from refusion.decode.logprobs import TokenLogprob, TokenLogprobs, shifted_token_logprobs, token_logprobs
from refusion.decode.outputs import RoundTrace, SequenceStats, SlotEvent
from refusion.decode.sampling import PositionNoise
from refusion.model.calibration import ForwardCosts
from refusion.model.draft_table import DraftTable


@dataclass
class Forward:
    """One sequence's share of a batched forward."""

    tokens: torch.Tensor
    """[T] input ids."""
    positions: torch.Tensor
    """[T] position ids (true text positions)."""
    groups: torch.Tensor
    """[T] group of each token: a token sees the context, and earlier tokens of its own group."""
    logits_from: int = 0
    """Logits are returned for tokens[logits_from:]."""
    lower_upto: torch.Tensor | None = None
    """[T] or None: a token also sees the pending entries of every lower group at positions <= this (-1: none)."""
    may_end_round: bool = False
    """Plan and infill: the round may end with this forward (what the fused plan rides on: `with_next_plan`)."""

    def with_branch(self, tokens: torch.Tensor, positions: torch.Tensor, group: int, upto: int) -> Forward:
        """This forward plus `tokens` appended as group `group`, reading lower groups' entries up to `upto`."""
        lower = self.lower_upto if self.lower_upto is not None else torch.full_like(self.positions, -1)
        return Forward(torch.cat([self.tokens, tokens]), torch.cat([self.positions, positions]),
                       torch.cat([self.groups, torch.full_like(tokens, group)]), self.logits_from,
                       torch.cat([lower, torch.full_like(tokens, upto)]), self.may_end_round)

    @property
    def logits_count(self) -> int:
        """How many logits rows the forward returns."""
        return self.tokens.numel() - self.logits_from


@dataclass(frozen=True)
class DraftOffer:
    """What a sequence could verify in the next forward, before the step decides how much of it pays
    (`costs.draft_counts`): the program yields it, is sent how many of its items the step takes, and yields its
    `Forward`."""

    width: int
    """Tokens the sequence's forward holds whatever it drafts (the next token: 1)."""
    items: tuple[tuple[int, float], ...]
    """(rows, expected committed tokens) each item adds, in the order they are taken (an item only with the items
    before it)."""


@dataclass(frozen=True)
class DraftBound:
    """The most a sequence's next `DraftOffer` could be worth, before its drafters are asked for drafts: the program
    yields it, is sent whether any draft of the step could pay (`costs.drafting_may_pay`, over every sequence's
    bound), and drafts only where one could (on a CPU's wide batches none can, and asking the drafters is then
    wasted host work)."""

    rows: int
    """The most rows the offer could add to the sequence's forward."""
    gain_per_row: float
    """The most any of those rows could add to the tokens the forward is expected to commit (an item's gain over
    its rows: a draft's chance of acceptance)."""


Program = Generator[Forward | DraftBound | DraftOffer, torch.Tensor | bool | int, None]
"""A decoding program: yields the forwards it needs (and, in the exact mode, the bound of its drafts and the drafts
it offers), is sent each forward's logits (and whether drafts may pay, and each offer's count)."""


class Sequence:
    """State of one sequence: prompt, committed tokens, settings, statistics and trace.

    Programs change it only through its verbs: `commit`, `retain`, `discard` (the sequence's row of the
    `SlotCache`), `record` (a finished round) and `finish` (why it ended)."""

    def __init__(self, seq_id: int, prompt: list[int], cfg: DecodeConfig, *, mask_token_id: int | None,
                 eos_token_ids: list[int], cache: SlotCache, device: torch.device,
                 generator: torch.Generator | None = None, trace: bool = False, on_round=None,
                 draft_table: DraftTable | None = None, grammar: GrammarState | None = None,
                 forward_costs: ForwardCosts | None = None, noise: PositionNoise | None = None,
                 table_acceptance: AcceptanceByFrequency | None = None):
        self.id, self.cfg, self.cache, self.device = seq_id, cfg, cache, device
        self.draft_table = draft_table  # the model's n-gram drafts (exact mode, cfg.table_length), or None
        self.forward_costs = forward_costs  # seconds of a forward by width (the exact mode's draft count), or None
        # how the draft table's drafts fared, shared by the sequences of a decoder (None: this sequence's own)
        self.table_acceptance = table_acceptance
        self.grammar = grammar  # the response's grammar state (structured output: AR and exact mode), or None
        self.prompt = torch.tensor(prompt, dtype=torch.long, device=device)
        self.mask_token_id = mask_token_id
        self.eos_ids = torch.tensor(eos_token_ids, dtype=torch.long, device=device)
        self._eos_id_set = frozenset(eos_token_ids)  # the same ids, for tokens already on the host
        self.generator = generator  # plan and infill's sampling stream (temperature > 0), or None
        self.noise = noise  # AR and exact-mode sampling: each position's own noise (temperature > 0), or None
        self.cached_prefix = 0
        """Prompt tokens whose KV entries came from the prefix cache (`reuse_prefix`): the prefill starts after them."""
        self.committed_tokens: list[torch.Tensor] = []
        self.committed_positions: list[torch.Tensor] = []
        self.committed_logprobs: list[tuple[torch.Tensor, TokenLogprobs]] = []
        """(positions, log-probabilities) of the committed response tokens, when cfg.logprobs is set."""
        self.stats = SequenceStats()
        self.rounds: list[RoundTrace] | None = [] if trace else None
        self.on_round = on_round
        self.started = time.perf_counter()
        self.finished = False
        self._positions: torch.Tensor | None = None  # every position id of the sequence (`position_ids`)
        self._listed: list[int] | None = []
        """The response's ids in position order while every commit handed them over in order (`commit`'s `ids`:
        AR decoding and the exact mode), so a stream reads them without sorting the context; None once one did not."""
        self._first_eos: int | None = None  # where in `_listed` the first EOS is
        cache.add_sequence(seq_id)

    @property
    def prompt_length(self) -> int:
        return self.prompt.numel()

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.isin(tokens, self.eos_ids)

    def is_eos_id(self, token_id: int) -> bool:
        """Whether a token id (read back to the host) ends the sequence."""
        return token_id in self._eos_id_set

    @property
    def wants_logprobs(self) -> bool:
        """Whether committed response tokens record their log-probabilities (`cfg.logprobs`)."""
        return self.cfg.logprobs is not None

    def logprobs_of(self, logits: torch.Tensor, tokens: torch.Tensor) -> TokenLogprobs | None:
        """The log-probabilities of `tokens` [...] under `logits` [..., V]; None when the config asks for none."""
        return token_logprobs(logits, tokens, self.cfg.logprobs) if self.wants_logprobs else None

    def shifted_logprobs_of(self, logits: torch.Tensor, tokens: torch.Tensor) -> TokenLogprobs | None:
        """The AR log-probabilities of `tokens` [..., T] given the tokens before them in the same forward
        ([..., T, V]; token 0 reads its own logits); None when the config asks for none."""
        return shifted_token_logprobs(logits, tokens, self.cfg.logprobs) if self.wants_logprobs else None

    def commit(self, tokens: torch.Tensor, positions: torch.Tensor, *, cached: bool = True,
               group: int | torch.Tensor | None = None, logprobs: TokenLogprobs | None = None,
               ids: list[int] | None = None) -> None:
        """Append tokens to the context; their pending KV entries (of `group`, where several groups hold a
        position; a tensor: each position's group) become context (KV reuse). `cached=False` for tokens that end
        the sequence before any forward saw them (they have no KV). `logprobs`: of the (response) tokens, one
        entry each, when the config asks for them. `ids`: the tokens on the host, where they continue the response
        right after what was committed before (a program that commits in order: the response is then read from
        them); None: the response is read from the context sorted by position from now on."""
        if cached:
            self.cache.commit(self.id, positions, group)
        self.committed_tokens.append(tokens)
        self.committed_positions.append(positions)
        if ids is None:
            self._listed = None
        elif self._listed is not None:
            if self._first_eos is None:
                self._first_eos = next((len(self._listed) + i for i, t in enumerate(ids) if self.is_eos_id(t)), None)
            self._listed += ids
        if logprobs is not None:
            if len(logprobs) != tokens.numel():
                raise RuntimeError(f"{len(logprobs)} logprobs for {tokens.numel()} committed tokens")
            self.committed_logprobs.append((positions, logprobs))

    def reuse_prefix(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Before the first forward: the KV entries of the prompt's first n tokens (per layer [kv_heads, n,
        head_dim], from the prefix cache) join the context, so the prefill computes only the rest."""
        n = keys[0].shape[1]
        self.cache.add_context(self.id, torch.arange(n, device=self.device), keys, values)
        self.cached_prefix = n

    def position_ids(self, start: int, count: int) -> torch.Tensor:
        """[count] the position ids start .. start + count - 1: views of one tensor of the sequence's positions, so
        that a round's forward and commit build none."""
        if self._positions is None or start + count > self._positions.numel():
            span = max(start + count, self.prompt_length + self.cfg.max_new_tokens)
            self._positions = torch.arange(span, device=self.device)
        return self._positions[start: start + count]

    def commit_prompt(self) -> None:
        """After the prefill forward: the prompt joins the context (its pending entries; the cached prefix's
        already did)."""
        positions = self.position_ids(0, self.prompt_length)
        self.cache.commit(self.id, positions[self.cached_prefix:])
        self.committed_tokens.append(self.prompt)
        self.committed_positions.append(positions)

    def retain(self, positions: torch.Tensor) -> None:
        """Keep the pending KV entries at `positions` pending; drop every other pending entry."""
        self.cache.retain(self.id, positions)

    def discard(self) -> None:
        """Drop every pending KV entry: the cache holds exactly the context again."""
        self.cache.discard(self.id)

    def record(self, rnd: RoundTrace) -> None:
        self.stats.add_round(rnd)
        if self.rounds is not None:
            self.rounds.append(rnd)
        if self.on_round is not None:
            self.on_round(self, rnd)

    def finish(self, reason: str) -> None:
        """The program is done: "eos" (it committed an end-of-sequence token) or "length"."""
        self.stats.finish_reason = reason
        self.stats.tokens = len(self.response())

    def _committed_in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions) of the context sorted by position."""
        tokens, positions = torch.cat(self.committed_tokens), torch.cat(self.committed_positions)
        order = torch.argsort(positions)
        return tokens[order], positions[order]

    def context_tokens(self, count: int) -> list[int]:
        """The first `count` tokens of the context in position order (the prompt, then the response): those whose KV
        entries are in the cache, where the program commits position after position (AR decoding, the exact mode)."""
        tokens, positions = self._committed_in_order()
        if positions.numel() < count or (count and int(positions[count - 1]) != count - 1):
            raise RuntimeError(f"the context's first {count} positions are not all committed")
        return tokens[:count].tolist()

    def _as_response(self, tokens: torch.Tensor) -> list[int]:
        """Response tokens cut after the first EOS and at max_new_tokens."""
        return tokens[cut_after_first_eos(self.is_eos(tokens))][: self.cfg.max_new_tokens].tolist()

    def response(self) -> list[int]:
        """Committed response tokens in position order, up to and including the first EOS."""
        if self._listed is not None:
            return self._listed_response()
        if not self.committed_tokens:
            return []
        tokens, positions = self._committed_in_order()
        return self._as_response(tokens[positions >= self.prompt_length])

    def contiguous_response(self) -> list[int]:
        """The response prefix whose every position is committed (what a stream may show)."""
        if self._listed is not None:
            return self._listed_response()
        return self._sorted_contiguous_response()

    def _listed_response(self) -> list[int]:
        """The response from the ids its commits handed over in order (`commit`'s `ids`), cut as `_as_response`
        cuts it."""
        end = len(self._listed) if self._first_eos is None else self._first_eos + 1
        return self._listed[: min(end, self.cfg.max_new_tokens)]

    def _sorted_contiguous_response(self) -> list[int]:
        """`contiguous_response` from the context sorted by position (whatever order the commits came in)."""
        if not self.committed_tokens:
            return []
        tokens, positions = self._committed_in_order()
        present = torch.zeros(self.prompt_length + self.cfg.canvas_length + 1, dtype=torch.bool, device=self.device)
        present[positions] = True
        missing = (~present[self.prompt_length:]).nonzero()
        end = self.prompt_length + (int(missing[0]) if missing.numel() else self.cfg.canvas_length)
        return self._as_response(tokens[(positions >= self.prompt_length) & (positions < end)])

    def response_logprobs(self, start: int = 0, stop: int | None = None) -> list[TokenLogprob]:
        """Log-probabilities of response tokens [start, stop) (default: all of `response()`), in position order;
        [] when the config asks for none. Every response position up to `stop` must be committed."""
        if not self.wants_logprobs:
            return []
        stop = len(self.response()) if stop is None else stop
        if stop <= start:
            return []
        positions = torch.cat([p for p, _ in self.committed_logprobs]) - self.prompt_length
        logprobs = TokenLogprobs.cat([lp for _, lp in self.committed_logprobs])
        order = torch.argsort(positions)
        wanted = order[start:stop]
        if not torch.equal(positions[wanted], torch.arange(start, stop, device=positions.device)):
            raise RuntimeError(f"response positions [{start}, {stop}) lack logprobs")
        return logprobs[wanted].to_list()


def slot_events(starts: torch.Tensor, tokens: list[torch.Tensor], scores=None) -> list[SlotEvent]:
    """Trace records of slots starting at `starts` holding `tokens` (with their plan `scores`, when planned)."""
    return [SlotEvent(int(s), t.tolist(), None if scores is None else float(scores[i]))
            for i, (s, t) in enumerate(zip(starts, tokens))]


def masks(seq: Sequence, positions: torch.Tensor) -> torch.Tensor:
    """Mask tokens for `positions`."""
    return torch.full_like(positions, seq.mask_token_id)


def zeros(tokens: torch.Tensor) -> torch.Tensor:
    """Group 0 for every token."""
    return torch.zeros_like(tokens)


def prefill(seq: Sequence, mask_positions: torch.Tensor, logits_from: int) -> Forward:
    """The first forward of every mode: the prompt after its cached prefix (`Sequence.cached_prefix`, already in the
    context), then masks at `mask_positions` (none for AR), one group; logits from prompt position `logits_from`
    on. The commit that follows it is `Sequence.commit_prompt`."""
    start = seq.cached_prefix
    prompt = seq.prompt[start:]
    prompt_positions = torch.arange(start, seq.prompt_length, device=seq.device)
    if not mask_positions.numel():
        return Forward(prompt, prompt_positions, zeros(prompt), logits_from - start)
    tokens = torch.cat([prompt, masks(seq, mask_positions)])
    return Forward(tokens, torch.cat([prompt_positions, mask_positions]), zeros(tokens), logits_from - start)
