"""How the exact mode's drafts fared: per drafter, the records that give each draft it proposes its chance of
acceptance (`drafters.Proposal.chances`), which `costs.draft_counts` weighs against the forward's cost.

* `AcceptanceByDepth`: how often a draft at depth i was accepted once the drafts before it were (a Beta(1, 1) prior:
  1/2 before anything is seen), per sequence and drafter;
* `AcceptanceByFrequency`: for the draft table, which states a frequency for each draft, the same per tenth of that
  frequency, with the frequency as the prior, shared by a decoder's sequences (docs/DECODING.md, "How far each
  sequence drafts").
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class AcceptanceByDepth:
    """How the drafts of one source fared in one sequence: at each depth (1 = the first draft of a chain), how
    many were verified with every draft before them accepted, and how many of those were accepted."""

    reached: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """A verified chain of `drafted` drafts of which the first `accepted` were accepted."""
        depth = min(accepted + 1, drafted)  # the drafts verified with every earlier one accepted
        grow = depth - len(self.reached)
        if grow > 0:
            self.reached += [0] * grow
            self.accepted += [0] * grow
        for i in range(depth):
            self.reached[i] += 1
            self.accepted[i] += i < accepted

    def rate(self, depth: int) -> float:
        """Chance that the draft at `depth` (1-based) is accepted once every earlier one was (Beta(1, 1) prior)."""
        i = depth - 1
        if i >= len(self.reached):
            return 0.5
        return (self.accepted[i] + 1) / (self.reached[i] + 2)


FREQUENCY_BINS = 10
"""`AcceptanceByFrequency` learns one rate per tenth of the stated frequency."""
FREQUENCY_PRIOR_WEIGHT = 4.0
"""How many verified drafts the stated frequency itself counts as, in each bin of `AcceptanceByFrequency`."""


@dataclass
class AcceptanceByFrequency:
    """How the drafts of a source that states a frequency for each draft (the draft table: how often its token
    followed the run it was read after in the model's own answers) fared in one decoder's sequences: per tenth of
    that frequency, how many were verified with every draft before them accepted, and how many of those were
    accepted.

    A draft's chance is its bin's record with the stated frequency as the prior, weighted as FREQUENCY_PRIOR_WEIGHT
    drafts: before anything is seen the chance is the frequency, which on the table's own answers predicts
    acceptance (13 % of the drafts stated at 0.1-0.2 were accepted, 88 % at 0.9-1; depth alone gives 47 % to all
    first drafts), and the verdicts then correct it (docs/DECODING.md, "How far each sequence drafts")."""

    reached: list[int] = field(default_factory=lambda: [0] * FREQUENCY_BINS)
    accepted: list[int] = field(default_factory=lambda: [0] * FREQUENCY_BINS)

    @staticmethod
    def bin(frequency: float) -> int:
        return min(max(int(frequency * FREQUENCY_BINS), 0), FREQUENCY_BINS - 1)

    def record(self, frequencies: list[float], accepted: int) -> None:
        """A verified chain whose drafts stated `frequencies`, of which the first `accepted` were accepted."""
        for i, frequency in enumerate(frequencies[: accepted + 1]):
            b = self.bin(frequency)
            self.reached[b] += 1
            self.accepted[b] += i < accepted

    def rate(self, frequency: float) -> float:
        """Chance that a draft stated at `frequency` is accepted once every earlier draft of its chain was."""
        return self._rate(self.bin(frequency), frequency)

    def _rate(self, b: int, frequency: float) -> float:
        return (self.accepted[b] + FREQUENCY_PRIOR_WEIGHT * frequency) / (self.reached[b] + FREQUENCY_PRIOR_WEIGHT)

    def chances(self, frequencies: list[float]) -> list[float]:
        """For each i, the chance that the chain's first i drafts are all accepted."""
        return chain_chances(self.rate(frequency) for frequency in frequencies)

    def highest(self) -> float:
        """The highest chance any single draft could have (each bin at its top frequency)."""
        return max(self._rate(b, (b + 1) / FREQUENCY_BINS) for b in range(FREQUENCY_BINS))


def chain_chances(rates: Iterable[float]) -> list[float]:
    """Each draft's chance of acceptance once every earlier one was -> for each i, the chance that the chain's first
    i drafts are all accepted (the running product)."""
    return list(itertools.accumulate(rates, operator.mul))


def chances(count: int, acceptance: AcceptanceByDepth) -> list[float]:
    """For i = 1 .. count, the chance that the first i drafts of a chain are all accepted: what verifying the i-th
    adds to the tokens a forward is expected to commit."""
    return chain_chances(acceptance.rate(depth) for depth in range(1, count + 1))


def expected_tokens(count: int, acceptance: AcceptanceByDepth) -> float:
    """Tokens a forward verifying `count` drafts of a chain is expected to commit for them: the sum over i <= count
    of the chance that the first i are accepted."""
    return sum(chances(count, acceptance))
