"""Prompt lookup: drafts copied from the text itself, after an earlier occurrence of its last tokens
(`DecodeConfig.lookup_length`; docs/DECODING.md, "The exact mode")."""

from __future__ import annotations

from refusion.decode.acceptance import AcceptanceByDepth, chances
from refusion.decode.drafters.base import DraftContext, Drafter, Proposal, Verdict
from refusion.decode.speculate import copied_drafts

LOOKUP_MATCHES = (3, 2)
"""Lengths of the text's last tokens that prompt lookup searches for, longest first."""


def lookup_drafts(text: list[int], length: int) -> list[int]:
    """Prompt lookup: the (up to) `length` tokens that followed the latest earlier occurrence of the text's last
    3 tokens (else 2) in the text itself (prompt and response so far); [] when they did not occur."""
    for n in LOOKUP_MATCHES:
        if len(text) <= n:
            continue
        tail = text[-n:]
        for start in range(len(text) - n - 1, -1, -1):
            if text[start: start + n] == tail:
                return text[start + n: start + n + length]
    return []


class LatestOccurrences:
    """`lookup_drafts` over a text that grows between calls, without scanning it again each time: where each
    n-gram (n in `LOOKUP_MATCHES`) last started, kept for every start but the text's last n-gram's own. A decoding
    sequence's text only grows, so each call indexes the starts its new tokens complete (a text that is not an
    extension of the last one is indexed afresh); the answer is `lookup_drafts`'s, which scans the whole text."""

    def __init__(self):
        self.text: list[int] = []
        """The text indexed so far."""
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in LOOKUP_MATCHES}
        """Per n: each n-gram's latest start among the indexed ones (every start before the text's last n-gram)."""

    def drafts(self, text: list[int], length: int) -> list[int]:
        """`lookup_drafts(text, length)`."""
        self._index(text)
        for n in LOOKUP_MATCHES:
            start = self.latest[n].get(tuple(text[-n:])) if len(text) > n else None
            if start is not None:
                return text[start + n: start + n + length]
        return []

    def _index(self, text: list[int]) -> None:
        if text[:len(self.text)] != self.text:  # not an extension: index it afresh
            self.text, self.latest = [], {n: {} for n in LOOKUP_MATCHES}
        known = len(self.text)
        for n, latest in self.latest.items():
            for start in range(max(known - n, 0), len(text) - n):
                latest[tuple(text[start: start + n])] = start
        self.text += text[known:]


class PromptLookup(Drafter):
    """Up to `length` tokens copied from what followed the latest earlier occurrence of the text's last tokens."""

    name = "lookup"

    def __init__(self, length: int, device="cpu"):
        self.length, self.device = length, device
        self.acceptance = AcceptanceByDepth()  # of its chains, in this sequence
        self.occurrences = LatestOccurrences()  # of the sequence's text, which grows step by step

    @staticmethod
    def for_sequence(seq) -> PromptLookup | None:
        """The sequence's prompt lookup (None: `cfg.lookup_length` is 0)."""
        cfg = seq.cfg
        return PromptLookup(cfg.lookup_length, seq.device) if cfg.lookup_length else None

    def propose(self, context: DraftContext) -> Proposal:
        copied = self.occurrences.drafts(context.text, self.length)
        if not copied:
            return Proposal.none(self.device)
        return Proposal(self, copied_drafts(copied, self.device), tuple(chances(len(copied), self.acceptance)))

    def bound(self, room: int, batch: int) -> tuple[int, float]:
        """Up to `length` drafts, each worth at most the first's chance (a deeper one's is a product of rates)."""
        return min(self.length, room), self.acceptance.rate(1)

    def observe(self, verdict: Verdict) -> None:
        drafted = verdict.proposal.drafts.tokens.numel()
        if verdict.proposal.drafter is self and drafted:
            self.acceptance.record(drafted, verdict.accepted)
