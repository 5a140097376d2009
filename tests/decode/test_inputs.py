"""Input forms: a padded (B, P) tensor with its attention_mask decodes as the ragged list it pads; a bad mask is a
clear error; `Decoder.add` at temperature > 0 without a generator seeds the sequence with seed + index."""

import pytest
import torch

import refusion
from refusion.decode.loop import Decoder
from refusion.model.tiny import TINY_MASK_ID, tiny_model

PROMPTS = [[1, 5, 7, 9], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9]]
PAD = 0
SETTINGS = dict(slot_size=2, block_size=4, slot_threshold=0.3, token_threshold=0.2)  # varied output on this model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


def padded(prompts, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) as a tokenizer pads a batch."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        cols = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, cols], mask[row, cols] = torch.tensor(prompt), 1
    return ids, mask


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("strategy", ["refusion", "autoregressive"])
def test_a_padded_tensor_decodes_as_the_ragged_list(model, side, strategy):
    cfg = refusion.DecodeConfig(max_new_tokens=12, strategy=strategy, eos_token_id=2, **SETTINGS)
    expected = refusion.generate(model, PROMPTS, cfg).sequences
    ids, mask = padded(PROMPTS, side)
    assert refusion.generate(model, ids, cfg, attention_mask=mask).sequences == expected
    # the pad ids are not prompt text: without the mask a padded batch is refused, not decoded as text
    with pytest.raises(ValueError, match=f"row 0 starts or ends with the pad id {PAD}.*attention_mask"):
        refusion.generate(model, ids, cfg)


def test_a_boolean_or_one_row_mask_is_accepted(model):
    ids, mask = padded(PROMPTS[:1], "left")
    expected = refusion.generate(model, PROMPTS[:1], max_new_tokens=8, eos_token_id=2).sequences
    assert refusion.generate(model, ids[0], attention_mask=mask[0].bool(), max_new_tokens=8,
                             eos_token_id=2).sequences == expected


def test_a_mismatched_attention_mask_is_a_clear_error(model):
    ids, mask = padded(PROMPTS, "left")
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 8\), input_ids \(3, 9\)"):
        refusion.generate(model, ids, attention_mask=mask[:, 1:], max_new_tokens=4)
    with pytest.raises(ValueError, match="attention_mask is only for a padded"):
        refusion.generate(model, PROMPTS, attention_mask=mask, max_new_tokens=4)


@pytest.mark.parametrize("strategy", ["refusion", "speculative", "autoregressive"])
def test_decoder_add_samples_without_a_generator_seeded_by_index(model, strategy):
    cfg = refusion.DecodeConfig(max_new_tokens=12, strategy=strategy, temperature=1.0, seed=5, eos_token_id=[],
                                **SETTINGS)
    expected = refusion.generate(model, PROMPTS, cfg).sequences
    decoder = Decoder(model)
    seqs = {i: decoder.add(PROMPTS[i], cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[], index=i) for i in (2, 0)}
    decoder.run()
    assert {i: s.response() for i, s in seqs.items()} == {2: expected[2], 0: expected[0]}
    assert expected[0] != refusion.generate(model, PROMPTS[:1], cfg.replace(seed=6)).sequences[0]  # the seed matters


def test_decoder_add_samples_at_random_without_a_seed(model):
    cfg = refusion.DecodeConfig(max_new_tokens=8, temperature=1.0, seed=None, eos_token_id=[])
    decoder = Decoder(model)
    seq = decoder.add(PROMPTS[0], cfg, mask_token_id=TINY_MASK_ID, eos_token_ids=[])
    decoder.run()
    assert len(seq.response()) == 8


def test_a_model_in_training_decodes_in_eval_mode_and_is_given_back_training():
    model = tiny_model("llama", seed=2)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5  # dropout that would change the tokens if it ran
    cfg = refusion.DecodeConfig(max_new_tokens=8, strategy="autoregressive", eos_token_id=[])
    expected = refusion.generate(model, PROMPTS, cfg).sequences
    assert not any(m.training for m in model.modules())  # an eval model is left as it was
    model.train()
    assert refusion.generate(model, PROMPTS, cfg).sequences == expected
    assert all(m.training for m in model.modules())
