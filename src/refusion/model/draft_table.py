"""A model's draft table: what its own answers usually write after a few tokens, as drafts for the exact mode.

A small model's answers repeat themselves across prompts ("The final answer is", "```python\\ndef", "Let's break it
down"), and prompt lookup cannot see what is not in the prompt or the response yet. The table is n-gram statistics
of the model's own greedy answers (the distilled set it was trained on): for each run of n tokens (n in `orders`,
4, 3, 2 and 1 by default) seen at least `min_count` times, the token that most often followed it and how often it
did (left out where the run one token shorter that ends it says the same: the lookup falls back to it, so the
drafts are unchanged and the table is a third to a half smaller). Drafting walks the table greedily, each step from
the longest run of the text's last tokens that the table knows (a run of 4 says more than a run of 2 when there is
one, and a single token is the last resort): the token after them, then the token after the new last tokens, and so
on, while the product of the followers' frequencies stays at or above `min_confidence`. Longer runs, and single
tokens as the last resort, each drafted more per forward than without them on refusion-smol's GSM8K tuning prompts
(docs/archive/RESULTS-LEDGER.md: *Draft table*; the prompts are named in its "Prompts" section).

Drafts from the table are verified like copied ones (`speculate.copied_drafts`): AR decoding still decides
every token, so the table never changes the output, only how many tokens a forward commits. Each run also keeps
its runner-up, the token that second most often followed it, where it had one: the exact mode verifies a chain
from it beside the table's own in the same forward (`decode.drafters.table.runner_up_drafts`), so a round whose first draft
is wrong can still commit more than one token.

Shipped next to a model as `draft_table.safetensors` (`refusion.load` puts it in the model's `ModelSetup`,
`refusion.model.setup`) and built by `refusion draft-table` (`refusion.model.cli`).
"""

from __future__ import annotations

import bisect
import collections
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

TABLE_FILE = "draft_table.safetensors"
DEFAULT_ORDERS = (4, 3, 2, 1)
"""Lengths of the token runs a table keys on unless told otherwise."""
TOKEN_ID_U16_MAX = 65535
"""A table whose token ids all fit in 16 bits stores them so (half the file of 32-bit ids)."""
METADATA_KEY = "draft_table"
"""The file's one metadata entry: the table's settings (orders, min_confidence) as JSON."""


@dataclass(frozen=True)
class DraftTable:
    """Most frequent follower of each frequent run of tokens in a model's own answers."""

    orders: tuple[int, ...]
    """The lengths of the runs in the table, longest first: drafting reads the longest run it finds."""

    min_confidence: float
    """Drafting stops before the product of the followers' frequencies falls below this."""

    followers: Mapping[tuple[int, ...], tuple[int, float]] = field(repr=False)
    """{run of tokens: (the token that most often followed it, how often it did: count / runs)}: a dict when built,
    a `RunIndex` over the file's arrays when loaded."""

    runner_ups: Mapping[tuple[int, ...], int] = field(default_factory=dict, repr=False)
    """{run of `followers`: the token that second most often followed it}, for the runs that had another follower:
    the exact mode verifies a chain from it beside the table's own chain (`runner_up_drafts`)."""

    @staticmethod
    def from_sequences(sequences: Iterable[list[int]], orders: Iterable[int] = DEFAULT_ORDERS, min_count: int = 2,
                       min_confidence: float = 0.1) -> DraftTable:
        """Count, in each token sequence, which token follows each run of n tokens (n in `orders`); keep the
        runs seen at least `min_count` times."""
        orders = tuple(sorted(set(orders), reverse=True))
        if not orders or orders[-1] < 1 or min_count < 1 or not 0 < min_confidence <= 1:
            raise ValueError(f"draft table: orders={orders} and min_count={min_count} must be >= 1 and "
                             f"min_confidence={min_confidence} in (0, 1]")
        counts: dict[tuple[int, ...], collections.Counter] = collections.defaultdict(collections.Counter)
        for ids in sequences:
            for order in orders:
                for i in range(len(ids) - order):
                    counts[tuple(ids[i: i + order])][ids[i + order]] += 1
        followers, seconds = {}, {}
        for run, after in counts.items():
            total = sum(after.values())
            if total >= min_count:
                (token, n), *second = after.most_common(2)
                followers[run] = (token, n / total)
                if second:
                    seconds[run] = second[0][0]
        followers = without_redundant_runs(followers, orders)
        return DraftTable(orders, min_confidence, followers, {run: seconds[run] for run in followers if run in seconds})

    def follower(self, text: list[int]) -> tuple[int, float] | None:
        """(token, frequency) after the longest run of the text's last tokens in the table; None when none is."""
        for order in self.orders:
            if len(text) >= order and (found := self.followers.get(tuple(text[-order:]))) is not None:
                return found
        return None

    def longest_run(self, text: list[int]) -> tuple[int, ...] | None:
        """The longest run of the text's last tokens that the table holds; None when none is."""
        for order in self.orders:
            if len(text) >= order and (run := tuple(text[-order:])) in self.followers:
                return run
        return None

    def runner_up(self, text: list[int]) -> int | None:
        """The token that second most often followed the run `follower` reads (None: it had no other)."""
        run = self.longest_run(text)
        return None if run is None else self.runner_ups.get(run)

    def drafts(self, text: list[int], length: int) -> list[int]:
        """Up to `length` tokens that the model's answers usually write after `text`; [] when its last tokens
        are not in the table."""
        return [token for token, _ in self.walk(text, length)]

    def walk(self, text: list[int], length: int) -> list[tuple[int, float]]:
        """`drafts`, each with its frequency: how often it followed the run it was read after."""
        context, out, confidence = list(text[-self.orders[0]:]), [], 1.0
        while len(out) < length:
            found = self.follower(context)
            if found is None or confidence * found[1] < self.min_confidence:
                break
            confidence *= found[1]
            out.append(found)
            context = context[1:] + [found[0]] if len(context) == self.orders[0] else context + [found[0]]
        return out

    def save(self, path: str | Path) -> None:
        import torch
        from safetensors.torch import save_file

        tensors = {}
        largest = max((max(*run, token) for run, (token, _) in self.followers.items()), default=0)
        largest = max(largest, *self.runner_ups.values()) if self.runner_ups else largest
        ids = torch.uint16 if largest <= TOKEN_ID_U16_MAX else torch.int32  # a small vocabulary's ids in 2 bytes
        for order in self.orders:
            runs = [run for run in self.followers if len(run) == order]
            tensors[f"runs_{order}"] = torch.tensor(runs, dtype=torch.int32).reshape(-1, order).to(ids)
            tensors[f"followers_{order}"] = torch.tensor([self.followers[r][0] for r in runs],
                                                         dtype=torch.int32).to(ids)
            tensors[f"frequencies_{order}"] = torch.tensor([self.followers[r][1] for r in runs], dtype=torch.float32)
            if self.runner_ups:  # the follower itself where a run had no other
                seconds = [self.runner_ups.get(r, self.followers[r][0]) for r in runs]
                tensors[f"runner_ups_{order}"] = torch.tensor(seconds, dtype=torch.int32).to(ids)
        # one metadata entry: safetensors writes several in an order of its own, so two saves of one table
        # would differ in bytes
        settings = {"orders": list(self.orders), "min_confidence": self.min_confidence}
        save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(settings, sort_keys=True)})
        os.chmod(path, 0o644)  # may ship as package data: readable by every user

    @staticmethod
    def load(path: str | Path) -> DraftTable:
        from safetensors import safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
                if METADATA_KEY in meta:
                    settings = json.loads(meta[METADATA_KEY])
                    orders, min_confidence = tuple(int(o) for o in settings["orders"]), float(settings["min_confidence"])
                elif "orders" in meta:  # written before 2026-11-27: one metadata entry per setting
                    orders = tuple(int(o) for o in meta["orders"].split(","))
                    min_confidence = float(meta["min_confidence"])
                else:
                    raise ValueError("no orders in its metadata (tables of one order, from before 2026-11-25, "
                                     "are rebuilt with `refusion draft-table`)")
                names = ("runs", "followers", "frequencies")
                if f"runner_ups_{orders[0]}" in set(f.keys()):  # tables from before 2026-11-28 have none
                    names += ("runner_ups",)
                parts = [[f.get_tensor(f"{k}_{order}") for k in names] for order in orders]
        except Exception as e:  # a damaged or foreign file: say which, not where safetensors tripped
            raise ValueError(f"{path} is not a draft table ({type(e).__name__}: {e})") from None
        for order, (runs, followers, frequencies, *seconds) in zip(orders, parts):
            if runs.shape != (followers.numel(), order) or any(t.shape != followers.shape
                                                                for t in (frequencies, *seconds)):
                raise ValueError(f"{path} is not a draft table (its tensors do not line up)")
        index = RunIndex.of(orders, parts)
        if index is not None:
            return DraftTable(orders, min_confidence, index, RunnerUps(index) if len(parts[0]) == 4 else {})
        table, runner_ups = {}, {}
        for runs, followers, frequencies, *seconds in parts:
            runs = list(zip(*runs.T.tolist()))  # each run as a tuple, made by zip from the columns: 3x faster than rows
            followers = followers.tolist()
            table.update(zip(runs, zip(followers, frequencies.tolist())))
            if seconds:
                runner_ups.update((run, second) for run, first, second in zip(runs, followers, seconds[0].tolist())
                                  if second != first)
        return DraftTable(orders, min_confidence, table, runner_ups)


@dataclass(frozen=True)
class _OrderRuns:
    """The runs of one length in a `RunIndex`: the file's arrays, and the runs' keys sorted for binary search."""

    runs: object
    """[N, order] int64 tensor: the runs, in the file's order."""
    keys: memoryview
    """[N] the runs' keys (tokens as digits in base `RunIndex.radix`), sorted."""
    rows: memoryview
    """[N] rows[i]: the file row of keys[i]."""
    followers: memoryview
    """[N] each run's follower, in the file's order."""
    frequencies: memoryview
    """[N] each run's follower's frequency (fp32, read as the float it is)."""
    runner_ups: memoryview | None
    """[N] each run's runner-up (its follower where it had none), or None for a table without runner-ups."""


class RunIndex(Mapping):
    """A loaded table's {run: (follower, frequency)} over the file's arrays: each length's runs as sorted 64-bit keys
    (the run's tokens as digits in base `radix`), found by binary search. Loading makes no Python object per run: the
    shipped table's 478k runs took ~0.7 s and ~150 MB of memory as a dict of tuples, a large part of a cold start.
    Iterated in the file's order (a loaded table saved again writes the same bytes)."""

    def __init__(self, radix: int, parts: dict[int, _OrderRuns]):
        self.radix, self.parts = radix, parts

    @staticmethod
    def of(orders: tuple[int, ...], parts: list[list]) -> RunIndex | None:
        """The index of a file's tensors (per order: runs, followers, frequencies[, runner_ups]); None where a run's
        key would not fit 63 bits (a vocabulary too large for the longest run: the caller builds dicts)."""
        import torch

        runs_of = [runs.to(torch.int64) for runs, *_ in parts]
        radix = 1 + max((int(runs.max()) for runs in runs_of if runs.numel()), default=0)
        if radix ** max(orders) >= 2**63:
            return None
        built = {}
        for order, runs, (_, followers, frequencies, *seconds) in zip(orders, runs_of, parts):
            keys = torch.zeros(runs.shape[0], dtype=torch.int64)
            for column in range(order):
                keys = keys * radix + runs[:, column]
            keys, rows = torch.sort(keys)
            built[order] = _OrderRuns(runs, _view(keys), _view(rows), _view(followers.to(torch.int64)),
                                      _view(frequencies.to(torch.float32)),
                                      _view(seconds[0].to(torch.int64)) if seconds else None)
        return RunIndex(radix, built)

    def row(self, run: tuple[int, ...]) -> tuple[_OrderRuns, int] | None:
        """(the run's length's arrays, its file row), or None when the table does not hold the run."""
        part = self.parts.get(len(run))
        if part is None:
            return None
        key = 0
        for token in run:
            if not 0 <= token < self.radix:
                return None
            key = key * self.radix + token
        i = bisect.bisect_left(part.keys, key)
        if i == len(part.keys) or part.keys[i] != key:
            return None
        return part, part.rows[i]

    def get(self, run, default=None):
        found = self.row(run)
        if found is None:
            return default
        part, row = found
        return part.followers[row], part.frequencies[row]

    def __getitem__(self, run):
        found = self.get(run)
        if found is None:
            raise KeyError(run)
        return found

    def __contains__(self, run) -> bool:
        return self.row(run) is not None

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        for part in self.parts.values():
            yield from map(tuple, part.runs.tolist())

    def __len__(self) -> int:
        return sum(len(part.keys) for part in self.parts.values())


class RunnerUps(Mapping):
    """A loaded table's {run: runner-up} over its `RunIndex`: the runs whose runner-up differs from their follower."""

    def __init__(self, index: RunIndex):
        self.index = index

    def get(self, run, default=None):
        found = self.index.row(run)
        if found is None:
            return default
        part, row = found
        second = part.runner_ups[row]
        return default if second == part.followers[row] else second

    def __getitem__(self, run):
        found = self.get(run)
        if found is None:
            raise KeyError(run)
        return found

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        for part in self.index.parts.values():
            for row, run in enumerate(map(tuple, part.runs.tolist())):
                if part.runner_ups[row] != part.followers[row]:
                    yield run

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _view(tensor) -> memoryview:
    """A 1-D tensor's values as a memoryview, indexed (and binary-searched) without a Python object per value."""
    return memoryview(tensor.contiguous().numpy())


def without_redundant_runs(followers: dict[tuple[int, ...], tuple[int, float]],
                           orders: tuple[int, ...]) -> dict[tuple[int, ...], tuple[int, float]]:
    """`followers` less each run whose (follower, frequency) equals that of the run one token shorter that ends
    it, when that length is also one of `orders`: a lookup that misses the run finds the shorter one next, with the
    same follower and frequency, so the drafts are the same (and the shorter run is always there: it was seen at
    least as often). Most long runs are such, e.g. those always followed by the same token."""
    return {run: found for run, found in followers.items()
            if not (len(run) - 1 in orders and followers.get(run[1:]) == found)}


def answers_with_openings(prompts, responses, orders: Iterable[int] = DEFAULT_ORDERS) -> list[list[int]]:
    """Each answer (token ids) after the last tokens of its prompt (the chat template's assistant header), as many
    as the longest run: what a table counts, so that it drafts answers' openings too."""
    longest = max(orders)
    return [list(p[-longest:]) + list(r) for p, r in zip(prompts, responses)]
