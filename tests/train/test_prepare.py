"""add_mask_token: a base model gains <|mask|> with the mean embedding; a prepared model is left alone."""

from __future__ import annotations

import pytest
import torch

from refusion.model.prepare import MASK_TOKEN, add_mask_token
from refusion.model.tiny import TINY_MASK_ID, tiny_model, tiny_tokenizer


def _base_model(vocab_size=64):
    model = tiny_model(vocab_size=vocab_size)
    del model.config.mask_token_id
    return model


@pytest.mark.parametrize("vocab_size", [64, 63])  # a spare embedding row, and a model that must grow
def test_adds_mask_with_mean_row(vocab_size):
    model, tokenizer = _base_model(vocab_size), tiny_tokenizer(with_mask=False)
    before_in = model.get_input_embeddings().weight.detach().clone()
    before_out = model.get_output_embeddings().weight.detach().clone()
    mask_id = add_mask_token(model, tokenizer)
    assert mask_id == TINY_MASK_ID == model.config.mask_token_id
    assert tokenizer.convert_tokens_to_ids(MASK_TOKEN) == mask_id and MASK_TOKEN in tokenizer.all_special_tokens
    assert tokenizer("a<|mask|>b", add_special_tokens=False).input_ids[1] == mask_id
    emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.shape[0] == out.shape[0] == 64
    torch.testing.assert_close(emb[mask_id], before_in[:63].mean(0))
    torch.testing.assert_close(out[mask_id], before_out[:63].mean(0))
    torch.testing.assert_close(emb[:63], before_in[:63])  # other rows untouched


def test_model_with_mask_is_left_unchanged():
    model, tokenizer = tiny_model(), tiny_tokenizer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert add_mask_token(model, tokenizer) == TINY_MASK_ID
    assert len(tokenizer) == 64
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_disagreeing_tokenizer_is_an_error():
    model, tokenizer = tiny_model(), tiny_tokenizer()
    model.config.mask_token_id = 5
    with pytest.raises(ValueError, match="mask_token_id=5"):
        add_mask_token(model, tokenizer)


def test_mask_id_survives_save_and_load(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    model, tokenizer = _base_model(), tiny_tokenizer(with_mask=False)
    mask_id = add_mask_token(model, tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert AutoConfig.from_pretrained(tmp_path).mask_token_id == mask_id
    assert AutoTokenizer.from_pretrained(tmp_path).convert_tokens_to_ids(MASK_TOKEN) == mask_id
