"""Built-in prompt sets (`refusion.data`): eval's prompt formats with gold answers, train/validation files only,
the distill-mix interleaving, and `refusion generate --input distill-mix` writing training records and resuming."""

from __future__ import annotations

import json

import pytest

from refusion.cli import main
from refusion.data import (
    BUILTIN_DATASETS,
    BUILTIN_MIXES,
    BUILTIN_TRAIN_FILES,
    builtin_train_files,
    builtin_train_pairs,
    default_data_dir,
    interleave,
)
from refusion.eval import scoring
from refusion.eval.tasks import TASKS

NEW_SETS = {"arc_challenge_train": "arc_challenge", "arc_challenge_dev": "arc_challenge",
            "mmlu_pro_validation": "mmlu_pro"}
"""The new built-in sets and the eval task whose prompt format (and loader) they share."""


def _arc_row(i: int, numeric: bool = False) -> dict:
    labels = ["1", "2", "3", "4"] if numeric else ["A", "B", "C", "D"]
    return {"id": f"arc-{i}", "answerKey": labels[i % 4],
            "question": {"stem": f"question {i}?", "choices": [{"text": f"option {j}", "label": label}
                                                               for j, label in enumerate(labels)]}}


def _mmlu_row(i: int) -> dict:
    return {"question_id": i, "question": f"mmlu {i}?", "options": ["x", "y", "z"], "answer": "C", "answer_index": 2,
            "cot_content": f"A: Let's think step by step. Reason {i}. The answer is (C)."}


@pytest.fixture
def data_dir(tmp_path):
    """A data folder with every train/validation file (few rows, different counts) and every test file, whose
    rows say "test" so that reading one shows."""
    rows = {
        "gsm8k": [{"question": f"gsm {i}?", "answer": f"step <<1+1=2>>{i}\n#### {i}"} for i in range(3)],
        "math": [{"problem": "math 0?", "solution": "so \\boxed{0}"}],
        "mbpp": [{"task_id": task_id, "text": f"task {task_id}", "code": "def f():\r\n    return 1",
                  "test_list": ["assert f() == 1"]} for task_id in (5, 11, 510, 511, 601, 602, 974)],
        "arc_challenge_train": [_arc_row(0), _arc_row(1, numeric=True)],
        "arc_challenge_dev": [_arc_row(2)],
        "mmlu_pro_validation": [_mmlu_row(0), _mmlu_row(1)],
    }
    for name, records in rows.items():
        path = tmp_path / BUILTIN_TRAIN_FILES[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    for task in TASKS.values():
        if task.data_file and not (tmp_path / task.data_file).exists():
            (tmp_path / task.data_file).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / task.data_file).write_text(json.dumps({"question": "test"}) + "\n")
    return tmp_path


def test_new_sets_use_the_eval_prompt_format_with_gold_answers(data_dir):
    for name, task in NEW_SETS.items():
        examples = TASKS[task].load(data_dir / BUILTIN_TRAIN_FILES[name])  # eval's loader on the same file
        pairs = list(builtin_train_pairs(name, data_dir))
        assert [prompt for _, prompt, _ in pairs] == [ex.prompt for ex in examples]
        for (_, _, response), ex in zip(pairs, examples, strict=True):
            assert response.endswith(f"The answer is {ex.reference['answer']}.")
            assert scoring.extract_choice(response, ex.reference["letters"]) == ex.reference["answer"]
    arc = list(builtin_train_pairs("arc_challenge_train", data_dir))
    assert arc[0][2] == "The answer is A." and arc[1][2] == "The answer is B."  # label "2" of "1".."4" is B
    assert "\nA. option 0\nB. option 1\n" in arc[1][1]
    mmlu = list(builtin_train_pairs("mmlu_pro_validation", data_dir))
    assert mmlu[1][2] == "Let's think step by step. Reason 1. The answer is C."  # the worked answer, eval's ending


@pytest.mark.skipif(not (default_data_dir() / "mmlu_pro").is_dir(), reason="shared data folder absent")
@pytest.mark.parametrize("name, rows", [("arc_challenge_train", 1119), ("arc_challenge_dev", 299),
                                        ("mmlu_pro_validation", 70)])
def test_new_sets_on_the_shared_data(name, rows):
    examples = TASKS[NEW_SETS[name]].load(default_data_dir() / BUILTIN_TRAIN_FILES[name])
    pairs = list(builtin_train_pairs(name))
    assert len(pairs) == len(examples) == rows
    for (_, prompt, response), ex in zip(pairs, examples, strict=True):
        assert prompt == ex.prompt
        assert scoring.extract_choice(response, ex.reference["letters"]) == ex.reference["answer"]


def test_no_test_split_is_ever_read(data_dir):
    eval_files = {task.data_file for task in TASKS.values() if task.data_file}
    for name in BUILTIN_DATASETS:
        for path in builtin_train_files(name, data_dir):
            relative = str(path.relative_to(data_dir))
            assert "test" not in relative.lower() and relative not in eval_files - {"mbpp/mbpp.jsonl"}
    # mbpp.jsonl holds every split: only task ids 601-974 (train) are read
    records = list(builtin_train_pairs("distill-mix", data_dir))
    assert {origin.rsplit(":", 1)[0] for origin, _, _ in records} == set(BUILTIN_TRAIN_FILES.values())
    mbpp = [origin for origin, _, _ in records if origin.startswith("mbpp/")]
    assert mbpp == ["mbpp/mbpp.jsonl:5", "mbpp/mbpp.jsonl:6", "mbpp/mbpp.jsonl:7"]  # task ids 601, 602, 974


def test_the_mix_interleaves_every_set_in_turn(data_dir):
    assert set(BUILTIN_MIXES["distill-mix"]) == set(BUILTIN_TRAIN_FILES)
    origins = [origin for origin, _, _ in builtin_train_pairs("distill-mix", data_dir)]
    assert origins == [
        "gsm8k/train.jsonl:1", "math/train.jsonl:1", "mbpp/mbpp.jsonl:5", "arc_challenge/ARC-Challenge-Train.jsonl:1",
        "arc_challenge/ARC-Challenge-Dev.jsonl:1", "mmlu_pro/validation.jsonl:1",
        "gsm8k/train.jsonl:2", "mbpp/mbpp.jsonl:6", "arc_challenge/ARC-Challenge-Train.jsonl:2",
        "mmlu_pro/validation.jsonl:2",
        "gsm8k/train.jsonl:3", "mbpp/mbpp.jsonl:7",
    ]
    assert list(builtin_train_pairs("distill-mix", data_dir)) == list(builtin_train_pairs("distill-mix", data_dir))
    assert list(interleave([iter("ab"), iter(""), iter("cde")])) == ["a", "c", "b", "d", "e"]


def test_a_missing_file_of_the_mix_is_named(data_dir):
    (data_dir / BUILTIN_TRAIN_FILES["mmlu_pro_validation"]).unlink()
    with pytest.raises(FileNotFoundError, match=r"'distill-mix' needs .*validation\.jsonl.*--data-dir"):
        builtin_train_files("distill-mix", data_dir)


def test_generate_over_the_mix_writes_training_records_and_resumes(tiny_model_dir, data_dir, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.setenv("REFUSION_DATA_DIR", str(data_dir))
    monkeypatch.chdir(tmp_path)  # "distill-mix" is not a file here: it names the built-in mix
    target = tmp_path / "answers.jsonl"
    argv = ["generate", "--model", tiny_model_dir, "--input", "distill-mix", "--limit", "7", "--output",
            str(target), "--batch-size", "3", "--max-new-tokens", "4", "--strategy", "autoregressive"]
    assert main(argv) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    expected = list(builtin_train_pairs("distill-mix", data_dir))[:7]
    assert [(r["origin"], r["query"]) for r in records] == [(origin, query) for origin, query, _ in expected]
    assert all(isinstance(r["response"], str) and r["stats"]["finish_reason"] in ("eos", "length") for r in records)
    # interrupted after 4 records: the run continues with record 5 of the mix, and writes what it wrote before
    target.write_text("".join(line + "\n" for line in target.read_text().splitlines()[:4]))
    assert main(argv) == 0
    again = [json.loads(line) for line in target.read_text().splitlines()]
    assert [(r["origin"], r["query"], r["response"]) for r in again] == [
        (r["origin"], r["query"], r["response"]) for r in records]
    # an output made from other prompts is refused, not continued
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"query": "something else", "response": "r"}) + "\n")
    assert main([*argv, "--output", str(other)]) == 2
    assert f"{other}:1: answers another prompt than --input's record 1 (gsm8k/train.jsonl:1)" in capsys.readouterr().err


def test_the_open_ended_set_is_fixed_and_its_held_out_part_apart(data_dir):
    from refusion.open_ended import EXTRA_SETS, HELD_OUT_EVERY, open_ended_prompts

    train, test = open_ended_prompts("train", data_dir), open_ended_prompts("test", data_dir)
    assert open_ended_prompts("test", data_dir) == test  # the same set and split on every call
    assert not {p for _, p in train} & {p for _, p in test}
    whole = len(train) + len(test)
    assert len(test) == -(-whole // HELD_OUT_EVERY)
    kinds = {origin.split(":")[1] for origin, _ in test}
    assert kinds == {origin.split(":")[1] for origin, _ in train} == {"explain", "story", "how-to", "rewrite"}
    rewrites = [p for origin, p in train + test if ":rewrite:" in origin]
    assert all(p.endswith(("gsm 0?", "gsm 1?", "gsm 2?")) for p in rewrites)  # GSM8K train questions, not test
    with pytest.raises(ValueError, match="split='dev'"):
        open_ended_prompts("dev", data_dir)
    extra = open_ended_prompts("extra", data_dir)  # training only: no request, topic or text of the set
    assert extra == open_ended_prompts("extra", data_dir) and len(extra) == len({p for _, p in extra})
    assert not {p for _, p in extra} & {p for _, p in train + test}
    assert all(origin.startswith("open-ended-extra:") for origin, _ in extra)
    assert {origin.split(":")[1] for origin, _ in extra} >= {"explain", "story", "how-to"}
    seen = {p for _, p in train + test + extra}
    for name in list(EXTRA_SETS)[1:]:  # more such sets, each apart from every set before it
        more = open_ended_prompts(name, data_dir)
        assert len(more) == len({p for _, p in more}) and not {p for _, p in more} & seen
        assert all(origin.startswith(f"open-ended-{name}:") for origin, _ in more)
        seen |= {p for _, p in more}


def test_generate_reads_the_open_ended_set_by_name(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    from refusion.open_ended import open_ended_prompts

    monkeypatch.setenv("REFUSION_DATA_DIR", str(data_dir))
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "answers.jsonl"
    assert main(["generate", "--model", tiny_model_dir, "--input", "open-ended-test", "--limit", "3", "--output",
                 str(target), "--max-new-tokens", "2", "--strategy", "autoregressive"]) == 0
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [(r["origin"], r["query"]) for r in records] == open_ended_prompts("test", data_dir)[:3]
