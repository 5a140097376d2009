"""The exact mode's verification: drafts (`Drafts`, from any drafter of `decode/drafters/`), accepted by the model's
own AR predictions (`accept_drafts`).

Pure functions on small tensors; `programs/speculative.py` strings them together. A draft is accepted while it equals
the token AR decoding gives at its position: the argmax (greedy), or at temperature > 0 the Gumbel-max sample with
that position's own noise (`sampling.PositionNoise`). That sample is AR sampling's at the same seed, so the output
is AR decoding's token for token at every temperature, whatever the drafts are (they change only how many tokens a
forward commits).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from refusion.decode.plan import greedy
from refusion.decode.sampling import PositionNoise, sampling_scores


@dataclass(frozen=True)
class Drafts:
    """Drafted tokens (the tokens after a round's next token, in position order)."""

    tokens: torch.Tensor
    """[d] drafted tokens, in position order."""
    ids: tuple[int, ...] | None = None
    """The tokens on the host, where known (copied drafts; drafts from masks once `on_host` read them back)."""

    @staticmethod
    def none(device) -> Drafts:
        return Drafts(torch.empty(0, dtype=torch.long, device=device), ())

    def __getitem__(self, index: slice) -> Drafts:
        return Drafts(self.tokens[index], None if self.ids is None else self.ids[index])

    def on_host(self) -> Drafts:
        """These drafts with their tokens on the host (read back once, if they were not)."""
        return self if self.ids is not None else replace(self, ids=tuple(self.tokens.tolist()))


def copied_drafts(tokens: list[int], device) -> Drafts:
    """Drafts copied from the text (prompt lookup, the draft table): their ids are known on the host."""
    return Drafts(torch.tensor(tokens, dtype=torch.long, device=device), tuple(tokens))


class Acceptance(NamedTuple):
    """What AR decoding makes of a round's drafts."""

    accepted: int
    """How many drafts it accepts (a prefix)."""
    following: torch.Tensor
    """[1] the token it gives after the last accepted draft (the next round's first token)."""
    following_id: int
    """That token on the host."""


def accept_drafts(drafts: Drafts, ar_logits: torch.Tensor, temperature: float = 0.0,
                  noise: PositionNoise | None = None, start: int = 0) -> Acceptance:
    """How many drafts AR decoding accepts, and the token that follows the last accepted one.

    ar_logits: [d + 1, V], row i the AR logits at the position before draft i (row d: after the last draft); row i
    decides position `start` + i. The token AR decoding gives there is the argmax (temperature 0) or the Gumbel-max
    sample with that position's `noise` (`sampling.sampling_scores`). The predictions are read back once and
    compared on the host (the drafts' ids: `Drafts.on_host`).
    """
    n = drafts.tokens.numel()
    predicted = greedy(sampling_scores(ar_logits, temperature, noise, start))  # [d + 1]
    if not n:  # nothing drafted: the next token's
        return Acceptance(0, predicted, int(predicted))
    predicted_ids, draft_ids = predicted.tolist(), drafts.on_host().ids
    accepted = next((i for i, (d, p) in enumerate(zip(draft_ids, predicted_ids)) if d != p), n)
    return Acceptance(accepted, predicted[accepted: accepted + 1], predicted_ids[accepted])
