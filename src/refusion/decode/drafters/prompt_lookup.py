"""Prompt lookup: drafts copied from the text itself, after an earlier occurrence of its last tokens
(`DecodeConfig.lookup_length`; docs/DECODING.md, "The exact mode")."""

from __future__ import annotations

from refusion.decode.costs import AcceptanceByDepth
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


class PromptLookup(Drafter):
    """Up to `length` tokens copied from what followed the latest earlier occurrence of the text's last tokens."""

    name = "lookup"

    def __init__(self, length: int, device="cpu"):
        self.length, self.device = length, device
        self.acceptance = AcceptanceByDepth()  # of its chains, in this sequence

    @staticmethod
    def for_sequence(seq) -> PromptLookup | None:
        """The sequence's prompt lookup (None: `cfg.lookup_length` is 0)."""
        cfg = seq.cfg
        return PromptLookup(cfg.lookup_length, seq.device) if cfg.lookup_length else None

    def propose(self, context: DraftContext) -> Proposal:
        copied = lookup_drafts(context.text, self.length)
        if not copied:
            return Proposal.none(self.device)
        return Proposal(self, copied_drafts(copied, self.device), self.acceptance)

    def observe(self, verdict: Verdict) -> None:
        drafted = verdict.proposal.drafts.tokens.numel()
        if verdict.proposal.drafter is self and drafted:
            self.acceptance.record(drafted, verdict.accepted)
