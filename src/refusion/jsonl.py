"""The one JSONL reader: the records of a JSON-lines file, each with its line number (gzip-compressed when the
name ends in .gz). Blank lines are skipped; a line that does not parse is a one-line ValueError naming the file
and the line (`data.jsonl:7: not valid JSON (Expecting value)`)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def open_text(path: str | Path) -> IO[str]:
    """A JSON or JSONL file opened as UTF-8 text, through gzip when its name ends in .gz."""
    path = Path(path)
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def parse_lines(lines, name: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, record) of each non-blank line of `lines` (numbered from 1); `name` is the file the errors
    name."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}:{number}: not valid JSON ({e.msg})") from None


def jsonl_records(path: str | Path) -> Iterator[tuple[int, object]]:
    """(line number, record) of each non-blank line of a JSONL file, read as it goes."""
    with open_text(path) as f:
        yield from parse_lines(f, path)


def read_jsonl(path: str | Path) -> list:
    """The records of a JSONL file, in file order."""
    return [record for _, record in jsonl_records(path)]
