"""Start-up of the command line, as a user meets it: seconds from the command to the first token of a cached model,
where they go, and whether every process prints the same answer.

Each run is a fresh process of `refusion generate PROMPT --max-new-tokens 1` (the command to its first token: the
imports, loading the cached model, the prefill and one token); `--runs` of them, one after another. One more
process under `python -X importtime` splits the imports by top-level package. Then the README's main command runs
`--answers` times, each a new process: its answer and its stats line's counts (tokens, forwards, drafts) must be
the same every time. Run it on a quiet machine, after one run of the command has built the cache. Ends with one
JSON line.

    python benchmarks/start_up.py [--runs 5] [--answers 3] [--busy 0]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import time
from collections import defaultdict

from harness import cpu_name

MAIN_PROMPT = "Write a Python function that returns the square of a number."
"""The README's main command's prompt."""
STATS = re.compile(r"\[(\w+) \| tokens (\d+) \| forwards (\d+) .*?drafts accepted (\d+)/(\d+)")


def first_token_seconds(prompt: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "refusion", "generate", prompt, "--max-new-tokens", "1"], check=True,
                   capture_output=True)
    return time.perf_counter() - start


def import_seconds(prompt: str) -> dict[str, float]:
    """Cumulative import seconds of each top-level package in one run (python -X importtime)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "refusion", "generate", prompt,
                           "--max-new-tokens", "1"], check=True, capture_output=True, text=True)
    totals: dict[str, float] = defaultdict(float)
    for line in done.stderr.splitlines():
        fields = line.split("|")
        if not line.startswith("import time:") or len(fields) != 3 or fields[1].strip() == "cumulative":
            continue
        name = fields[2].rstrip()
        if not name.startswith("  "):  # a top-level entry (nested imports are indented further)
            totals[name.strip().split(".")[0]] += int(fields[1]) / 1e6
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:8])


def answer(prompt: str) -> tuple[str, tuple]:
    done = subprocess.run([sys.executable, "-m", "refusion", "generate", prompt, "--stats"], check=True,
                          capture_output=True, text=True)
    match = STATS.search(done.stdout + done.stderr)
    counts = match.groups() if match else ()
    text = done.stdout.split("\n[")[0]
    return text, counts


def spin(stop) -> None:
    while not stop.is_set():
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--answers", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound processes running beside every command")
    args = parser.parse_args()
    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    try:
        answer(MAIN_PROMPT)  # the cache is built (and the page cache warm) before anything is timed
        seconds = [first_token_seconds(MAIN_PROMPT) for _ in range(args.runs)]
        imports = import_seconds(MAIN_PROMPT)
        answers = [answer(MAIN_PROMPT) for _ in range(args.answers)]
    finally:
        stop.set()
        for p in spinners:
            p.join()
    print(json.dumps({
        "benchmark": "start_up", "cpu": cpu_name(), "busy": args.busy, "runs": args.runs,
        "first_token_seconds": {"min": min(seconds), "median": statistics.median(seconds), "all": seconds},
        "import_seconds": imports, "answers": args.answers,
        "same_answer": len({a for a, _ in answers}) == 1, "same_counts": len({c for _, c in answers}) == 1,
        "counts": answers[0][1], "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))



if __name__ == "__main__":
    main()
