"""Near-twins: benchmark prompts whose task text also stands in data a drafter or a draft table learned from.

A speed claim on "held-out" prompts is only held out if the model never saw the same task: the draft table is
counted from distilled answers to training-mix prompts (recipes/data), and a test prompt whose question is
(nearly) one of those prompts gets answers the table has already memorised. Public test splits have such twins
(MBPP repeats task texts across splits; GSM8K and ARC have re-worded copies), so a benchmark excludes them.

The rule: two texts are twins when, after `normalize` (lower case, every run of non-alphanumerics one space),
one holds the other whole, or at least `MIN_SHARED` of the shorter text's word `SHINGLE`-grams occur in the
other. Task texts are compared, not whole prompts: the instructions around them (the boxed-answer line, MBPP's
test list format) are shared by every prompt of a task and say nothing about the task.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from refusion.data import read_jsonl

SHINGLE = 6
"""Words per shingle: long enough that stock phrases ("how many apples does he have") rarely make a twin alone."""
MIN_SHARED = 0.8
"""The fraction of the shorter text's shingles found in the other that makes two texts twins. At 0.5, MBPP's short
task texts matched on their stock opening alone (71 of the 500 test tasks); at 0.8, 15 remain, each asking for
the same function as a training task with one word changed ("the perimeter of a square" / "of a rombus"), whose
answers the table would draft as well."""
_NON_WORD = re.compile(r"[^0-9a-z]+")


def normalize(text: str) -> str:
    """Lower case, every run of characters other than letters and digits one space, stripped."""
    return _NON_WORD.sub(" ", text.lower()).strip()


def shingles(text: str, size: int = SHINGLE) -> set[tuple[str, ...]]:
    """The word `size`-grams of `normalize(text)` (the whole text as one shingle when it is shorter)."""
    words = normalize(text).split()
    if len(words) <= size:
        return {tuple(words)} if words else set()
    return {tuple(words[i: i + size]) for i in range(len(words) - size + 1)}


class TwinIndex:
    """The texts a benchmark must not overlap with, indexed by shingle (`find` is fast over ~10^4 texts)."""

    def __init__(self, texts: Iterable[str]):
        self.texts: list[str] = []
        self._normalized: list[str] = []
        self._sizes: list[int] = []
        self._by_shingle: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for text in texts:
            self.add(text)

    def add(self, text: str) -> None:
        index = len(self.texts)
        grams = shingles(text)
        self.texts.append(text)
        self._normalized.append(normalize(text))
        self._sizes.append(len(grams))
        for gram in grams:
            self._by_shingle[gram].append(index)

    def find(self, text: str) -> str | None:
        """The indexed text `text` is a twin of (the one sharing the most shingles), or None."""
        grams = shingles(text)
        if not grams:
            return None
        shared: dict[int, int] = defaultdict(int)
        for gram in grams:
            for index in self._by_shingle.get(gram, ()):
                shared[index] += 1
        normalized = normalize(text)
        for index, count in sorted(shared.items(), key=lambda item: -item[1]):
            other = self._normalized[index]
            if count >= MIN_SHARED * min(len(grams), self._sizes[index]) or normalized in other or other in normalized:
                return self.texts[index]
        return None


def read_queries(paths: Iterable[str | Path], field: str = "query") -> list[str]:
    """The `field` of every row of JSONL files: the prompts a data set answered (recipes/data's distilled answers
    keep theirs under "query")."""
    queries = []
    for path in paths:
        for number, row in enumerate(read_jsonl(Path(path)), 1):
            if not isinstance(row, dict) or field not in row:
                raise ValueError(f"{path}: record {number} has no {field!r} field")
            queries.append(row[field])
    return queries


def without_twins(items: list, task_text, index: TwinIndex) -> tuple[list, list]:
    """(items kept, items dropped): an item is dropped when `task_text(item)` has a twin in `index`."""
    kept, dropped = [], []
    for item in items:
        (dropped if index.find(task_text(item)) is not None else kept).append(item)
    return kept, dropped
