"""Batch construction of the hybrid objective: slots, masking, permutation, labels (docs/TRAINING.md, steps 1-4 of the objective).

Pure functions of token ids and an explicit `torch.Generator`: the same generator state gives the same
sample. `build_hybrid_sample` draws the random choices (slot size k, mask probability, which slots are
masked, the order of the clean slots) and `arrange_slots` lays out the buffer:

    prompt | clean slots in random order | masked slots in original order | padding (added by `collate`)

Every token keeps its position id in the correctly ordered text. Labels: prompt -> ignored; a clean token
-> the next token of its own slot (a slot's last token is ignored); a masked token -> its own token.

`build_chain_sample` lays out the other use of masks, the exact mode's drafts (docs/TRAINING.md, "Draft
chains"): the answer clean and in order, then chains of masks, each reading the text only up to its own start,
as the decoder's masks read the committed prefix:

    prompt | response, clean | chain 1 (masks) | chain 2 (masks) | ... | padding

Labels: every mask -> its own token; the text -> ignored. `collate` turns each entry's chain and the text it
may read into the batch's attention mask.
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
    mask_weight: float = 0.0
    """Weight of each masked token's cross-entropy in L_MDM: 1 / (p_mask * response_length) for slots, 1 / the
    number of masks for a chain sample (each sample's masked term is then a mean over its masks)."""
    chain: torch.Tensor | None = None
    """[L] for a chain sample: 0 for the text (prompt and response), c > 0 for the masks of chain c; None for a
    slot layout (plain causal attention)."""
    reads_upto: torch.Tensor | None = None
    """[L] for a chain sample: how many buffer entries of the text each entry may read (a text entry: itself
    and those before; a mask: the text up to its chain's start)."""


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
        p_mask=p_mask, response_length=R, slot_size=k, mask_weight=1.0 / (p_mask * max(R, 1)),
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


def chain_starts(response_length: int, *, stride: int, generator: torch.Generator) -> torch.Tensor:
    """Response indices where chains start: every `stride` tokens from a random offset in [0, stride), so that
    over many samples every prefix of the answer (the prompt alone included) gets drafted after."""
    offset = int(torch.randint(stride, (1,), generator=generator))
    return torch.arange(offset, response_length, stride)


def arrange_chains(prompt_ids: torch.Tensor, response_ids: torch.Tensor, *, starts: torch.Tensor, chain_masks: int,
                   mask_token_id: int) -> NoisedSample:
    """The text clean and in order, then one chain per start s: masks at response positions s, s+1, ... (at most
    `chain_masks`, none past the response), labelled with the tokens there and reading the text before s.

    The decoder's masks after a committed prefix are the same: the first stands for the token the AR logits give
    next, the others draft the tokens after it (docs/DECODING.md, "The exact mode")."""
    P, R = prompt_ids.numel(), response_ids.numel()
    offsets = torch.arange(chain_masks)
    index = (starts[:, None] + offsets[None, :])                                    # [C, m] response indices
    keep = (index < R).flatten()
    index = index.flatten()[keep]
    chain = torch.arange(1, starts.numel() + 1)[:, None].expand(-1, chain_masks).flatten()[keep]
    reads = (P + starts)[:, None].expand(-1, chain_masks).flatten()[keep]
    n = index.numel()
    text = P + R
    return NoisedSample(
        input_ids=torch.cat([prompt_ids, response_ids, torch.full((n,), mask_token_id, dtype=response_ids.dtype)]),
        position_ids=torch.cat([torch.arange(text), P + index]),
        labels=torch.cat([torch.full((text,), IGNORE_INDEX), response_ids[index]]),
        is_masked=torch.cat([torch.zeros(text, dtype=torch.bool), torch.ones(n, dtype=torch.bool)]),
        p_mask=1.0, response_length=R, slot_size=chain_masks, mask_weight=1.0 / max(n, 1),
        chain=torch.cat([torch.zeros(text, dtype=torch.long), chain]),
        reads_upto=torch.cat([torch.arange(1, text + 1), reads]),
    )


def build_chain_sample(prompt_ids: torch.Tensor, response_ids: torch.Tensor, *, chain_masks: int, stride: int,
                       mask_token_id: int, generator: torch.Generator) -> NoisedSample:
    """docs/TRAINING.md, "Draft chains": one (prompt, response + EOS) pair laid out for the exact mode's drafts."""
    starts = chain_starts(response_ids.numel(), stride=stride, generator=generator)
    return arrange_chains(prompt_ids, response_ids, starts=starts, chain_masks=chain_masks,
                          mask_token_id=mask_token_id)


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
    batch["mask_weight"] = torch.tensor([s.mask_weight for s in samples], dtype=torch.float32)
    batch["num_tokens"] = torch.tensor(sum(s.input_ids.numel() for s in samples))
    if any(s.chain is not None for s in samples):
        batch["attention_mask"] = chain_attention(samples, length)
    return batch


def chain_attention(samples: Sequence[NoisedSample], length: int) -> torch.Tensor:
    """[B, 1, S, S] bool: what each entry may read. A text entry (and every entry of a slot layout, and padding):
    the entries before it and itself (causal); a mask: the text up to its chain's start and the masks of its
    own chain up to itself."""
    B = len(samples)
    chain = torch.zeros(B, length, dtype=torch.long)
    reads = torch.arange(1, length + 1).repeat(B, 1)
    for row, s in enumerate(samples):
        if s.chain is not None:
            chain[row, : s.chain.numel()] = s.chain
            reads[row, : s.reads_upto.numel()] = s.reads_upto
    key = torch.arange(length)
    text_key = (chain[:, None, :] == 0) & (key[None, None, :] < reads[:, :, None])              # [B, S, S]
    same_chain = ((chain[:, :, None] == chain[:, None, :]) & (chain[:, :, None] > 0)
                  & (key[None, None, :] <= key[None, :, None]))
    return (text_key | same_chain)[:, None]
