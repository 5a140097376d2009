"""Near-twins: benchmark prompts whose task text also stands in data a drafter or a draft table learned from.

A speed claim on "held-out" prompts is only held out if the model never saw the same task: the draft table is
counted from distilled answers to training-mix prompts (recipes/data), and a test prompt whose question is
(nearly) one of those prompts gets answers the table has already memorised. Public test splits have such twins
(MBPP repeats task texts across splits; GSM8K and ARC have re-worded copies), so a benchmark excludes them.

The rule: two texts are twins when, after `normalize` (lower case, every run of non-alphanumerics one space),
one holds the other whole, or at least `MIN_SHARED` of the shorter text's word `SHINGLE`-grams occur in the
other. Shingles common to many indexed texts (instructions every prompt of a task shares) are left out, and each
paragraph of a prompt is also compared on its own, so that an ARC question asked again with other options, or a
GSM8K problem inside a rewrite request, is found in a whole prompt.
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
"""The fraction of the shorter text's telling shingles found in the other that makes two texts twins. At 0.5, MBPP's
short task texts matched on little more than their opening (71 of the 500 test tasks)."""
COMMON = 20
"""A shingle found in more indexed texts than this is stock wording (a task's instructions, "write a function to
find the") and tells nothing about the task: `find` leaves it out on both sides, so whole prompts can be compared
without cutting their instructions off first."""
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
        self.texts = list(texts)
        self._normalized = [normalize(t) for t in self.texts]
        self._shingles = [[hash(g) for g in shingles(t)] for t in self.texts]  # hashed: ~10^6 of them
        self._by_shingle: dict[int, list[int]] = defaultdict(list)
        for index, grams in enumerate(self._shingles):
            for gram in grams:
                self._by_shingle[gram].append(index)

    def _telling(self, grams: Iterable[int]) -> list[int]:
        return [g for g in grams if len(self._by_shingle.get(g, ())) <= COMMON]

    def find(self, text: str) -> str | None:
        """The indexed text `text`, or one of its paragraphs of more than SHINGLE words (a question apart from its
        options, a task apart from its tests), is a twin of; None when there is none."""
        parts = [text] + [p for p in re.split(r"\n\s*\n", text) if len(p.split()) > SHINGLE]
        return next((twin for part in parts if (twin := self._find(part)) is not None), None)

    def _find(self, text: str) -> str | None:
        """The indexed text sharing the most telling shingles with `text`, if it is a twin."""
        grams = self._telling(hash(g) for g in shingles(text))
        shared: dict[int, int] = defaultdict(int)
        for gram in grams:
            for index in self._by_shingle.get(gram, ()):
                shared[index] += 1
        normalized = normalize(text)
        for index, count in sorted(shared.items(), key=lambda item: -item[1]):
            other = self._normalized[index]
            smaller = min(len(grams), len(self._telling(self._shingles[index])))
            if count >= MIN_SHARED * smaller or normalized in other or other in normalized:
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
