"""Compiled forwards (`refusion.model.compiled`): the same tokens as eager decoding, over a few graphs.

The default suite traces with torch.compile's "aot_eager" backend (the graphs inductor would compile, run by eager
kernels: seconds); the slow test compiles with inductor itself. tests/decode/test_cuda.py replays them as CUDA
graphs where a GPU is lent."""

from __future__ import annotations

import random

import pytest
import torch
from torch._dynamo.utils import counters

import refusion
from refusion.cli import main
from refusion.decode.reference import reference_generate
from refusion.model.compiled import (
    CAPACITY_STEP,
    WIDTH_BUCKETS,
    bucket_width,
    compile_model,
    static_capacity,
)
from refusion.model.setup import setup_of
from refusion.model.tiny import TINY_MASK_ID, tiny_model

CFG = refusion.DecodeConfig(max_new_tokens=20, slot_size=4, block_size=8, slot_threshold=0.5, token_threshold=0.3,
                            eos_token_id=[2])
STRATEGIES = ["refusion", "autoregressive", "speculative"]


def ragged_prompts(seed: int, count: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 60) for _ in range(rng.randint(1, 12))] for _ in range(count)]


def compiled_setup(model, backend: str = "aot_eager"):
    return setup_of(model).replace(compiled=compile_model(model, backend=backend))


def test_width_buckets_and_capacity_steps():
    assert [bucket_width(w) for w in (1, 2, 3, 5, 8, 9, 64)] == [1, 2, 4, 8, 8, 16, 64]
    assert bucket_width(WIDTH_BUCKETS[-1] + 1) is None  # prompts wider than every bucket run eager
    assert [static_capacity(n) for n in (1, CAPACITY_STEP, CAPACITY_STEP + 1)] == [CAPACITY_STEP, CAPACITY_STEP,
                                                                                    2 * CAPACITY_STEP]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_compiled_decoding_gives_the_eager_tokens(arch, strategy):
    model = tiny_model(arch, dtype=torch.float32, seed=2)
    cfg = CFG.replace(strategy=strategy)
    prompts = ragged_prompts(3)
    eager = refusion.generate(model, prompts, cfg)
    compiled = refusion.generate(model, prompts, cfg, setup=compiled_setup(model))
    assert compiled.sequences == eager.sequences
    assert compiled.stats.batch.forwards == eager.stats.batch.forwards  # padding to a bucket adds no forward


def test_compiled_plan_and_infill_matches_the_cache_free_reference():
    model = tiny_model("qwen3", dtype=torch.float64)
    setup = compiled_setup(model)
    for seed in range(3):
        prompts = ragged_prompts(seed)
        out = refusion.generate(model, prompts, CFG, setup=setup)
        for prompt, sequence in zip(prompts, out.sequences):
            assert sequence == reference_generate(model, prompt, CFG, TINY_MASK_ID, [2])


def test_a_decode_reuses_its_graphs_and_a_second_request_compiles_nothing():
    model = tiny_model("qwen3", dtype=torch.float32, seed=5, hidden_size=48)  # shapes no other test compiles
    setup = compiled_setup(model)
    cfg = CFG.for_strategy("autoregressive").replace(eos_token_id=[])  # every forward one token wide
    counters["stats"].clear()
    refusion.generate(model, [[5, 6, 7]], cfg, setup=setup)
    # the prompt's forward (3 tokens, bucket 4) and one graph for the 19 one-token forwards: nothing recompiles
    assert counters["stats"]["unique_graphs"] == 2
    refusion.generate(model, [[9, 8, 7, 6]], cfg, setup=setup)  # another prompt, the same bucket and capacity step
    assert counters["stats"]["unique_graphs"] == 2


def test_the_setup_says_it_is_compiled():
    model = tiny_model("qwen3")
    assert "compiled" in compiled_setup(model).describe() and "compiled" not in setup_of(model).describe()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_inductor_compiled_decoding_gives_the_eager_tokens(strategy):
    model = tiny_model("qwen3", dtype=torch.float32, seed=2)
    cfg = CFG.replace(strategy=strategy)
    prompts = ragged_prompts(4)
    compiled = refusion.generate(model, prompts, cfg, setup=compiled_setup(model, backend="inductor"))
    assert compiled.sequences == refusion.generate(model, prompts, cfg).sequences


@pytest.mark.slow
def test_generate_with_the_compile_flag(tiny_model_dir, capsys):
    args = ["generate", "what is 2+2?", "--model", tiny_model_dir, "--max-new-tokens", "8", "--dtype", "float32",
            "--strategy", "autoregressive", "--json"]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main(args + ["--compile"]) == 0
    assert capsys.readouterr().out.split('"stats"')[0] == eager.split('"stats"')[0]
