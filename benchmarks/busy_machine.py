"""A cached `refusion generate` on an idle machine and beside one other CPU-bound process, with the thread count
refusion chooses (refusion/cpu.py) and with every core (what torch does on its own), interleaved.

Each run is a whole command, as a user types it (start-up, a cached load of the embedded model, 48 new tokens);
the decode's own tokens/s is read off its --stats line. Ends with one JSON line.

    python benchmarks/busy_machine.py [--repeats 3] [--max-new-tokens 48]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

PROMPT = "Write a short poem about autumn leaves."
HOG = "while True: pass"
SETTINGS = {"chosen": {}, "every_core": {"OMP_NUM_THREADS": str(os.cpu_count() or 1)}}
"""Environment changes of each setting: refusion's own choice, or OpenMP on every core."""


def generate(env_changes: dict, max_new_tokens: int) -> tuple[float, float]:
    """(wall seconds of the whole command, the decode's tokens/s from its stats line)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | env_changes
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "refusion", "generate", PROMPT, "--max-new-tokens",
                          str(max_new_tokens), "--stats"], capture_output=True, text=True, env=env, check=True)
    wall = time.perf_counter() - start
    stats = next(line for line in out.stdout.splitlines()[::-1] if line.startswith("["))
    return wall, float(stats.split("tokens/s ")[1].split()[0])


def run(busy: bool, env_changes: dict, max_new_tokens: int) -> tuple[float, float]:
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if busy else None
    try:
        if hog is not None:
            time.sleep(0.3)
        return generate(env_changes, max_new_tokens)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    generate({}, 8)  # builds the model cache if needed
    runs = {f"{load}_{name}": [] for load in ("idle", "busy") for name in SETTINGS}
    for _ in range(args.repeats):  # interleaved, so that drift hits every setting alike
        for key in runs:
            load, name = key.split("_", 1)
            runs[key].append(run(load == "busy", SETTINGS[name], args.max_new_tokens))
    medians = {key: {"wall_seconds": statistics.median(w for w, _ in r), "tokens_per_second":
                     statistics.median(t for _, t in r)} for key, r in runs.items()}
    slowdown = {name: {"wall": medians[f"busy_{name}"]["wall_seconds"] / medians[f"idle_{name}"]["wall_seconds"],
                       "decode": medians[f"idle_{name}"]["tokens_per_second"]
                       / medians[f"busy_{name}"]["tokens_per_second"]} for name in SETTINGS}
    for key, m in medians.items():
        print(f"{key:18s} {m['wall_seconds']:6.2f} s  {m['tokens_per_second']:6.1f} tokens/s")
    print(json.dumps({"benchmark": "busy_machine", "cores": os.cpu_count(), "machine": platform.machine(),
                      "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "medians": medians,
                      "busy_slowdown": slowdown, "runs": runs, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))


if __name__ == "__main__":
    main()
