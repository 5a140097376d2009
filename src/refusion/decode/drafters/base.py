"""The interface every drafter of the exact mode implements: propose drafts for a sequence, observe what was accepted.

A drafter is one source of drafts (prompt lookup, the model's draft table, the masks). The exact mode's program
(`programs/speculative.py`) asks its drafters in turn for a `Proposal` of the tokens after a sequence's text, verifies
the first one that has something (`speculate.accept_drafts`: AR decoding decides every committed token, so no drafter
can change the output, only how many tokens a forward commits), and tells every drafter the `Verdict`. Each drafter
owns what it learns from verdicts (its acceptance by depth, `acceptance.AcceptanceByDepth`, or by the frequency its
source states for each draft, `acceptance.AcceptanceByFrequency`), from which it prices each draft it proposes
(`Proposal.chances`, weighed by `costs.draft_counts`), as transformers' `CandidateGenerator` adapts in
`update_candidate_strategy` and vLLM v1 keeps one proposer per file.

Drafters that need only the text (`PromptLookup`, `TableDrafter`) are plain objects with no engine behind them: an
external engine's speculative hook (a custom proposer in vLLM, a plugin in SGLang) can build one per request, call
`propose(DraftContext(token_ids, room))` for its draft ids (`proposal.drafts.ids`) and `observe(Verdict(...))` with
the number its own verifier accepted. A drafter that rides on the verify forward (`MaskDrafter`: mask rows whose
logits draft the next round) also needs the engine to carry its `rows` and hand back their logits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from refusion.decode.acceptance import AcceptanceByDepth
from refusion.decode.acceptance import chances as depth_chances
from refusion.decode.speculate import Drafts


@dataclass(frozen=True)
class DraftContext:
    """What a drafter is told about the sequence it drafts for."""

    text: list[int]
    """The prompt, the committed response, and the next token (decided by the last forward, not yet verified):
    drafts are for the tokens after it."""
    room: int
    """How many tokens may still follow the next one (max_new_tokens): drafts beyond are never verified."""
    batch: int = 1
    """How many sequences share the step's forward."""


@dataclass(frozen=True)
class Proposal:
    """One drafter's drafts for the tokens after a sequence's text."""

    drafter: Drafter | None
    """Who proposed them (None: nobody; a plain AR round)."""
    drafts: Drafts
    """The chain: drafts of the tokens after the next token, in position order."""
    chances: tuple[float, ...] | None = None
    """For each draft of the chain, the chance that it and every draft before it are accepted, by the drafter's
    record (`acceptance.AcceptanceByDepth`, `acceptance.AcceptanceByFrequency`): what prices it. None: unpriced (a
    draft at depth i is worth 1/2^i, `chances_or_unpriced`)."""
    second: tuple[int, ...] = ()
    """A second chain at the same positions as the chain's drafts, verified beside it (greedy only): the draft
    table's runner-up and what follows it; () for none."""
    second_chances: tuple[float, ...] | None = None
    """`chances` of the second chain's tokens."""

    @staticmethod
    def none(device) -> Proposal:
        return Proposal(None, Drafts.none(device))

    @property
    def drafted(self) -> bool:
        """Whether it proposes any draft."""
        return self.drafts.tokens.numel() > 0

    def chain_chances(self) -> list[float]:
        """`chances` of the chain's drafts (unpriced ones by depth)."""
        return chances_or_unpriced(self.chances, self.drafts.tokens.numel())

    def second_chain_chances(self) -> list[float]:
        """`second_chances` of the second chain's tokens (unpriced ones by depth)."""
        return chances_or_unpriced(self.second_chances, len(self.second))

    def cut(self, count: int, second: int | None = None) -> Proposal:
        """The proposal with its chain cut to the first `count` drafts and its second chain to the first `second`
        tokens (None: as it is), each with its chances."""
        second = len(self.second) if second is None else second
        return replace(self, drafts=self.drafts[:count], second=self.second[:second],
                       chances=None if self.chances is None else self.chances[:count],
                       second_chances=None if self.second_chances is None else self.second_chances[:second])


def chances_or_unpriced(chances: tuple[float, ...] | None, count: int) -> list[float]:
    """The first `count` of `chances`, or, for a proposal its drafter did not price, the chances of an unseen
    record by depth (`acceptance.AcceptanceByDepth`'s prior)."""
    return list(chances[:count]) if chances is not None else depth_chances(count, AcceptanceByDepth())


@dataclass(frozen=True)
class Verdict:
    """What verification made of the proposal a forward carried."""

    proposal: Proposal
    """The proposal as verified (after the cuts by grammar, room and cost)."""
    accepted: int
    """How many drafts of its chain AR decoding accepted (a prefix)."""
    on_second: int = 0
    """How many tokens of its second chain AR decoding accepted (a prefix; 0 when the chain's first draft was)."""
    rows: torch.Tensor | None = None
    """[d, V] the logits of the rows the proposal's drafter added to the forward that read the accepted drafts
    (`Drafter.rows`); None when it added none for that acceptance."""
    rows_start: int = 0
    """The position the first of `rows` drafts (the others draft the positions after it)."""


class Drafter:
    """A source of drafts for one sequence. Subclasses set `name` and implement `propose`; `observe` and `rows`
    are optional."""

    name: str = ""
    """The drafter's name in the registry (`drafters.DRAFTERS`) and in statistics."""

    def propose(self, context: DraftContext) -> Proposal:
        """Drafts for the tokens after `context.text` (at most `context.room`); a proposal with no drafts (and no
        rows) when it has none: the next drafter is asked."""
        raise NotImplementedError

    def rows(self, position: int, drafted: int) -> list[tuple[int, torch.Tensor]]:
        """The rows this drafter adds to a forward that verifies its proposal of `drafted` drafts after the next
        token at `position`: (acceptance length, positions of a chain of masks) each; [] for none."""
        return []

    def rows_gain(self, drafted: int) -> float:
        """Tokens the rows it adds to a forward verifying `drafted` of its drafts are expected to commit (in the
        rounds after: what the step's decision weighs against their width)."""
        return 0.0

    def bound(self, room: int, batch: int) -> tuple[int, float] | None:
        """The most rows its next proposal, with the rows it adds, could offer a forward (`room` tokens may follow
        the next one, `batch` sequences share the step) and the most any of them could gain (`DraftBound`);
        None where it cannot say: the step then lets the sequence draft."""
        return None

    def observe(self, verdict: Verdict) -> None:
        """Learn from a verdict (every drafter sees each one, whoever proposed)."""


def draft_bound(drafters: list[Drafter], room: int, batch: int) -> tuple[int, float] | None:
    """The most a round's proposal (`propose`: one drafter's) could offer: the most rows and the highest gain per
    row of any of `drafters`; None where one of them cannot say."""
    bounds = [drafter.bound(room, batch) for drafter in drafters]
    if any(b is None for b in bounds):
        return None
    return max((rows for rows, _ in bounds), default=0), max((gain for _, gain in bounds), default=0.0)


def propose(drafters: list[Drafter], context: DraftContext, position: int, device) -> Proposal:
    """The proposal a round verifies: the first drafter's, in registry order, that has drafts; else the first whose
    rows ride on the forward (they draft the next round); else none."""
    riding = None
    for drafter in drafters:
        proposal = drafter.propose(context)
        if proposal.drafted:
            return proposal
        if riding is None and drafter.rows(position, 0):
            riding = proposal
    return riding or Proposal.none(device)
