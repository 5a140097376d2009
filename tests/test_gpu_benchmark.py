"""benchmarks/gpu.py on the CPU with its small configuration: every measurement it reports on a GPU is there."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def load_benchmark():
    if str(BENCHMARK.parent) not in sys.path:  # as `python benchmarks/gpu.py` runs it: its folder's harness
        sys.path.insert(0, str(BENCHMARK.parent))
    spec = importlib.util.spec_from_file_location("gpu_benchmark", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_benchmark_runs_on_the_cpu_and_ends_with_one_json_line(capsys):
    summary = load_benchmark().main(["--config", "small", "--device", "cpu", "--prompts", "1", "--max-new-tokens",
                                     "6", "--prompt-length", "12", "--widths", "1,8", "--repeats", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == json.loads(json.dumps(summary))
    results = summary["results"]
    assert set(results["forward_by_width"]["ms"]) == {1, 8} and results["forward_by_width"]["relative_to_one_token"][1] == 1
    for mode in ("autoregressive", "plan_and_infill", "exact"):
        r = results[f"refusion_{mode}"]
        assert r["tokens"] == 6 and 0 <= r["outside_model_fraction"] < 1 and r["compiled"] is False
    assert results["refusion_autoregressive"]["tokens_per_forward"] == 1
    assert "transformers_generate" in results and "transformers_generate_compiled" not in results  # CPU: off
    assert summary["speed_over_refusion_ar"]["refusion_autoregressive"] == 1


def test_without_the_eager_decodes_only_the_forwards_are_timed(capsys):
    summary = load_benchmark().main(["--config", "small", "--device", "cpu", "--prompts", "1", "--max-new-tokens",
                                     "6", "--prompt-length", "12", "--widths", "1,8", "--repeats", "1", "--no-eager"])
    assert list(summary["results"]) == ["forward_by_width"] and summary["speed_over_refusion_ar"] == {}
