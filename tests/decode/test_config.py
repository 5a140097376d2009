"""DecodeConfig validation, presets and round trips; bad input fails before any forward pass."""

import dataclasses

import pytest
import torch

import refusion
from refusion.config import PRESETS, DecodeConfig
from refusion.model.tiny import tiny_model


@pytest.mark.parametrize("field,value,words", [
    ("slot_size", 0, "slot_size=0"),
    ("block_size", 12, "multiple of slot_size=8"),
    ("block_size", 0, "block_size=0"),
    ("slot_threshold", 1.5, "[0, 1]"),
    ("token_threshold", -0.1, "[0, 1]"),
    ("max_new_tokens", 0, ">= 1"),
    ("temperature", -1.0, ">= 0"),
    ("strategy", "beam", "refusion, speculative, autoregressive"),
    ("kv_cache", "sometimes", "reuse, recompute"),
])
def test_invalid_field_names_field_and_allowed_values(field, value, words):
    with pytest.raises(ValueError) as err:
        DecodeConfig(**{field: value})
    assert field in str(err.value) and words in str(err.value)


def test_canvas_rounds_up_to_whole_slots():
    assert DecodeConfig(max_new_tokens=10, slot_size=4, block_size=8).canvas_length == 12
    assert DecodeConfig(max_new_tokens=8, slot_size=4, block_size=8).canvas_length == 8


def test_round_trip_and_every_preset_is_valid():
    cfg = DecodeConfig(max_new_tokens=64, slot_size=4, block_size=16, eos_token_id=[2, 3])
    assert DecodeConfig(**cfg.to_dict()) == cfg
    for name in PRESETS:  # each preset is a valid config that keeps every value it names
        settings = refusion.preset(name)
        assert dataclasses.asdict(DecodeConfig(**settings)).items() >= settings.items()
    settings["slot_size"] = -1  # preset() hands out a copy
    assert refusion.preset(name) != settings
    with pytest.raises(ValueError, match="unknown"):
        refusion.preset("nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.slot_size = 2


# The paper's settings (docs/DECODING.md, "Settings"), copied by hand: (slot_threshold, token_threshold, slot_size, block_size)
PAPER_SETTINGS = {"mmlu_pro": (0.9, 0.4, 16, 128), "arc_challenge": (0.8, 0.1, 8, 8), "gsm8k": (0.9, 0.4, 32, 128),
                  "math": (0.8, 0.6, 32, 64), "gpqa": (0.8, 0.2, 8, 16), "humaneval": (0.9, 0.4, 32, 128),
                  "mbpp": (0.9, 0.3, 32, 128), "demo": (0.6, 0.3, 4, 16)}


@pytest.mark.parametrize("name", sorted(PAPER_SETTINGS))
def test_presets_are_the_papers_settings(name):
    cfg = DecodeConfig(**refusion.preset(name))
    assert (cfg.slot_threshold, cfg.token_threshold, cfg.slot_size, cfg.block_size) == PAPER_SETTINGS[name]


class ForwardCounter(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.generation_config = model, model.config, model.generation_config
        self.calls = 0

    def get_input_embeddings(self):
        return self.inner.get_input_embeddings()

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


@pytest.mark.parametrize("prompts,settings,words", [
    ([[]], {}, "prompt 0 is empty"),
    ([[1, 2], [1, 999]], {}, "prompt 1 holds token ids outside"),
    ([[1] * 1000], {"max_new_tokens": 100}, "exceeds the model's context of 1024"),
    ("hello", {}, "tokenize text first"),
    ([[1, 2]], {"mask_token_id": 500}, "outside the model's vocabulary"),
])
def test_bad_input_raises_before_any_forward(prompts, settings, words):
    model = ForwardCounter(tiny_model())
    with pytest.raises(ValueError, match=words):
        refusion.generate(model, prompts, **settings)
    assert model.calls == 0


def test_model_without_mask_token_gets_a_clear_error():
    model = tiny_model()
    model.config.mask_token_id = None
    with pytest.raises(ValueError, match="mask_token_id is unknown"):
        refusion.generate(model, [[1, 2]])
    assert refusion.generate(model, [[1, 2]], strategy="autoregressive", max_new_tokens=3).sequences
