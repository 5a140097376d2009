"""The one JSONL reader: the records of a JSON-lines file, each with its line number (gzip-compressed when the
name ends in .gz). Blank lines are skipped; a line that does not parse is a one-line ValueError naming the file
and the line (`data.jsonl:7: not valid JSON (Expecting value)`), and so is a file that is not UTF-8 text."""

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
        try:
            yield from parse_lines(f, path)
        except UnicodeDecodeError as e:
            raise not_utf8(path, e) from None


def not_utf8(path: str | Path, error: UnicodeDecodeError) -> ValueError:
    """The one-line error for a file that is not UTF-8 text."""
    return ValueError(f"{path} is not UTF-8 text ({error.reason}): convert it first, e.g. with iconv")


def read_jsonl(path: str | Path) -> list:
    """The records of a JSONL file, in file order."""
    return [record for _, record in jsonl_records(path)]
