"""Pack distilled answers as training records: python recipes/pack_answers.py ANSWERS PACKED [FROM [LIMIT]].

Keeps records FROM+1..LIMIT of ANSWERS (`refusion generate --output` or recipes/distill_gpu.py lines) that ended
with EOS (those cut at the length limit teach no ending) as {"query", "response", "origin"} lines, gzip-compressed
with a fixed timestamp (same answers, same bytes), and says how many each source kept.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import sys

MAX_MB = 10
"""recipes/data holds at most this much per file."""


def by_source(records: list[dict]) -> collections.Counter:
    return collections.Counter(r["origin"].rsplit(":", 1)[0] for r in records)


def main(argv: list[str]) -> int:
    source, packed, start = argv[0], argv[1], int(argv[2]) if len(argv) > 2 else 0
    limit = int(argv[3]) if len(argv) > 3 else None
    try:
        with open(source, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()][start:limit]
    except (OSError, json.JSONDecodeError) as e:
        print(f"pack_answers: cannot read {source}: {e}", file=sys.stderr)
        return 1
    kept = [r for r in records if r["stats"]["finish_reason"] == "eos"]
    lines = "".join(json.dumps({"query": r["query"], "response": r["response"], "origin": r["origin"]}) + "\n"
                    for r in kept)
    with open(packed + ".tmp", "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as f:
        f.write(lines.encode("utf-8"))
    os.replace(packed + ".tmp", packed)
    total, ended = by_source(records), by_source(kept)
    for name in total:
        print(f"  {name}: kept {ended[name]} of {total[name]}")
    size = os.path.getsize(packed) / 2**20
    print(f"distilled: kept {len(kept)} of {len(records)} answers (the others hit the length limit); "
          f"{packed}: {size:.2f} MB")
    if size > MAX_MB:
        print(f"{packed} is over the {MAX_MB} MB allowed under recipes/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
