"""Rank truncation of a LoRA adapter (`adapter.truncate_rank`): the best approximation of each update, folded scaling."""

from __future__ import annotations

import pytest
import torch

from refusion.model.adapter import truncate_rank

KEY = "base_model.model.model.layers.0.mlp.up_proj.lora_{}.weight"


def adapter(rank: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tensors = {KEY.format("A"): torch.randn(rank, 12, generator=g), KEY.format("B"): torch.randn(20, rank, generator=g),
               "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": torch.randn(1, 12, generator=g)}
    return tensors, {"r": rank, "lora_alpha": 2 * rank, "use_rslora": False}


def update(tensors, config):
    scaling = config["lora_alpha"] / config["r"]
    return scaling * tensors[KEY.format("B")] @ tensors[KEY.format("A")]


def test_full_rank_keeps_the_update_and_a_cut_is_the_best_approximation():
    tensors, config = adapter()
    full = update(tensors, config)
    same, same_config = truncate_rank(tensors, config, 6)
    torch.testing.assert_close(update(same, same_config), full, rtol=1e-4, atol=1e-4)
    cut, cut_config = truncate_rank(tensors, config, 2)
    assert cut_config["r"] == cut_config["lora_alpha"] == 2 and cut[KEY.format("A")].shape == (2, 12)
    singular = torch.linalg.svdvals(full)
    error = torch.linalg.matrix_norm(update(cut, cut_config) - full)  # Frobenius: the tail singular values
    assert error.item() == pytest.approx(singular[2:].square().sum().sqrt().item(), rel=1e-4)
    key = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
    assert torch.equal(cut[key], tensors[key])  # the mask row is not a low-rank pair


@pytest.mark.parametrize("rank, message", [(0, "must be an integer >= 1"), (7, "above the adapter's rank 6"),
                                           (2.0, "must be an integer >= 1")])
def test_bad_ranks_are_refused(rank, message):
    tensors, config = adapter()
    with pytest.raises(ValueError, match=message):
        truncate_rank(tensors, config, rank)
    with pytest.raises(ValueError, match="one rank and alpha"):
        truncate_rank(tensors, {**config, "rank_pattern": {"up_proj": 2}}, 2)
