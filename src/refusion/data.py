"""The built-in data sets and their prompt formats, shared by `refusion train`, `refusion eval` and `refusion generate`.

Data is read from a data folder (`--data-dir`, $REFUSION_DATA_DIR, or `../shared/data` next to the project),
else from the Hugging Face hub through `datasets` (`refusion.data_files`), never copied into the project. A
built-in prompt set (a train or validation split, never a test split) is formatted with the same prompt
`refusion eval` sends for that task, so that a model fine-tuned on it (or on answers generated from it) is
evaluated on the format it learned.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from refusion.data_files import DATA_DIR_ENV, data_file, default_data_dir
from refusion.jsonl import jsonl_records, read_jsonl

__all__ = ["BUILTIN_DATASETS", "BUILTIN_MIXES", "BUILTIN_TRAIN_FILES", "DATA_DIR_ENV", "arc_question",
           "boxed_prompt", "builtin_train_file", "builtin_train_files", "builtin_train_pairs", "choice_prompt",
           "code_prompt", "default_data_dir", "interleave", "mbpp_prompt", "mmlu_pro_question", "read_jsonl"]

BUILTIN_TRAIN_FILES = {
    "gsm8k": "gsm8k/train.jsonl",
    "mbpp": "mbpp/mbpp.jsonl",  # task ids 601-974 only
    "math": "math/train.jsonl",
    "arc_challenge_train": "arc_challenge/ARC-Challenge-Train.jsonl",
    "arc_challenge_dev": "arc_challenge/ARC-Challenge-Dev.jsonl",
    "mmlu_pro_validation": "mmlu_pro/validation.jsonl",
}
"""The file of each built-in prompt set, inside the data folder: train and validation splits only, never a test split."""
BUILTIN_MIXES = {"distill-mix": ("gsm8k", "math", "mbpp", "arc_challenge_train", "arc_challenge_dev",
                                 "mmlu_pro_validation")}
"""Built-in sets that interleave others, one record of each in turn (`generate --input distill-mix`)."""
BUILTIN_DATASETS = (*BUILTIN_TRAIN_FILES, *BUILTIN_MIXES)
"""Names of the built-in prompt sets (`--data gsm8k`, `generate --input distill-mix`)."""
MBPP_TRAIN_TASK_IDS = range(601, 975)
MBPP_TEST_IDS = range(11, 511)

BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CHOICE_INSTRUCTION = ("Answer the following multiple choice question. Think step by step, then finish with "
                      "\"The answer is X\" where X is the letter of the correct option.")
CODE_INSTRUCTION = "Write the complete function in a single ```python code block."
LETTERS = "ABCDEFGHIJ"


# 1. prompt formats ------------------------------------------------------------------------------------------

def boxed_prompt(problem: str) -> str:
    """A math problem (GSM8K, MATH) asking for a worked answer ending in \\boxed{}."""
    return f"{problem}\n{BOXED_INSTRUCTION}"


def choice_prompt(question: str, options: list[str]) -> str:
    """A multiple-choice question (ARC, MMLU-Pro) with lettered options."""
    lines = [CHOICE_INSTRUCTION, "", f"Question: {question.strip()}", ""]
    lines += [f"{LETTERS[i]}. {option}" for i, option in enumerate(options)]
    return "\n".join(lines)


def arc_question(row: dict) -> tuple[str, str, str]:
    """(prompt, answer letter, option letters) of an ARC record; options labelled "1".."4" (22 questions) are
    relabelled by position, like all others."""
    choices = row["question"]["choices"]
    labels = [c["label"] for c in choices]
    prompt = choice_prompt(row["question"]["stem"], [c["text"] for c in choices])
    return prompt, LETTERS[labels.index(row["answerKey"])], LETTERS[:len(choices)]


def mmlu_pro_question(row: dict) -> tuple[str, str, str]:
    """(prompt, answer letter, option letters) of an MMLU-Pro record."""
    return choice_prompt(row["question"], row["options"]), row["answer"], LETTERS[:len(row["options"])]


def choice_answer(letter: str) -> str:
    """The ending CHOICE_INSTRUCTION asks for."""
    return f"The answer is {letter}."


def code_prompt(stub: str) -> str:
    """A function stub to complete (HumanEval)."""
    return f"Complete the following Python function. {CODE_INSTRUCTION}\n\n```python\n{stub.rstrip()}\n```"


def mbpp_prompt(text: str, tests: list[str]) -> str:
    """An MBPP task: the description and its tests."""
    return (f"You are an expert Python programmer, and here is your task: {text.strip()} "
            f"Your code should pass these tests:\n\n" + "\n".join(tests) + f"\n\n{CODE_INSTRUCTION}")


# 2. the built-in prompt sets --------------------------------------------------------------------------------

def builtin_train_files(name: str, data_dir: str | Path | None = None) -> list[Path]:
    """The files a built-in set reads (each set of a mix), found by `refusion.data_files.data_file`;
    FileNotFoundError names the file and says how to provide it."""
    return [data_file(BUILTIN_TRAIN_FILES[part], data_dir, needed_by=f"built-in data set {name!r}")
            for part in BUILTIN_MIXES.get(name, (name,))]


def builtin_train_file(name: str, data_dir: str | Path | None = None) -> Path:
    """The file of a built-in set that is not a mix (see `builtin_train_files`)."""
    if name in BUILTIN_MIXES:
        raise ValueError(f"{name!r} is a mix of several files: use builtin_train_files")
    return builtin_train_files(name, data_dir)[0]


def builtin_train_pairs(name: str, data_dir: str | Path | None = None) -> Iterator[tuple[str, str, str]]:
    """(origin, prompt, gold answer) of each record of a built-in set, in file order; the origin is "file:line"
    with the file relative to the data folder ("gsm8k/train.jsonl:12"). A mix takes one record of each of its
    sets in turn, in the order it lists them, until all are exhausted (deterministic: no shuffling)."""
    if name in BUILTIN_MIXES:
        yield from interleave([builtin_train_pairs(part, data_dir) for part in BUILTIN_MIXES[name]])
        return
    for number, row in jsonl_records(builtin_train_file(name, data_dir)):
        if name == "mbpp" and row["task_id"] not in MBPP_TRAIN_TASK_IDS:
            continue
        yield (f"{BUILTIN_TRAIN_FILES[name]}:{number}", *_format_train_row(name, row))


def interleave(sources: list[Iterator]) -> Iterator:
    """One item of each source in turn; an exhausted source drops out, the others go on."""
    active = list(sources)
    while active:
        for source in list(active):
            item = next(source, None)
            if item is None:
                active.remove(source)
            else:
                yield item


def _format_train_row(name: str, row: dict) -> tuple[str, str]:
    if name == "gsm8k":
        rationale, _, final = re.sub(r"<<[^>]*>>", "", row["answer"]).rpartition("####")  # drop calculator notes
        return boxed_prompt(row["question"]), f"{rationale.rstrip()}\nThe final answer is $\\boxed{{{final.strip()}}}$."
    if name == "math":
        return boxed_prompt(row["problem"]), row["solution"]
    if name.startswith("arc_challenge"):
        prompt, letter, _ = arc_question(row)
        return prompt, choice_answer(letter)
    if name == "mmlu_pro_validation":  # its worked answer, "A: Let's think step by step. ... The answer is (X)."
        prompt, letter, _ = mmlu_pro_question(row)
        cot = re.sub(r"^A:\s*", "", row["cot_content"].strip())
        return prompt, re.sub(r"\s*The answer is \(?[A-J]\)?\.?$", "", cot) + " " + choice_answer(letter)
    code = row["code"].replace("\r\n", "\n").strip()
    return mbpp_prompt(row["text"], row["test_list"]), f"```python\n{code}\n```"
