"""The guarantees of docs/DECODING.md on a CUDA device: the same checks as on the CPU, with the model and every
tensor of the decode on the GPU. Skipped where torch sees no GPU (CI); run them wherever one is lent."""

from __future__ import annotations

import random

import pytest
import torch

import refusion
from refusion.decode.cache import CHECK_ENV
from refusion.decode.reference import reference_generate
from refusion.model.compiled import compile_model
from refusion.model.setup import setup_of
from refusion.model.tiny import TINY_MASK_ID, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(autouse=True)
def check_the_cache(monkeypatch):
    """The cache's invariant is checked on every commit here too (on a GPU it is off by default)."""
    monkeypatch.setenv(CHECK_ENV, "1")

CFG = refusion.DecodeConfig(max_new_tokens=24, slot_size=4, block_size=8, slot_threshold=0.5, token_threshold=0.3,
                            eos_token_id=[2])


def on_gpu(arch: str, dtype: torch.dtype, seed: int = 0):
    return tiny_model(arch, dtype=dtype, seed=seed).to("cuda")


def random_prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 60) for _ in range(rng.randint(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_plan_and_infill_matches_the_cache_free_reference_on_the_gpu(arch):
    model = on_gpu(arch, torch.float64)
    for seed in range(4):
        prompts = random_prompts(seed)
        out = refusion.generate(model, prompts, CFG)
        for prompt, sequence in zip(prompts, out.sequences):
            assert sequence == reference_generate(model, prompt, CFG, TINY_MASK_ID, [2]), prompt


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_exact_mode_is_autoregressive_decoding_and_transformers_greedy_on_the_gpu(arch):
    model = on_gpu(arch, torch.float64)
    ar = CFG.replace(strategy="autoregressive", eos_token_id=[])
    exact = ar.replace(strategy="speculative", draft_length=4)
    for prompt in random_prompts(7, count=4):
        greedy = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=ar.max_new_tokens,
                                min_new_tokens=ar.max_new_tokens, do_sample=False, pad_token_id=0)
        expected = greedy[0, len(prompt):].tolist()
        assert refusion.generate(model, [prompt], ar).sequences[0] == expected
        assert refusion.generate(model, [prompt], exact).sequences[0] == expected


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("strategy", ["refusion", "autoregressive", "speculative"])
def test_batch_equals_alone_on_the_gpu(strategy, dtype):
    model = on_gpu("qwen3", dtype, seed=2)
    cfg = CFG.replace(strategy=strategy)
    prompts = random_prompts(11, count=4)
    batched = refusion.generate(model, prompts, cfg).sequences
    assert batched == [refusion.generate(model, [p], cfg).sequences[0] for p in prompts]


def test_bf16_decoding_is_deterministic_on_the_gpu():
    model = on_gpu("qwen3", torch.bfloat16, seed=2)
    prompts = random_prompts(13, count=4)
    first = refusion.generate(model, prompts, CFG)
    assert refusion.generate(model, prompts, CFG).sequences == first.sequences
    assert first.stats.batch.tokens > 0


@pytest.mark.parametrize("strategy", ["refusion", "autoregressive", "speculative"])
def test_the_unchecked_cache_decodes_the_same_tokens_on_the_gpu(strategy, monkeypatch):
    """What a GPU runs by default (no invariant check, commits by the host's counts) = the checked cache."""
    model = on_gpu("qwen3", torch.float32, seed=2)
    cfg = CFG.replace(strategy=strategy)
    prompts = random_prompts(19, count=3)
    checked = refusion.generate(model, prompts, cfg).sequences
    monkeypatch.delenv(CHECK_ENV)
    assert refusion.generate(model, prompts, cfg).sequences == checked


@pytest.mark.parametrize("strategy", ["refusion", "autoregressive", "speculative"])
def test_compiled_forwards_replayed_as_cuda_graphs_decode_the_same_tokens(strategy):
    model = on_gpu("qwen3", torch.float32, seed=2)
    setup = setup_of(model).replace(compiled=compile_model(model, backend="cudagraphs"))
    cfg = CFG.replace(strategy=strategy)
    prompts = random_prompts(17, count=3)
    assert (refusion.generate(model, prompts, cfg, setup=setup).sequences
            == refusion.generate(model, prompts, cfg).sequences)
