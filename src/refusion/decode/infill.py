"""Infill step (docs/DECODING.md, paper §3.2-3.4): verify drafts autoregressively, fast accept, parallel completion.

Pure functions on small tensors; the plan-and-infill program (`programs/plan_and_infill.py`) strings them together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def shifted_token_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """AR probability of each token given everything before it in the same forward.

    logits, tokens: [..., T, V] and [..., T]. Token j reads the logits at j-1; token 0 reads its own
    logits (a value never used: the first token of a slot or window is always accepted).
    """
    logits = logits.float()
    width = logits.shape[-2]
    log_norm = torch.logsumexp(logits[..., :max(width - 1, 1), :], dim=-1)  # the last row is never read
    source = torch.cat([logits[..., :1, :].gather(-1, tokens[..., :1, None]),  # token 0: its own logits
                        logits[..., :-1, :].gather(-1, tokens[..., 1:, None])], dim=-2).squeeze(-1)  # j: at j-1
    norm = torch.cat([log_norm[..., :1], log_norm[..., :width - 1]], dim=-1)
    return (source - norm).exp()


def accepted_prefix(accept: torch.Tensor) -> torch.Tensor:
    """Cumulative product of accepts along the last dim: 1 up to the first rejection, 0 after."""
    return torch.cumprod(accept.long(), dim=-1)


@dataclass(frozen=True)
class Verification:
    """Result of the global verification of the selected drafts (§3.2)."""

    slot_accepted: torch.Tensor
    """[m, k] per-slot accepted prefix (0/1)."""
    prefix_length: int
    """l: length of the accepted prefix over the whole concatenation of selected drafts."""


def verify_selected(first_confidence: torch.Tensor, ar_probs: torch.Tensor, token_threshold: float) -> Verification:
    """first_confidence: [m] planning confidence of each slot's first token (always accepted);
    ar_probs: [m, k] shifted AR probabilities of the drafts from the verification forward."""
    probs = ar_probs.clone()
    probs[:, 0] = first_confidence
    accept = probs > token_threshold
    accept[:, 0] = True
    return Verification(accepted_prefix(accept), int(accepted_prefix(accept.flatten()).sum()))


@dataclass(frozen=True)
class FastAccept:
    """Slots committed straight from the global verification (§3.3)."""

    n_slots: int
    """How many of the selected slots (in order) are committed."""
    last_length: int
    """Tokens kept of the last committed slot (k, or up to and including EOS)."""
    eos: bool
    """Whether the last committed slot holds the first EOS."""


def fast_accept(drafts: torch.Tensor, prefix_length: int, is_eos: torch.Tensor) -> FastAccept | None:
    """drafts, is_eos: [m, k] selected drafts and their EOS flags. None when nothing can be fast-accepted."""
    k = drafts.shape[1]
    eos_in_prefix = is_eos.flatten()[:prefix_length].nonzero()
    if eos_in_prefix.numel():
        first = int(eos_in_prefix[0])
        return FastAccept(first // k + 1, first % k + 1, True)
    if prefix_length >= k:
        return FastAccept(prefix_length // k, k, False)
    return None


def force_progress(accept: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """Force-accept every position whose left neighbour in the row was already accepted (and the first).

    accept, previous: [rows, w] (window of each row). Guarantees each row gains a token per iteration.
    """
    left_accepted = F.pad(previous, (1, 0), value=1)[:, :-1].bool()
    return accept | left_accepted


def shared_advance(window_accepted: torch.Tensor, all_done: bool) -> int:
    """How far the rows' shared cached prefix moves: the smallest per-row accepted count in the window,
    minus one while some position is unaccepted (the next window then starts with an accepted token)."""
    smallest = int(window_accepted.sum(1).min())
    return smallest if all_done else smallest - 1


def cut_after_first_eos(is_eos: torch.Tensor) -> torch.Tensor:
    """Keep-mask over a flat sequence: every token up to and including the first EOS."""
    is_eos = is_eos.long()
    return (torch.cumsum(is_eos, 0) - is_eos) == 0
