"""The hybrid loss (docs/TRAINING.md, step 5 of the objective): exact value on a hand-built example, edge cases, the module."""

from __future__ import annotations

import math

import pytest
import torch

from refusion.model.tiny import tiny_model
from refusion.train.loss import HybridObjective, hybrid_loss, select_labelled
from refusion.train.noising import arrange_slots, build_hybrid_sample, collate

L2, L3 = math.log(2), math.log(3)


def _hand_built():
    # V = 3. Sample 0 (p_mask 0.5, R 4): one AR target, one masked token. Sample 1 (p_mask 0.25, R 2): same.
    logits = torch.tensor([[0.0, 0, 0], [L2, 0, 0], [0, L3, 0], [0, 0, 0]])
    targets = torch.tensor([0, 0, 1, 2])
    is_masked = torch.tensor([False, True, False, True])
    weight = torch.tensor([1 / (0.5 * 4), 1 / (0.5 * 4), 1 / (0.25 * 2), 1 / (0.25 * 2)])
    return logits, targets, is_masked, weight


def test_exact_loss_on_hand_built_example():
    parts = hybrid_loss(*_hand_built(), num_samples=2)
    # CE: AR ln3 (uniform) and ln(5/3); masked ln2 (p = 2/4) and ln3 (uniform)
    expected_ar = (L3 + math.log(5 / 3)) / 2
    expected_mdm = (L2 / (0.5 * 4) + L3 / (0.25 * 2)) / 2
    assert parts.loss_ar.item() == pytest.approx(expected_ar, rel=1e-6)
    assert parts.loss_mdm.item() == pytest.approx(expected_mdm, rel=1e-6)
    assert parts.loss.item() == pytest.approx(expected_ar + expected_mdm, rel=1e-6)
    assert (parts.num_ar.item(), parts.num_mdm.item()) == (2, 2)
    half = hybrid_loss(*_hand_built(), num_samples=2, mdm_weight=0.5)
    assert half.loss.item() == pytest.approx(expected_ar + 0.5 * expected_mdm, rel=1e-6)


def test_weights_come_from_each_samples_mask_weight():
    batch = {"labels": torch.tensor([[-100, 5, 6], [7, -100, -100]]), "is_masked": torch.tensor([[0, 0, 1], [1, 0, 0]]).bool(),
             "mask_weight": 1 / torch.tensor([0.5 * 4.0, 0.1 * 10.0])}
    selection, targets, is_masked, weight = select_labelled(batch)
    assert targets.tolist() == [5, 6, 7] and is_masked.tolist() == [False, True, True]
    assert weight.tolist() == pytest.approx([0.5, 0.5, 1.0])


@pytest.mark.parametrize("keep", ["ar_only", "mdm_only", "nothing"])
def test_no_nan_without_ar_targets_or_masked_tokens(keep):
    logits, targets, is_masked, weight = _hand_built()
    logits.requires_grad_(True)
    rows = {"ar_only": ~is_masked, "mdm_only": is_masked, "nothing": torch.zeros(4, dtype=torch.bool)}[keep]
    parts = hybrid_loss(logits[rows], targets[rows], is_masked[rows], weight[rows], num_samples=2)
    for value in (parts.loss, parts.loss_ar, parts.loss_mdm):
        assert torch.isfinite(value)
    assert (parts.loss_ar.item() == 0) == (keep != "ar_only")
    assert (parts.loss_mdm.item() == 0) == (keep != "mdm_only")
    parts.loss.backward()
    assert torch.isfinite(logits.grad).all()


def _batch(seed=0, n=3):
    g = torch.Generator().manual_seed(seed)
    samples = [build_hybrid_sample(torch.arange(3, 9), torch.randint(4, 60, (10 + 7 * i,), generator=g),
                                   slot_sizes=(4,), mask_token_id=63, generator=g) for i in range(n)]
    return collate(samples, pad_token_id=0)


def test_logits_on_labels_gives_the_same_loss_as_full_logits():
    model = tiny_model()
    batch = _batch()
    a = HybridObjective(model, logits_on_labels=True)(batch)
    b = HybridObjective(model, logits_on_labels=False)(batch)
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.loss_mdm, b.loss_mdm, rtol=1e-5, atol=1e-5)


def test_attention_is_causal_over_the_whole_buffer():
    # Permuted position ids must not be read as several packed sequences: a change in an earlier slot must
    # reach later slots, and a change later must not reach earlier entries.
    objective = HybridObjective(tiny_model(), logits_on_labels=False)
    sample = arrange_slots(torch.arange(3, 9), torch.arange(20, 36), slot_size=4,
                           slot_is_masked=torch.tensor([False, False, False, True]),
                           slot_order=torch.tensor([2, 0, 1, 3]), mask_token_id=63)
    batch = collate([sample], pad_token_id=0)
    assert batch["position_ids"][0, 6:].tolist() == [*range(14, 18), *range(6, 14), *range(18, 22)]
    all_rows = torch.ones_like(batch["labels"], dtype=torch.bool)
    base = objective.labelled_logits(batch, all_rows)
    for i in (6, 9, 13):  # slot starts and ends next to position-id jumps
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        changed["input_ids"][0, i] = 5 if changed["input_ids"][0, i] != 5 else 6
        logits = objective.labelled_logits(changed, all_rows)
        assert torch.equal(logits[:i], base[:i])
        assert not torch.allclose(logits[i + 1:], base[i + 1:])


def test_gradient_reaches_the_model():
    model = tiny_model()
    HybridObjective(model)(_batch()).loss.backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0
    assert model.lm_head.weight.grad.abs().sum() > 0
