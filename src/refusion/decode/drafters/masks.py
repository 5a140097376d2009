"""Drafts from mask tokens: chains of masks ride on each verify forward, and their logits draft the tokens after
what the forward accepts (`DecodeConfig.draft_length`, `predraft`, `draft_threshold`; docs/DECODING.md, "The exact
mode")."""

from __future__ import annotations

import torch

from refusion.decode.acceptance import AcceptanceByDepth, chances, expected_tokens
from refusion.decode.drafters.base import DraftContext, Drafter, Proposal, Verdict
from refusion.decode.infill import accepted_prefix
from refusion.decode.sampling import PositionNoise, decided_tokens
from refusion.decode.speculate import Drafts


def draft_tokens_from_masks(mask_logits: torch.Tensor, temperature: float, noise: PositionNoise | None,
                            start: int) -> Drafts:
    """[d, V] logits at the masks of positions start .. start + d - 1 -> drafts: the argmax at temperature 0, else the
    Gumbel-max sample of softmax(l / T) with each position's own noise, the noise AR decoding's sample there will
    use (so a draft is accepted whenever the masks' distribution and AR's agree on where that noise points)."""
    return Drafts(decided_tokens(mask_logits, temperature, noise, start))


def confident_drafts(drafts: Drafts, mask_logits: torch.Tensor, threshold: float, temperature: float) -> Drafts:
    """The drafts before the first mask whose draft distribution (softmax of the [d, V] `mask_logits` they were
    drafted from, divided by the temperature when > 0) peaks below `threshold`. Verifying fewer drafts never changes
    what is committed, only how fast."""
    if threshold <= 0 or drafts.tokens.numel() == 0:
        return drafts
    logits = mask_logits.float() / temperature if temperature > 0 else mask_logits.float()
    return drafts[: int(accepted_prefix(torch.softmax(logits, -1).amax(-1) >= threshold).sum())]


class MaskDrafter(Drafter):
    """A chain of `draft_length` + 1 masks after the drafts (`predraft`: one per possible acceptance length, each
    reading exactly the accepted prefix); the first mask stands for the token AR decoding gives after the accepted
    drafts and drafts nothing, the others draft the tokens after it. Its drafts are the ones read back from the last
    forward it rode on."""

    name = "masks"

    def __init__(self, draft_length: int, end: int, predraft: bool = False, threshold: float = 0.0,
                 temperature: float = 0.0, noise: PositionNoise | None = None, device="cpu"):
        self.draft_length, self.end, self.predraft, self.threshold = draft_length, end, predraft, threshold
        self.temperature, self.noise, self.device = temperature, noise, device
        self.pending = Drafts.none(device)  # read from the last forward's masks
        self.acceptance = AcceptanceByDepth()  # of its chains, in this sequence

    @staticmethod
    def for_sequence(seq) -> MaskDrafter | None:
        """The sequence's masks (None: `cfg.draft_length` is 0)."""
        cfg = seq.cfg
        if not cfg.draft_length:
            return None
        return MaskDrafter(cfg.draft_length, seq.prompt_length + cfg.max_new_tokens, cfg.predraft,
                           cfg.draft_threshold, cfg.temperature, seq.noise, seq.device)

    def mask_positions(self, after: int) -> torch.Tensor:
        """Positions of the masks that draft the tokens after position `after` + 1 (the first mask stands for the
        token the AR logits give at `after` + 1), up to the end of the response."""
        stop = max(after + 1, min(after + 2 + self.draft_length, self.end))
        return torch.arange(after + 1, stop, device=self.device)

    def propose(self, context: DraftContext) -> Proposal:
        return Proposal(self, self.pending, tuple(chances(self.pending.tokens.numel(), self.acceptance)))

    def rows(self, position: int, drafted: int) -> list[tuple[int, torch.Tensor]]:
        lengths = range(drafted, -1, -1) if self.predraft else [drafted]
        return [(length, m) for length in lengths if (m := self.mask_positions(position + length)).numel() > 1]

    def rows_gain(self, drafted: int) -> float:
        """What its masks draft for the next round is expected to commit there; a single chain of masks (not
        `predraft`) drafts only when all `drafted` drafts are accepted."""
        reached = 1.0 if self.predraft or not drafted else chances(drafted, self.acceptance)[-1]
        return reached * expected_tokens(self.draft_length, self.acceptance)

    def bound(self, room: int, batch: int) -> tuple[int, float]:
        """Up to `draft_length` drafts, each worth at most the first's chance, and its chains of masks (one per
        acceptance length with `predraft`), each of at most `draft_length` + 1 masks and at least 2, which together
        are worth `rows_gain`: at most `expected_tokens` of a whole chain."""
        drafts, chain = min(self.draft_length, room), self.draft_length + 1
        rows = drafts + chain * (drafts + 1 if self.predraft else 1)
        return rows, max(self.acceptance.rate(1), expected_tokens(self.draft_length, self.acceptance) / 2)

    def observe(self, verdict: Verdict) -> None:
        ours = verdict.proposal.drafter is self
        if ours and (drafted := verdict.proposal.drafts.tokens.numel()):
            self.acceptance.record(drafted, verdict.accepted)
        logits = verdict.rows if ours else None
        if logits is None:
            self.pending = Drafts.none(self.device)
            return
        drafts = draft_tokens_from_masks(logits, self.temperature, self.noise, verdict.rows_start)
        self.pending = confident_drafts(drafts, logits, self.threshold, self.temperature).on_host()
