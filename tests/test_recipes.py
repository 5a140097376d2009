"""The recipes' Python helpers: GPU batch distillation gives `refusion generate`'s records, packing keeps what ended."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from refusion.cli import main as refusion_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def recipe_module(name: str):
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_prompts(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"query": "word " * (1 + 2 * (i % 3)) + str(i), "origin": f"set:{i + 1}"})
                            + "\n" for i in range(n)))


def test_batch_distillation_writes_generates_records(tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 4)
    reference, batched = tmp_path / "generate.jsonl", tmp_path / "batched.jsonl"
    assert refusion_main(["generate", "--model", tiny_model_dir, "--input", str(prompts), "--output", str(reference),
                          "--strategy", "autoregressive", "--dtype", "float32", "--max-new-tokens", "8"]) == 0
    distill = recipe_module("distill_gpu")
    assert distill.main(["--model", tiny_model_dir, "--input", str(prompts), "--output", str(batched), "--device",
                         "cpu", "--batch-size", "1", "--max-new-tokens", "8"]) == 0
    fields = ("query", "response", "origin")
    expected = [tuple(r[k] for k in fields) for r in map(json.loads, reference.read_text().splitlines())]
    records = [json.loads(line) for line in batched.read_text().splitlines()]
    assert [tuple(r[k] for k in fields) for r in records] == expected  # in --input's order, origins kept
    assert all(r["stats"]["finish_reason"] in ("eos", "length") for r in records)


def test_shortest_and_seconds_choose_which_prompts_are_answered(tiny_model_dir, tmp_path):
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "answers.jsonl"
    write_prompts(prompts, 6)  # prompts 1 and 4 are the shortest
    distill = recipe_module("distill_gpu")
    common = ["--model", tiny_model_dir, "--input", str(prompts), "--output", str(out), "--device", "cpu",
              "--max-new-tokens", "4"]
    assert distill.main([*common, "--seconds", "0"]) == 0 and not out.exists()  # no batch started
    assert distill.main([*common, "--shortest", "2", "--batch-size", "1"]) == 0
    assert [json.loads(line)["origin"] for line in out.read_text().splitlines()] == ["set:1", "set:4"]
    assert distill.main(common) == 0  # a later run answers the others, keeping the first ones
    assert [json.loads(line)["origin"] for line in out.read_text().splitlines()] == [f"set:{i}" for i in range(1, 7)]
    packed, rest = tmp_path / "packed.jsonl.gz", tmp_path / "rest.jsonl"  # a set already made: prompts 2 and 5
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    with gzip.open(packed, "wt") as f:
        f.writelines(json.dumps({**records[i], "response": "x"}) + "\n" for i in (1, 4))
    assert distill.main([*common[:4], "--output", str(rest), *common[6:], "--exclude", str(packed)]) == 0
    assert [json.loads(line)["origin"] for line in rest.read_text().splitlines()] == ["set:1", "set:3", "set:4",
                                                                                      "set:6"]
    after = tmp_path / "after.jsonl"  # the next shortest after those an earlier --shortest 2 answered
    assert distill.main([*common[:4], "--output", str(after), *common[6:], "--skip-shortest", "2", "--shortest",
                         "4"]) == 0
    assert [json.loads(line)["origin"] for line in after.read_text().splitlines()] == ["set:2", "set:5"]


def test_packing_keeps_the_answers_that_ended(tmp_path, capsys):
    answers = tmp_path / "answers.jsonl"
    answers.write_text("".join(json.dumps({"query": f"q{i}", "response": f"r{i}", "origin": f"a/b.jsonl:{i}",
                                           "stats": {"finish_reason": "eos" if i % 2 else "length"}}) + "\n"
                               for i in range(6)))
    pack = recipe_module("pack_answers")
    packed = tmp_path / "packed.jsonl.gz"
    assert pack.main([str(answers), str(packed), "1", "5"]) == 0  # records 2..5
    with gzip.open(packed, "rt") as f:
        kept = [json.loads(line) for line in f]
    assert kept == [{"query": f"q{i}", "response": f"r{i}", "origin": f"a/b.jsonl:{i}"} for i in (1, 3)]
    assert "a/b.jsonl: kept 2 of 4" in capsys.readouterr().out
    first = packed.read_bytes()
    assert pack.main([str(answers), str(packed), "1", "5"]) == 0 and packed.read_bytes() == first  # same bytes
