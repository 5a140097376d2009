"""Plan step (docs/DECODING.md, paper §3.1): draft every masked slot of the block and select the slots to infill."""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch


@dataclass(frozen=True)
class Plan:
    """Drafts of the masked slots of a block and the selected ones."""

    drafts: torch.Tensor
    """[n_slots, k] drafted tokens (argmax, Gumbel-noised when temperature > 0)."""
    scores: torch.Tensor
    """[n_slots] slot score: softmax probability of the slot's first draft under the un-noised logits (the only
    confidence a round reads: it selects the slot and, selected, accepts its first token)."""
    selected: torch.Tensor
    """[m] indices of the selected slots, ascending (position order)."""


def gumbel_noise(shape, generator: torch.Generator, device) -> torch.Tensor:
    """Standard Gumbel noise in float32 drawn from `generator`, on the generator's device (the logits'
    device when the generator was made for it, as `loop.sequence_generator` does)."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32, device=generator.device)
    tiny = torch.finfo(torch.float32).tiny
    return (-torch.log(-torch.log(u.clamp(tiny, 1.0 - 1e-7)))).to(device, non_blocking=True)


def token_confidence(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """[n, V], [n] -> [n]: the softmax probability of each token under its row's logits, computed as
    exp(logit - logsumexp) in float32 (no full softmax tensor is materialised)."""
    logits = logits.float()
    return (logits.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(logits, -1)).exp()


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...]: the index of the largest logit, the first one on ties (and the first NaN, as torch's max
    reduction gives it). On the CPU numpy's argmax takes it, over fp32 (bf16 and fp16 logits converted, exactly):
    torch's reductions with an index along a 49k vocabulary took ~130 µs a row on E5 (max; argmax ~65), numpy's ~10,
    so a step of 8 sequences of the embedded model spent ~1 ms choosing its tokens. Elsewhere a max reduction."""
    if logits.device.type != "cpu" or logits.requires_grad:
        return logits.max(-1).indices
    values = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    return torch.from_numpy(numpy.asarray(values.numpy().argmax(-1)))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """[..., V] -> [..., 1]: argmax at temperature 0, else a Gumbel-max sample from softmax(logits / T)."""
    if temperature <= 0:
        return greedy(logits).unsqueeze(-1)
    noisy = logits.float() / temperature + gumbel_noise(logits.shape, generator, logits.device)
    return greedy(noisy).unsqueeze(-1)


def select_slots(scores: torch.Tensor, slot_threshold: float) -> torch.Tensor:
    """Every slot whose score exceeds the threshold; if none does, the single best slot. Ascending."""
    selected = (scores > slot_threshold).nonzero().flatten()
    if selected.numel() == 0:
        selected = scores.argmax().reshape(1)
    return selected


def plan_slots(mask_logits: torch.Tensor, slot_size: int, slot_threshold: float, temperature: float = 0.0,
               generator: torch.Generator | None = None) -> Plan:
    """mask_logits: [n_slots * k, V], the logits at the masked positions of the block, in position order. Every
    position is drafted; only each slot's first position is normalised (its score: the rest are never read)."""
    logits = mask_logits.float()
    drafts = next_token(logits, temperature, generator).view(-1, slot_size)  # [n_slots, k]
    first_logits = logits.view(drafts.shape[0], slot_size, -1)[:, 0].contiguous()  # [n_slots, V]
    scores = token_confidence(first_logits, drafts[:, 0])
    return Plan(drafts, scores, select_slots(scores, slot_threshold))
