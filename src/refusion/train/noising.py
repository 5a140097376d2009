"""Batch construction of the hybrid objective: slots, masking, permutation, labels (docs/TRAINING.md, steps 1-4 of the objective).

Pure functions of token ids and an explicit `torch.Generator`: the same generator state gives the same
sample. `build_hybrid_sample` draws the random choices (slot size k, mask probability, which slots are
masked, the order of the clean slots) and `arrange_slots` lays out the buffer:

    prompt | clean slots in random order | masked slots in original order | padding (added by `collate`)

Every token keeps its position id in the correctly ordered text. Labels: prompt -> ignored; a clean token
-> the next token of its own slot (a slot's last token is ignored); a masked token -> its own token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
MASK_PROBABILITY_EPS = 1e-3


@dataclass(frozen=True)
class NoisedSample:
    """One training sample, tensors of length L = prompt + response (+ EOS slots), in buffer order."""

    input_ids: torch.Tensor
    """[L] prompt, then clean-slot tokens, then <|mask|> for every masked position."""
    position_ids: torch.Tensor
    """[L] each token's position in the correctly ordered text."""
    labels: torch.Tensor
    """[L] target of each buffer entry, IGNORE_INDEX where there is none."""
    is_masked: torch.Tensor
    """[L] bool, True at masked positions (their labels feed L_MDM; the other labels feed L_AR)."""
    p_mask: float
    """Probability with which each slot of this sample was masked."""
    response_length: int
    """Response tokens including EOS (not counting EOS slots): the MDM weight is 1 / (p_mask * this)."""
    slot_size: int
    """k of this sample."""


# 1. random choices ----------------------------------------------------------------------------------------

def draw_slot_size(slot_sizes: Sequence[int], generator: torch.Generator) -> int:
    """k drawn uniformly from `slot_sizes`."""
    return int(slot_sizes[torch.randint(len(slot_sizes), (1,), generator=generator).item()])


def draw_mask_probability(generator: torch.Generator, eps: float = MASK_PROBABILITY_EPS) -> float:
    """p_mask = (1 - eps) * t + eps with t ~ U(0, 1)."""
    t = torch.rand((), generator=generator).item()
    return (1.0 - eps) * t + eps


def draw_slot_masks(num_slots: int, p_mask: float, generator: torch.Generator) -> torch.Tensor:
    """[num_slots] bool: each slot masked independently with probability p_mask."""
    return torch.rand(num_slots, generator=generator) < p_mask


def order_slots(slot_is_masked: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """[num_slots] slot indices in buffer order: the clean slots shuffled, then the masked ones in order."""
    clean = torch.nonzero(~slot_is_masked).flatten()
    masked = torch.nonzero(slot_is_masked).flatten()
    shuffled = clean[torch.randperm(clean.numel(), generator=generator)]
    return torch.cat([shuffled, masked])


# 2. layout ------------------------------------------------------------------------------------------------

def arrange_slots(prompt_ids: torch.Tensor, response_ids: torch.Tensor, *, slot_size: int,
                  slot_is_masked: torch.Tensor, slot_order: torch.Tensor, mask_token_id: int,
                  eos_slots: int = 0, eos_token_id: int | None = None, p_mask: float = 1.0) -> NoisedSample:
    """Lay out prompt + slots in buffer order with positions and labels (deterministic, vectorized).

    `slot_is_masked` and `slot_order` cover the response slots plus `eos_slots` trailing slots of k EOS
    tokens each (always masked, labelled EOS).
    """
    k, P, R = slot_size, prompt_ids.numel(), response_ids.numel()
    n_response_slots = -(-R // k)
    if eos_slots:
        if eos_token_id is None:
            raise ValueError("eos_slots > 0 needs eos_token_id")
        response_ids = torch.cat([response_ids, response_ids.new_full((eos_slots * k,), eos_token_id)])
    index = torch.arange(response_ids.numel())
    offset = torch.where(index < R, index % k, (index - R) % k)                          # within its slot
    slot_of = torch.where(index < R, index // k, n_response_slots + (index - R).clamp(min=0) // k)
    is_last_in_slot = (offset == k - 1) | (index == R - 1)
    masked = slot_is_masked[slot_of]                                                      # [R']
    next_token = torch.cat([response_ids[1:], response_ids.new_full((1,), IGNORE_INDEX)])
    labels = torch.where(masked, response_ids, torch.where(is_last_in_slot, IGNORE_INDEX, next_token))
    inputs = torch.where(masked, torch.full_like(response_ids, mask_token_id), response_ids)
    rank_of_slot = torch.empty_like(slot_order)
    rank_of_slot[slot_order] = torch.arange(slot_order.numel())
    buffer_order = torch.argsort(rank_of_slot[slot_of] * k + offset)                      # [R'] stable keys
    return NoisedSample(
        input_ids=torch.cat([prompt_ids, inputs[buffer_order]]),
        position_ids=torch.cat([torch.arange(P), P + index[buffer_order]]),
        labels=torch.cat([torch.full((P,), IGNORE_INDEX), labels[buffer_order]]),
        is_masked=torch.cat([torch.zeros(P, dtype=torch.bool), masked[buffer_order]]),
        p_mask=p_mask, response_length=R, slot_size=k,
    )


# 3. one sample --------------------------------------------------------------------------------------------

def build_hybrid_sample(prompt_ids: torch.Tensor, response_ids: torch.Tensor, *, slot_sizes: Sequence[int],
                        mask_token_id: int, generator: torch.Generator, eos_slots: int = 0,
                        eos_token_id: int | None = None) -> NoisedSample:
    """docs/TRAINING.md, steps 1-4 of the objective for one (prompt, response + EOS) pair."""
    k = draw_slot_size(slot_sizes, generator)
    p_mask = draw_mask_probability(generator)
    n_slots = -(-response_ids.numel() // k)
    slot_is_masked = torch.cat([draw_slot_masks(n_slots, p_mask, generator), torch.ones(eos_slots, dtype=torch.bool)])
    slot_order = order_slots(slot_is_masked, generator)
    return arrange_slots(prompt_ids, response_ids, slot_size=k, slot_is_masked=slot_is_masked,
                         slot_order=slot_order, mask_token_id=mask_token_id, eos_slots=eos_slots,
                         eos_token_id=eos_token_id, p_mask=p_mask)


def build_ar_sample(prompt_ids: torch.Tensor, response_ids: torch.Tensor) -> NoisedSample:
    """Plain next-token fine-tuning sample (the baseline objective): the last prompt token predicts the
    first response token, and each response token the next one, so every response token is a target."""
    R = response_ids.numel()
    sample = arrange_slots(prompt_ids, response_ids, slot_size=R, slot_is_masked=torch.zeros(1, dtype=torch.bool),
                           slot_order=torch.zeros(1, dtype=torch.long), mask_token_id=-1)
    P = prompt_ids.numel()
    if P and R:
        sample.labels[P - 1] = response_ids[0]
    return sample


# 4. batch -------------------------------------------------------------------------------------------------

def collate(samples: Sequence[NoisedSample], *, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad samples to one batch; padding is ignored and its position ids continue after the end."""
    length = max(s.input_ids.numel() for s in samples)
    batch = {
        "input_ids": torch.full((len(samples), length), pad_token_id, dtype=torch.long),
        "position_ids": torch.arange(length).repeat(len(samples), 1),
        "labels": torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long),
        "is_masked": torch.zeros((len(samples), length), dtype=torch.bool),
    }
    for row, s in enumerate(samples):
        n = s.input_ids.numel()
        batch["input_ids"][row, :n] = s.input_ids
        batch["position_ids"][row, :n] = s.position_ids
        batch["position_ids"][row, n:] = torch.arange(n, length)
        batch["labels"][row, :n] = s.labels
        batch["is_masked"][row, :n] = s.is_masked
    batch["p_mask"] = torch.tensor([s.p_mask for s in samples], dtype=torch.float32)
    batch["response_length"] = torch.tensor([s.response_length for s in samples], dtype=torch.float32)
    batch["num_tokens"] = torch.tensor(sum(s.input_ids.numel() for s in samples))
    return batch
