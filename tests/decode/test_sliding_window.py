"""Sliding-window attention is honoured: a query at position q reads a key at position p only if q - p < window
(transformers' rule), on every layer that has a window (Mistral: all; Qwen2 with `max_window_layers`: some)."""

import random

import pytest
import torch

import refusion
from refusion.decode.cache import SlotCache, attention_windows
from refusion.decode.reference import reference_generate
from refusion.model.tiny import TINY_MASK_ID, tiny_model

from .test_parity import random_settings

WINDOW = 4
PROMPTS = [[1, 5, 7, 9, 11, 13], [1, 3, 4, 5, 6, 7, 8, 10, 11], [9], [12, 13, 14, 15, 16]]


def windowed(arch: str, dtype=torch.float32):
    """A tiny model whose window is shorter than its prompts and responses."""
    if arch == "mistral":
        return tiny_model("mistral", dtype=dtype, sliding_window=WINDOW)
    # Qwen2: layer 0 full attention, layer 1 a sliding window (the two kinds of mask in one forward)
    return tiny_model("qwen2", dtype=dtype, sliding_window=WINDOW, use_sliding_window=True, max_window_layers=1)


def greedy(model, prompt, max_new_tokens):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


class WindowedOracle(torch.nn.Module):
    """The model with the window applied to the explicit masks the reference decoder passes (by position ids,
    written independently of the engine); on Qwen2 only the sliding layers get the window."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.dtype = model, model.config, model.dtype

    def forward(self, input_ids, position_ids, attention_mask, use_cache=False):
        near = position_ids[:, :, None] - position_ids[:, None, :] < WINDOW  # [B, query, key]
        sliding = attention_mask & near[:, None]
        layer_types = getattr(self.config, "layer_types", None)
        mask = sliding if layer_types is None else {"full_attention": attention_mask, "sliding_attention": sliding}
        return self.inner(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False)


def test_the_window_changes_the_model():
    """Guard: without this the tests below could not fail."""
    prompt = PROMPTS[1]
    assert greedy(windowed("mistral"), prompt, 16) != greedy(tiny_model("mistral"), prompt, 16)
    assert greedy(windowed("qwen2"), prompt, 16) != greedy(tiny_model("qwen2"), prompt, 16)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_autoregressive_equals_transformers_greedy(arch, attn):
    model = windowed(arch)
    model.config._attn_implementation = attn
    expected = [greedy(model, p, 16) for p in PROMPTS]
    out = refusion.generate(model, PROMPTS, max_new_tokens=16, strategy="autoregressive", eos_token_id=2)
    assert out.sequences == expected
    # alone, one token per forward over a hole-free context (the path that passes no mask without a window)
    alone = refusion.generate(model, PROMPTS[1:2], max_new_tokens=16, strategy="autoregressive", eos_token_id=2)
    assert alone.sequences == expected[1:2]


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
@pytest.mark.parametrize("predraft", [False, True])
def test_speculative_equals_autoregressive(arch, predraft):
    model = windowed(arch)
    ar = refusion.generate(model, PROMPTS, max_new_tokens=16, strategy="autoregressive", eos_token_id=2).sequences
    for draft_length in (2, 5):
        out = refusion.generate(model, PROMPTS, max_new_tokens=16, strategy="speculative", draft_length=draft_length,
                                predraft=predraft, eos_token_id=2)
        assert out.sequences == ar, draft_length


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_refusion_equals_the_windowed_reference(arch):
    rng = random.Random(arch)
    model = windowed(arch, torch.float64)
    oracle = WindowedOracle(model)
    for _ in range(8):
        cfg = refusion.DecodeConfig(**random_settings(rng))
        eos = [cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else cfg.eos_token_id
        prompts = [[rng.randint(3, 60) for _ in range(rng.randint(1, 12))] for _ in range(2)]
        out = refusion.generate(model, prompts, cfg)
        for prompt, sequence in zip(prompts, out.sequences):
            assert sequence == reference_generate(oracle, prompt, cfg, TINY_MASK_ID, eos), (cfg, prompt)


def test_layer_windows_come_from_the_config():
    assert attention_windows(windowed("mistral").config) == {"sliding_attention": WINDOW}
    assert attention_windows(windowed("qwen2").config) == {"full_attention": None, "sliding_attention": WINDOW}
    assert attention_windows(tiny_model("qwen3").config) == {"full_attention": None}
    assert attention_windows(tiny_model("llama").config) == {"full_attention": None}


def test_mixed_layers_get_one_mask_per_kind():
    cache = SlotCache(2, "cpu", capacity=8, windows={"full_attention": None, "sliding_attention": 2})
    cache.add_sequence(0)
    masks = cache.begin_forward(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])
    assert set(masks) == {"full_attention", "sliding_attention"}
    assert masks["full_attention"][0, 0].long().tolist() == torch.ones(4, 4).tril().long().tolist()
    assert masks["sliding_attention"][0, 0].long().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_unsupported_layer_kinds_are_refused_up_front():
    model = tiny_model("qwen3")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        refusion.generate(model, [[1, 5, 7]], max_new_tokens=4, strategy="autoregressive")
