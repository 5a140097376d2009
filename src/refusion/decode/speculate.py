"""The exact mode's verification: drafts (`Drafts`, from any drafter of `decode/drafters/`), accepted by the model's
own AR predictions (`accept_drafts`).

Pure functions on small tensors; `programs/speculative.py` strings them together. Greedy decoding
accepts a draft while it equals the AR argmax; at temperature > 0 the speculative-sampling rule (accept x
with probability min(1, p(x) / q(x)), else resample from the normalised max(0, p - q)) makes the output
follow AR sampling's distribution exactly, whatever the drafts are.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from refusion.decode.plan import greedy


@dataclass(frozen=True)
class Drafts:
    """Drafted tokens and the distribution each was drawn from."""

    tokens: torch.Tensor
    """[d] drafted tokens, in position order."""
    probs: torch.Tensor | None
    """[d, V] the draft distribution q of each token (None when drafted greedily)."""
    ids: tuple[int, ...] | None = None
    """The tokens on the host, where known (copied drafts; drafts from masks once `on_host` read them back)."""

    @staticmethod
    def none(device) -> Drafts:
        return Drafts(torch.empty(0, dtype=torch.long, device=device), None, ())

    def __getitem__(self, index: slice) -> Drafts:
        return Drafts(self.tokens[index], None if self.probs is None else self.probs[index],
                      None if self.ids is None else self.ids[index])

    def on_host(self) -> Drafts:
        """These drafts with their tokens on the host (read back once, if they were not)."""
        return self if self.ids is not None else replace(self, ids=tuple(self.tokens.tolist()))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] probabilities -> [..., 1] one sample per row, from `generator`."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(*probs.shape[:-1], 1)


def copied_drafts(tokens: list[int], vocab_size: int, temperature: float, device) -> Drafts:
    """Drafts copied from the text: drawn with certainty, so at temperature > 0 their draft distribution is
    one-hot (accepted with probability p(x), resampled from p without x otherwise: still exact)."""
    ids = torch.tensor(tokens, dtype=torch.long, device=device)
    if temperature <= 0:
        return Drafts(ids, None, tuple(tokens))
    return Drafts(ids, torch.nn.functional.one_hot(ids, vocab_size).float(), tuple(tokens))


class Acceptance(NamedTuple):
    """What AR decoding makes of a round's drafts."""

    accepted: int
    """How many drafts it accepts (a prefix)."""
    following: torch.Tensor
    """[1] the token it gives after the last accepted draft (the next round's first token)."""
    following_id: int
    """That token on the host."""


def accept_drafts(drafts: Drafts, ar_logits: torch.Tensor, temperature: float,
                  generator: torch.Generator | None) -> Acceptance:
    """How many drafts AR decoding accepts, and the token that follows the last accepted one.

    ar_logits: [d + 1, V], row i the AR logits at the position before draft i (row d: after the last draft).
    Greedy, the AR predictions are read back once and compared on the host (the drafts' ids: `Drafts.on_host`).
    """
    n = drafts.tokens.numel()
    if temperature <= 0:
        predicted = greedy(ar_logits)  # [d + 1]
        predicted_ids, draft_ids = predicted.tolist(), drafts.on_host().ids
        accepted = next((i for i, (d, p) in enumerate(zip(draft_ids, predicted_ids)) if d != p), n)
        return Acceptance(accepted, predicted[accepted: accepted + 1], predicted_ids[accepted])
    target = torch.softmax(ar_logits.float() / temperature, -1)  # [d + 1, V]
    if n == 0:
        return sampled(0, sample(target[0], generator))
    if drafts.probs is None:
        raise ValueError("drafts at temperature > 0 need their draft distribution")
    rows = torch.arange(n, device=ar_logits.device)
    p = target[rows, drafts.tokens]
    q = drafts.probs[rows, drafts.tokens]
    u = torch.rand(n, generator=generator, device=ar_logits.device)
    rejected = (u * q >= p).nonzero()  # u < p / q accepts (q > 0: the draft was drawn from q)
    if rejected.numel() == 0:
        return sampled(n, sample(target[n], generator))
    i = int(rejected[0])
    residual = (target[i] - drafts.probs[i]).clamp_min(0)
    if float(residual.sum()) <= 0:  # p == q: a rejection cannot happen in exact arithmetic
        residual = target[i]
    return sampled(i, sample(residual / residual.sum(), generator))


def sampled(accepted: int, following: torch.Tensor) -> Acceptance:
    """The acceptance of a sampled round: `following` [1] drawn on the device, read back."""
    following = following.reshape(1)
    return Acceptance(accepted, following, int(following))
