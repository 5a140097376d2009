"""Does AR decoding of a trained model give its base model's greedy answers? Held-out prompts, one run.

Both models decode the same first N examples of each task with the AR strategy, in the same batches and
dtype (the one `refusion.load` picks unless --dtype); the benchmark reports, per task, how many responses are
identical and both models' accuracy, as one JSON line, then a markdown table. For a mask-gated adapter
(docs/TRAINING.md, "Mask-gated adapters") every response should be identical.

    python benchmarks/ar_identity.py --task gsm8k,arc_challenge,mbpp --limit 20 --batch-size 10
"""

from __future__ import annotations

import argparse
import json

import refusion
from refusion.eval.runner import EvalSettings, evaluate
from refusion.jsonl import read_jsonl


def ar_samples(path: str | None, args: argparse.Namespace, tasks: list[str], samples_path: str) -> dict:
    model, tokenizer = refusion.load(path, dtype=args.dtype)
    settings = EvalSettings(tasks=tasks, strategies=["autoregressive"], limit=args.limit,
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, progress=False)
    document = evaluate(model, tokenizer, settings, samples_path=samples_path)
    samples = read_jsonl(samples_path)
    return {"document": document, "samples": {(s["task"], s["id"]): s for s in samples}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="the trained model (default: the embedded model)")
    parser.add_argument("--base", default="smollm2", help="its base model (default: smollm2)")
    parser.add_argument("--task", default="gsm8k,arc_challenge,mbpp")
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--workdir", default="/tmp", help="where the two sample files are written")
    args = parser.parse_args()
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    runs = {name: ar_samples(path, args, tasks, f"{args.workdir}/ar_identity_{name}.jsonl")
            for name, path in (("base", args.base), ("model", args.model))}
    report = {"benchmark": "ar_identity", "model": args.model or "embedded", "base": args.base,
              "limit": args.limit, "batch_size": args.batch_size, "dtype": runs["model"]["document"]["environment"].get("dtype"),
              "tasks": {}}
    for task in tasks:
        keys = [k for k in runs["base"]["samples"] if k[0] == task]
        same = sum(runs["base"]["samples"][k]["response"] == runs["model"]["samples"][k]["response"] for k in keys)
        report["tasks"][task] = {
            "examples": len(keys), "identical": same,
            "base_accuracy": runs["base"]["document"]["results"][task]["autoregressive"]["accuracy"],
            "model_accuracy": runs["model"]["document"]["results"][task]["autoregressive"]["accuracy"]}
    print(json.dumps(report))
    print("\n| task | identical AR answers | base accuracy | model accuracy |\n|---|---|---|---|")
    for task, r in report["tasks"].items():
        print(f"| {task} | {r['identical']}/{r['examples']} | {r['base_accuracy']:.3f} | {r['model_accuracy']:.3f} |")


if __name__ == "__main__":
    main()
