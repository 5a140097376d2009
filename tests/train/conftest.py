"""Fixtures: a tiny model + tokenizer saved as an HF directory, and a small synthetic data set."""

from __future__ import annotations

import json
import random

import pytest

from refusion.model.tiny import tiny_model, tiny_tokenizer


def addition_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        records.append({"query": f"what is {a}+{b}?", "response": f"{a}+{b}={a + b}. the answer is {a + b}."})
    return records


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test's `train` builds its Accelerator afresh: accelerate keeps one state per process, and a test that
    trained with bf16 mixed precision (the slow SmolLM2 run, "auto") would make every later one with "no" fail.
    (accelerate's own tests reset it the same way.)"""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "add.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in addition_records(64)))
    return path
