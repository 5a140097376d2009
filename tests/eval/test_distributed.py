"""Prompts sharded over two CPU processes (torchrun, as `accelerate launch --multi_gpu` does) and merged."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """import sys
import refusion.cli as c
raise SystemExit(c.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_two_processes_merge_to_the_single_process_result(tiny_dir, tmp_path, data_dir):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    args = ["eval", "--task", "gsm8k", "--model", str(tiny_dir), "--limit", "5", "--max-new-tokens", "8",
            "--slot-size", "4", "--block-size", "8", "--no-progress", "--data-dir", str(data_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    runs = {}
    for world in (1, 2):
        out = tmp_path / f"r{world}.json"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)] if world > 1 \
            else [sys.executable]
        r = subprocess.run([*launcher, str(script), *args, "--output", str(out), "--samples", str(out) + "l"],
                           capture_output=True, text=True, timeout=600, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[world] = json.loads(out.read_text())
        samples = [json.loads(line) for line in (tmp_path / f"r{world}.jsonl").read_text().splitlines()]
        assert [s["id"] for s in samples] == [str(i) for i in range(5)] * 3  # refusion, speculative, AR
    assert runs[2]["settings"]["processes"] == 2
    for strategy in ("refusion", "speculative", "autoregressive"):
        one, two = runs[1]["results"]["gsm8k"][strategy], runs[2]["results"]["gsm8k"][strategy]
        assert (two["n"], two["tokens"], two["correct"]) == (one["n"], one["tokens"], one["correct"])
