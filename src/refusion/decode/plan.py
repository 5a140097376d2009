"""Plan step (ALGORITHM.md §3.1): draft every masked slot of the block and select the slots to infill."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Plan:
    """Drafts of the masked slots of a block and the selected ones."""

    drafts: torch.Tensor
    """[n_slots, k] drafted tokens (argmax, Gumbel-noised when temperature > 0)."""
    confidence: torch.Tensor
    """[n_slots, k] softmax probability of each drafted token under the un-noised logits."""
    selected: torch.Tensor
    """[m] indices of the selected slots, ascending (position order)."""

    @property
    def scores(self) -> torch.Tensor:
        """[n_slots] slot score = confidence of the slot's first token."""
        return self.confidence[:, 0]


def gumbel_noise(shape, generator: torch.Generator, device) -> torch.Tensor:
    """Standard Gumbel noise in float64, drawn from `generator` (on its own device) and moved to `device`."""
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device=generator.device)
    return (-torch.log(-torch.log(u.clamp_min(1e-300)))).to(device)


def draft_tokens(logits: torch.Tensor, temperature: float, generator: torch.Generator | None):
    """Draft a token at every masked position. logits: [n, V] -> (tokens [n], confidence [n]).

    Confidence is the softmax probability of the drafted token under the un-noised logits, computed as
    exp(logit - logsumexp) in float32 (no full softmax tensor is materialised)."""
    logits = logits.float()
    if temperature > 0:
        noisy = logits.double() / temperature + gumbel_noise(logits.shape, generator, logits.device)
        tokens = noisy.argmax(-1)
    else:
        tokens = logits.argmax(-1)
    confidence = (logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)).exp()
    return tokens, confidence


def select_slots(scores: torch.Tensor, slot_threshold: float) -> torch.Tensor:
    """Every slot whose score exceeds the threshold; if none does, the single best slot. Ascending."""
    selected = (scores > slot_threshold).nonzero().flatten()
    if selected.numel() == 0:
        selected = scores.argmax().reshape(1)
    return selected


def plan_slots(mask_logits: torch.Tensor, slot_size: int, slot_threshold: float, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> Plan:
    """mask_logits: [n_slots * k, V], the logits at the masked positions of the block, in position order."""
    tokens, confidence = draft_tokens(mask_logits, temperature, generator)
    drafts = tokens.view(-1, slot_size)  # [n_slots, k]
    confidence = confidence.view(-1, slot_size)
    return Plan(drafts, confidence, select_slots(confidence[:, 0], slot_threshold))
