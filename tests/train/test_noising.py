"""Batch construction (docs/TRAINING.md, steps 1-4 of the objective): properties over many random draws, and a hand-built case."""

from __future__ import annotations

import pytest
import torch

from refusion.train.noising import (
    IGNORE_INDEX,
    arrange_slots,
    build_ar_sample,
    build_hybrid_sample,
    collate,
    draw_mask_probability,
)

MASK, EOS = 63, 2


def _sample(seed, prompt_len=5, response_len=23, slot_sizes=(4, 8, 16, 32), **kw):
    prompt = torch.arange(100, 100 + prompt_len)
    response = torch.arange(200, 200 + response_len)
    g = torch.Generator().manual_seed(seed)
    return prompt, response, build_hybrid_sample(prompt, response, slot_sizes=slot_sizes, mask_token_id=MASK,
                                                 generator=g, **kw)


@pytest.mark.parametrize("seed", range(60))
def test_construction_properties(seed):
    response_len = 1 + seed % 37
    prompt, response, s = _sample(seed, response_len=response_len)
    P, R, k = prompt.numel(), response.numel(), s.slot_size
    assert k in (4, 8, 16, 32) and 1e-3 <= s.p_mask <= 1.0 and s.response_length == R
    assert s.input_ids.shape == s.position_ids.shape == s.labels.shape == s.is_masked.shape == (P + R,)
    # prompt first, in order, unlabelled
    assert torch.equal(s.input_ids[:P], prompt) and torch.equal(s.position_ids[:P], torch.arange(P))
    assert (s.labels[:P] == IGNORE_INDEX).all() and not s.is_masked[:P].any()
    pos, inp, lab, msk = s.position_ids[P:] - P, s.input_ids[P:], s.labels[P:], s.is_masked[P:]
    # each response token appears exactly once: as itself (clean) or as a mask labelled with it
    assert sorted(pos.tolist()) == list(range(R))
    assert torch.equal(torch.where(msk, lab, inp), response[pos])
    assert (inp[msk] == MASK).all() and not (inp[~msk] == MASK).any()
    # whole slots are masked or clean; clean slots come first, masked slots after in original order
    slot = pos // k
    for j in slot.unique():
        assert msk[slot == j].all() or not msk[slot == j].any()
    n_clean = int((~msk).sum())
    assert not msk[:n_clean].any() and msk[n_clean:].all()
    assert torch.equal(pos[n_clean:], pos[n_clean:].sort().values)
    # each clean slot is contiguous in the buffer and intact (consecutive positions, in order)
    clean_slots = slot[:n_clean]
    starts = [i for i in range(n_clean) if i == 0 or clean_slots[i] != clean_slots[i - 1]]
    assert len(starts) == len(clean_slots.unique())
    for a, b in zip(starts, starts[1:] + [n_clean], strict=False):
        j = int(clean_slots[a])
        assert torch.equal(pos[a:b], torch.arange(j * k, min((j + 1) * k, R)))
    # labels: clean -> next token of the same slot (last token of a slot ignored); masked -> own token
    for i in range(R):
        p = int(pos[i])
        if msk[i]:
            assert lab[i] == response[p]
        elif p + 1 < R and (p + 1) // k == p // k:
            assert lab[i] == response[p + 1]
        else:
            assert lab[i] == IGNORE_INDEX


def test_hand_built_layout():
    # response of 7 tokens, k = 3: slots [0,1,2] [3,4,5] [6]; slot 1 masked; clean order: slot 2, slot 0
    prompt, response = torch.tensor([10, 11]), torch.tensor([20, 21, 22, 23, 24, 25, 2])
    s = arrange_slots(prompt, response, slot_size=3, slot_is_masked=torch.tensor([False, True, False]),
                      slot_order=torch.tensor([2, 0, 1]), mask_token_id=MASK, p_mask=0.5)
    X = IGNORE_INDEX
    assert s.input_ids.tolist() == [10, 11, 2, 20, 21, 22, MASK, MASK, MASK]
    assert s.position_ids.tolist() == [0, 1, 8, 2, 3, 4, 5, 6, 7]
    assert s.labels.tolist() == [X, X, X, 21, 22, X, 23, 24, 25]
    assert s.is_masked.tolist() == [False] * 6 + [True] * 3


def test_same_generator_state_same_sample_and_seeds_differ():
    a, b, c = (_sample(seed, response_len=40, slot_sizes=(4,))[2] for seed in (7, 7, 8))
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
    assert a.p_mask == b.p_mask
    assert not (torch.equal(a.input_ids, c.input_ids) and torch.equal(a.position_ids, c.position_ids))


def test_mask_probability_formula_and_slot_size_set():
    g = torch.Generator().manual_seed(3)
    t = torch.rand((), generator=torch.Generator().manual_seed(3)).item()
    assert draw_mask_probability(g) == pytest.approx((1 - 1e-3) * t + 1e-3, abs=1e-12)
    sizes = {_sample(s, slot_sizes=(2, 5))[2].slot_size for s in range(40)}
    assert sizes == {2, 5}
    # p_mask spans (0, 1]: both all-clean and all-masked samples occur
    fractions = [float(_sample(s, response_len=40, slot_sizes=(4,))[2].is_masked.float().mean()) for s in range(200)]
    assert min(fractions) < 0.2 and max(fractions) > 0.8


def test_eos_slots_are_masked_and_labelled_eos():
    prompt, response, s = _sample(1, response_len=10, slot_sizes=(4,), eos_slots=2, eos_token_id=EOS)
    P, R = 5, 10
    tail = s.position_ids >= P + R
    assert int(tail.sum()) == 8 and s.response_length == R
    assert (s.input_ids[tail] == MASK).all() and (s.labels[tail] == EOS).all() and s.is_masked[tail].all()
    assert torch.equal(s.position_ids[-8:], torch.arange(P + R, P + R + 8))  # last, in order
    with pytest.raises(ValueError, match="eos_token_id"):
        _sample(1, eos_slots=1)


def test_ar_sample_is_plain_next_token():
    # standard fine-tuning: the last prompt token predicts the first response token, so every response
    # token (EOS included) is a target exactly once
    s = build_ar_sample(torch.tensor([10, 11]), torch.tensor([20, 21, 2]))
    assert s.input_ids.tolist() == [10, 11, 20, 21, 2]
    assert s.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert s.labels.tolist() == [-100, 20, 21, 2, -100] and not s.is_masked.any()


def test_ar_sample_without_prompt_has_no_target_for_its_first_token():
    s = build_ar_sample(torch.tensor([], dtype=torch.long), torch.tensor([20, 21, 2]))
    assert s.labels.tolist() == [21, 2, -100]


def test_collate_pads_right_with_continuing_positions():
    a, b = _sample(0, response_len=4)[2], _sample(1, response_len=9)[2]
    batch = collate([a, b], pad_token_id=0)
    assert batch["input_ids"].shape == (2, 14)
    assert batch["input_ids"][0, 9:].eq(0).all() and batch["labels"][0, 9:].eq(IGNORE_INDEX).all()
    assert batch["position_ids"][0, 9:].tolist() == list(range(9, 14))
    assert not batch["is_masked"][0, 9:].any()
    assert batch["p_mask"].tolist() == pytest.approx([a.p_mask, b.p_mask])
    assert batch["response_length"].tolist() == [4, 9] and int(batch["num_tokens"]) == 23
