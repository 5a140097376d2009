"""Start-up of the command line, as a user meets it: the README's main command timed from outside, whole and to its
first token, cold (`--keep-alive 0`: the model loads in the command's own process), warm (the resident engine holds
the model: the command is a thin client) and llama.cpp's `llama-completion` beside them on the same GGUF file and
the same chat-rendered prompt; each command's peak memory (its own process: a warm command's engine is reported
apart, idle); the engine's start on first use; and whether every process prints the same answer and counts.

Rounds are interleaved (cold, warm, llama.cpp, one after another, `--runs` times); "first token" is the whole
command with one new token (`--max-new-tokens 1`, llama.cpp `-n 1`). The engine lives in a temporary directory
and is stopped at the end. Run it on a quiet machine, after one run of the command has built the model cache and
the native layers. Ends with one JSON line.

    python benchmarks/start_up.py [--runs 5] [--llama-cpp DIR] [--llama-no-repack]

llama.cpp from PyPI's source package (see benchmarks/linear_kernels.py for the build; `--llama-cpp DIR` is its
build/bin, holding llama-completion).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness import cpu_name, exit_on_sigterm

MAIN_PROMPT = "Write a Python function that returns the square of a number."
"""The README's main command's prompt."""
STATS = re.compile(r"\[(\w+) \| tokens (\d+) \| forwards (\d+) .*?drafts accepted (\d+)/(\d+)")
LLAMA_TOKENS = 40
"""llama.cpp's answer length: the main command's answer (40 tokens, EOS included)."""


LAUNCHER = """
import os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\nLAUNCHED {time.perf_counter() - start} {usage.ru_maxrss}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""Runs one command and reports its wall seconds and its own peak memory. A small process of its own (`python -S`):
the peak wait4 reports can include the memory of the process that forked the command, so this benchmark (which
holds a model for llama.cpp's prompt) never forks a timed command itself."""


def timed(command: list[str], env: dict | None = None) -> dict:
    """Run a command to its end: wall seconds, its own peak resident memory (MiB) and what it printed."""
    done = subprocess.run([sys.executable, "-S", "-c", LAUNCHER, *command], capture_output=True, text=True, env=env)
    err, _, launched = done.stderr.rpartition("\nLAUNCHED ")
    if done.returncode or not launched:
        raise SystemExit(f"{' '.join(command[:4])} exited {done.returncode}: {done.stderr[-2000:]}")
    seconds, peak_kb = launched.split()
    return {"seconds": float(seconds), "peak_mib": int(peak_kb) / 1024, "out": done.stdout, "err": err}


def refusion(*args: str) -> list[str]:
    return [sys.executable, "-m", "refusion", *args]


def answer_of(out: str) -> tuple[str, tuple]:
    """The answer's text and its stats line's counts."""
    match = STATS.search(out)
    lines = [line for line in out.splitlines() if not line.startswith("[")]
    return "\n".join(lines).strip(), match.groups() if match else ()


def chat_rendered(prompt: str) -> str:
    """The prompt as the embedded model's chat template renders it (what llama.cpp is given)."""
    from refusion.model.loading import load

    _, tokenizer = load()
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=False)


def llama_command(binary: Path, gguf: Path, text: str, tokens: int, threads: int, repack: bool) -> list[str]:
    command = [str(binary), "-m", str(gguf), "-p", text, "-n", str(tokens), "-t", str(threads), "--temp", "0",
               "-no-cnv", "-s", "0", "--no-display-prompt"]
    return command + ([] if repack else ["--no-repack"])


def summary(values: list[float]) -> dict:
    return {"min": round(min(values), 3), "median": round(statistics.median(values), 3)}


def import_seconds(prompt: str, env: dict) -> dict[str, float]:
    """Cumulative import seconds of each top-level package in one cold run (python -X importtime)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "refusion", "generate", prompt,
                           "--max-new-tokens", "1"], check=True, capture_output=True, text=True, env=env)
    totals: dict[str, float] = defaultdict(float)
    for line in done.stderr.splitlines():
        fields = line.split("|")
        if not line.startswith("import time:") or len(fields) != 3 or fields[1].strip() == "cumulative":
            continue
        name = fields[2].rstrip()
        if not name.startswith("  "):  # a top-level entry (nested imports are indented further)
            totals[name.strip().split(".")[0]] += int(fields[1]) / 1e6
    return dict(sorted(totals.items(), key=lambda kv: -kv[1])[:8])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--llama-cpp", default=None, metavar="DIR", help="a llama.cpp build's bin directory")
    parser.add_argument("--llama-no-repack", action="store_true",
                        help="llama.cpp without its weight repacking (a CPU where repacking fails)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's threads")
    parser.add_argument("--linear", default=None, help="the refusion commands' --linear (default: theirs, auto)")
    args = parser.parse_args()
    exit_on_sigterm()
    directory = tempfile.mkdtemp(prefix="refusion-engine-bench-")
    env = {**os.environ, "REFUSION_ENGINE_DIR": directory, "REFUSION_KEEP_ALIVE": "10m"}
    cold_env = {**env, "REFUSION_KEEP_ALIVE": "0"}
    kernel = ["--linear", args.linear] if args.linear else []
    main_command = ["generate", MAIN_PROMPT, "--stats", *kernel]
    first_command = ["generate", MAIN_PROMPT, "--max-new-tokens", "1", *kernel]
    binary = Path(args.llama_cpp) / "llama-completion" if args.llama_cpp else None
    rows: dict[str, list[dict]] = defaultdict(list)
    try:
        timed(refusion(*main_command), cold_env)  # the caches are built and the page cache warm before timing
        first_use = timed(refusion(*main_command), env)  # starts the engine: its start on first use
        engine_pid = json.loads(timed([sys.executable, "-c", ENGINE_PID], env)["out"])
        if binary is not None:
            from refusion.model.loading import smollm2_gguf_path

            text, gguf = chat_rendered(MAIN_PROMPT), smollm2_gguf_path()
            timed(llama_command(binary, gguf, text, LLAMA_TOKENS, args.threads, not args.llama_no_repack))
        for _ in range(args.runs):  # interleaved: cold, warm, llama.cpp
            rows["cold"].append(timed(refusion(*main_command), cold_env))
            rows["cold_first_token"].append(timed(refusion(*first_command), cold_env))
            rows["warm"].append(timed(refusion(*main_command), env))
            rows["warm_first_token"].append(timed(refusion(*first_command), env))
            if binary is not None:
                repack = not args.llama_no_repack
                rows["llama.cpp"].append(timed(llama_command(binary, gguf, text, LLAMA_TOKENS, args.threads, repack)))
                rows["llama.cpp_first_token"].append(timed(llama_command(binary, gguf, text, 1, args.threads, repack)))
        engine_idle_mib = process_rss_mib(engine_pid)
        imports = import_seconds(MAIN_PROMPT, cold_env)
    finally:
        subprocess.run(refusion("stop"), env=env, capture_output=True)
    answers = {name: {answer_of(r["out"]) for r in rows[name]} for name in ("cold", "warm")}
    report = {
        "benchmark": "start_up", "cpu": cpu_name(), "runs": args.runs, "threads": args.threads, "linear": args.linear,
        "llama_repack": not args.llama_no_repack if binary else None,
        "seconds": {name: summary([r["seconds"] for r in runs]) for name, runs in rows.items()},
        "peak_mib": {name: summary([r["peak_mib"] for r in runs]) for name, runs in rows.items()},
        "engine_first_use_seconds": round(first_use["seconds"], 3), "engine_idle_mib": engine_idle_mib,
        "cold_import_seconds": imports,
        "same_answer_and_counts": len(answers["cold"] | answers["warm"]) == 1,
        "counts": sorted(answers["warm"])[0][1] if answers["warm"] else None,
        "llama_answer": rows["llama.cpp"][0]["out"].strip()[:200] if rows.get("llama.cpp") else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
    print(json.dumps(report))


ENGINE_PID = """
import json
from refusion.engine.client import running
print(json.dumps(running().status()["pid"]))
"""


def process_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


if __name__ == "__main__":
    main()
