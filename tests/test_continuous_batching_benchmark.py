"""benchmarks/continuous_batching.py's lockstep: strategies' batches stepped in turn in one process decode exactly what
each decodes alone, step for step, so their ratio is timed on the same work."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from refusion.model.tiny import tiny_model

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "continuous_batching.py"
COUNTS = ("tokens", "drafted", "accepted", "steps", "prefill_steps")


def load_benchmark():
    if str(BENCHMARK.parent) not in sys.path:  # as `python benchmarks/continuous_batching.py` runs it
        sys.path.insert(0, str(BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("continuous_batching_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lockstep_runs_decode_what_each_strategy_decodes_alone():
    benchmark = load_benchmark()
    model = tiny_model("qwen3", dtype=torch.float32, seed=3)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (n,), generator=generator).tolist() for n in (5, 9, 7, 12, 6)]
    strategies = ["autoregressive", "speculative"]
    together = benchmark.run_lockstep(model, prompts, 2, strategies, 12)
    for strategy in strategies:
        alone = benchmark.run_batch(model, prompts, 2, strategy, 12)
        assert {k: together[strategy][k] for k in COUNTS} == {k: alone[k] for k in COUNTS}
        assert together[strategy]["tokens"] > 2 * len(prompts) and together[strategy]["tokens_per_second"] > 0
    assert together["speculative"]["tokens"] == together["autoregressive"]["tokens"]  # AR's answers
