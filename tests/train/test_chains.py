"""Draft-chain samples (docs/TRAINING.md, "Draft chains"): layout, attention, and that one forward over many chains
gives each chain's logits as if it had been decoded after its own prefix alone."""

from __future__ import annotations

import pytest
import torch

from refusion.model.tiny import tiny_model
from refusion.train.batching import BatchRecipe, MicroBatchStream
from refusion.train.data import TokenizedData
from refusion.train.loss import HybridObjective, select_labelled
from refusion.train.noising import (
    IGNORE_INDEX,
    arrange_chains,
    build_chain_sample,
    build_hybrid_sample,
    collate,
)

MASK, PAD, EOS = 63, 0, 2


def test_hand_built_chains():
    # prompt [10, 11], response [20, 21, 22, 2]; chains of 3 masks starting at response indices 0 and 2
    s = arrange_chains(torch.tensor([10, 11]), torch.tensor([20, 21, 22, 2]), starts=torch.tensor([0, 2]),
                       chain_masks=3, mask_token_id=MASK)
    X = IGNORE_INDEX
    assert s.input_ids.tolist() == [10, 11, 20, 21, 22, 2, MASK, MASK, MASK, MASK, MASK]
    assert s.position_ids.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 4, 5]  # the second chain stops at the end
    assert s.labels.tolist() == [X] * 6 + [20, 21, 22, 22, 2]
    assert s.is_masked.tolist() == [False] * 6 + [True] * 5
    assert s.chain.tolist() == [0] * 6 + [1, 1, 1, 2, 2]
    assert s.reads_upto.tolist() == [1, 2, 3, 4, 5, 6, 2, 2, 2, 4, 4]
    assert s.mask_weight == pytest.approx(1 / 5)
    visible = collate([s], pad_token_id=PAD)["attention_mask"][0, 0].int().tolist()
    assert visible[1] == [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]   # text: causal
    assert visible[7] == [1, 1, 0, 0, 0, 0, 1, 1, 0, 0, 0]   # chain 1: the prompt, its own masks up to itself
    assert visible[10] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 1]  # chain 2: the text before response index 2


@pytest.mark.parametrize("seed", range(20))
def test_chain_sample_properties(seed):
    g = torch.Generator().manual_seed(seed)
    R, stride, m = 1 + seed * 3, 1 + seed % 5, 1 + seed % 7
    prompt, response = torch.arange(100, 105), torch.arange(200, 200 + R)
    s = build_chain_sample(prompt, response, chain_masks=m, stride=stride, mask_token_id=MASK, generator=g)
    text = 5 + R
    masks = s.is_masked.nonzero().flatten()
    assert (masks >= text).all() and (s.input_ids[masks] == MASK).all()
    index = s.position_ids[masks] - 5
    assert (index < R).all() and torch.equal(s.labels[masks], response[index])  # each mask labelled with its token
    starts = sorted({int(s.reads_upto[i]) - 5 for i in masks})
    assert all(b - a == stride for a, b in zip(starts, starts[1:], strict=False))
    assert starts[0] < stride and (not starts or R - starts[-1] <= stride)  # every stride-th prefix, to the end


def test_one_forward_over_chains_equals_each_chain_alone():
    torch.manual_seed(0)
    model = tiny_model("qwen3", vocab_size=64).eval()
    prompt, response = torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12, 13, 14, 2])
    s = arrange_chains(prompt, response, starts=torch.tensor([0, 3, 6]), chain_masks=3, mask_token_id=MASK)
    hybrid = build_hybrid_sample(prompt, response, slot_sizes=(2,), mask_token_id=MASK,
                                 generator=torch.Generator().manual_seed(1))
    batch = collate([hybrid, s], pad_token_id=PAD)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
        plain = model(input_ids=batch["input_ids"][:1, : hybrid.input_ids.numel()],
                      position_ids=batch["position_ids"][:1, : hybrid.input_ids.numel()]).logits[0]
        for start in (0, 3, 6):
            rows = ((s.reads_upto == 3 + start) & s.is_masked).nonzero().flatten()
            text = torch.cat([prompt, response[:start]])
            alone = torch.cat([text, s.input_ids[rows]])
            positions = torch.cat([torch.arange(text.numel()), s.position_ids[rows]])
            expected = model(input_ids=alone[None], position_ids=positions[None]).logits[0, text.numel():]
            torch.testing.assert_close(logits[1, rows], expected, rtol=1e-5, atol=1e-5)
    # a slot sample batched beside chains keeps its causal attention
    torch.testing.assert_close(logits[0, : hybrid.input_ids.numel()], plain, rtol=1e-5, atol=1e-5)


def test_chain_loss_is_the_mean_over_masks_per_sample():
    torch.manual_seed(0)
    model = tiny_model("llama", vocab_size=64).eval()
    a = arrange_chains(torch.tensor([5, 6]), torch.tensor([8, 9, 10, 2]), starts=torch.tensor([0, 2]),
                       chain_masks=2, mask_token_id=MASK)
    b = arrange_chains(torch.tensor([7]), torch.tensor([11, 12, 2]), starts=torch.tensor([1]),
                       chain_masks=3, mask_token_id=MASK)
    batch = collate([a, b], pad_token_id=PAD)
    with torch.no_grad():
        parts = HybridObjective(model)(batch)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       attention_mask=batch["attention_mask"]).logits
    selection, targets, *_ = select_labelled(batch)
    ce = torch.nn.functional.cross_entropy(logits[selection], targets, reduction="none")
    expected = (ce[:4].mean() + ce[4:].mean()) / 2  # a has 4 masks, b 2
    assert parts.loss_mdm.item() == pytest.approx(expected.item(), rel=1e-5)
    assert parts.num_ar.item() == 0 and parts.loss_ar.item() == 0


def test_stream_mixes_chains_and_slots_by_fraction():
    data = TokenizedData([torch.arange(3, 8)] * 64, [torch.arange(10, 30)] * 64)
    recipe = BatchRecipe("hybrid", (4,), MASK, PAD, EOS, 0, chain_fraction=0.5, chain_masks=3, chain_stride=4)
    stream = MicroBatchStream(data, recipe, seed=0, batch_size=8, world_size=1, rank=0)
    chain_rows = 0
    for m in range(8):
        batch = stream[m]
        S = batch["input_ids"].shape[1]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        chain_rows += sum(not torch.equal(mask[0], causal) for mask in batch["attention_mask"])
        torch.testing.assert_close(batch["attention_mask"], stream[m]["attention_mask"])  # a pure function of m
    assert 16 <= chain_rows <= 48  # of 64 samples, about half
    plain = MicroBatchStream(data, BatchRecipe("hybrid", (4,), MASK, PAD, EOS), seed=0, batch_size=8,
                             world_size=1, rank=0)
    assert all("attention_mask" not in plain[m] for m in range(4))
