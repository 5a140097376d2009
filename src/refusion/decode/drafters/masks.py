"""Drafts from mask tokens: chains of masks ride on each verify forward, and their logits draft the tokens after
what the forward accepts (`DecodeConfig.draft_length`, `predraft`, `draft_threshold`; docs/DECODING.md, "The exact
mode")."""

from __future__ import annotations

import torch

from refusion.decode.costs import AcceptanceByDepth, chances, expected_tokens
from refusion.decode.drafters.base import DraftContext, Drafter, Proposal, Verdict
from refusion.decode.infill import accepted_prefix
from refusion.decode.plan import greedy
from refusion.decode.speculate import Drafts, sample


def draft_tokens_from_masks(mask_logits: torch.Tensor, temperature: float,
                            generator: torch.Generator | None) -> Drafts:
    """[d, V] logits at masked positions -> drafts: argmax at temperature 0, else samples of softmax(l / T)."""
    if temperature <= 0:
        return Drafts(greedy(mask_logits), None)
    probs = torch.softmax(mask_logits.float() / temperature, -1)
    return Drafts(sample(probs, generator).squeeze(-1), probs)


def confident_drafts(drafts: Drafts, mask_logits: torch.Tensor, threshold: float) -> Drafts:
    """The drafts before the first mask whose draft distribution peaks below `threshold` ([d, V] mask_logits:
    the logits they were drafted from). Verifying fewer drafts never changes what is committed, only how fast;
    the cut depends on the distributions, not on the tokens drawn from them, so sampling stays exact."""
    if threshold <= 0 or drafts.tokens.numel() == 0:
        return drafts
    probs = drafts.probs if drafts.probs is not None else torch.softmax(mask_logits.float(), -1)
    return drafts[: int(accepted_prefix(probs.amax(-1) >= threshold).sum())]


class MaskDrafter(Drafter):
    """A chain of `draft_length` + 1 masks after the drafts (`predraft`: one per possible acceptance length, each
    reading exactly the accepted prefix); the first mask stands for the token AR decoding gives after the accepted
    drafts and drafts nothing, the others draft the tokens after it. Its drafts are the ones read back from the last
    forward it rode on."""

    name = "masks"

    def __init__(self, draft_length: int, end: int, predraft: bool = False, threshold: float = 0.0,
                 temperature: float = 0.0, generator: torch.Generator | None = None, device="cpu"):
        self.draft_length, self.end, self.predraft, self.threshold = draft_length, end, predraft, threshold
        self.temperature, self.generator, self.device = temperature, generator, device
        self.pending = Drafts.none(device)  # read from the last forward's masks
        self.acceptance = AcceptanceByDepth()  # of its chains, in this sequence

    @staticmethod
    def for_sequence(seq) -> MaskDrafter | None:
        """The sequence's masks (None: `cfg.draft_length` is 0)."""
        cfg = seq.cfg
        if not cfg.draft_length:
            return None
        return MaskDrafter(cfg.draft_length, seq.prompt_length + cfg.max_new_tokens, cfg.predraft,
                           cfg.draft_threshold, cfg.temperature, seq.generator, seq.device)

    def mask_positions(self, after: int) -> torch.Tensor:
        """Positions of the masks that draft the tokens after position `after` + 1 (the first mask stands for the
        token the AR logits give at `after` + 1), up to the end of the response."""
        stop = max(after + 1, min(after + 2 + self.draft_length, self.end))
        return torch.arange(after + 1, stop, device=self.device)

    def propose(self, context: DraftContext) -> Proposal:
        return Proposal(self, self.pending, self.acceptance)

    def rows(self, position: int, drafted: int) -> list[tuple[int, torch.Tensor]]:
        lengths = range(drafted, -1, -1) if self.predraft else [drafted]
        return [(length, m) for length in lengths if (m := self.mask_positions(position + length)).numel() > 1]

    def rows_gain(self, drafted: int) -> float:
        """What its masks draft for the next round is expected to commit there; a single chain of masks (not
        `predraft`) drafts only when all `drafted` drafts are accepted."""
        reached = 1.0 if self.predraft or not drafted else chances(drafted, self.acceptance)[-1]
        return reached * expected_tokens(self.draft_length, self.acceptance)

    def observe(self, verdict: Verdict) -> None:
        ours = verdict.proposal.drafter is self
        if ours and (drafted := verdict.proposal.drafts.tokens.numel()):
            self.acceptance.record(drafted, verdict.accepted)
        logits = verdict.rows if ours else None
        if logits is None:
            self.pending = Drafts.none(self.device)
            return
        drafts = draft_tokens_from_masks(logits, self.temperature, self.generator)
        self.pending = confident_drafts(drafts, logits, self.threshold).on_host()
