"""Accuracy, tokens per forward, draft acceptance and speed over AR of each decoding strategy at several checkpoints.

Each MODEL is anything `refusion.load` takes: a model directory, or an adapter directory such as
runs/x/checkpoints/step-0000100/adapter of a LoRA run. Every checkpoint decodes the same first N problems of
the task with both strategies and the same settings. Accuracy and tokens/forward do not depend on the batch
size (decoding a batch equals decoding one prompt at a time), so the curve is measured batched for speed;
tokens/s is printed but is not the batch-1 figure. One JSON line per checkpoint, then a markdown table.

    python benchmarks/learning_curve.py runs/a/checkpoints/step-0000200/adapter runs/a/adapter \
        --task gsm8k --limit 50 --batch-size 16 --preset refusion-smol --label "teacher 200" --label "teacher 400" \
        [--strategies refusion,speculative,autoregressive]
"""

from __future__ import annotations

import argparse
import json

import refusion
from refusion.eval.runner import EvalSettings, evaluate


def curve_point(path: str, args: argparse.Namespace) -> dict:
    model, tokenizer = refusion.load(path, dtype=args.dtype)
    settings = EvalSettings(tasks=[args.task], strategies=args.strategies.split(","), limit=args.limit,
                            batch_size=args.batch_size, preset=args.preset, max_new_tokens=args.max_new_tokens,
                            progress=False)
    results = evaluate(model, tokenizer, settings)["results"][args.task]
    keys = ("accuracy", "tokens_per_forward", "mean_generated_length", "eos_rate", "tokens_per_second",
            "draft_acceptance")
    return {strategy: {k: results[strategy][k] for k in keys} for strategy in settings.strategies}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="MODEL")
    parser.add_argument("--label", action="append", default=None, help="name of each MODEL, in order")
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--preset", default=None, help="decoding preset (default: the task's)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--strategies", default="refusion,speculative,autoregressive")
    args = parser.parse_args()
    labels = args.label or args.models
    if len(labels) != len(args.models):
        parser.error(f"{len(labels)} --label for {len(args.models)} models")
    rows = []
    for label, path in zip(labels, args.models):
        point = {"label": label, "model": path, **curve_point(path, args)}
        rows.append(point)
        print(json.dumps(point), flush=True)
    strategies = args.strategies.split(",")
    baseline = "autoregressive" if "autoregressive" in strategies else None
    print(f"\n(first {args.limit} of {args.task}; speed = tokens/s over {baseline or 'n/a'}'s, batched)\n| checkpoint | "
          + " | ".join(f"{s} acc. | {s} TPF | {s} accepted | {s} speed" for s in strategies) + " |")
    print("|---|" + "---|---|---|---|" * len(strategies))
    for r in rows:
        print(f"| {r['label']} | " + " | ".join(_cells(r, s, baseline) for s in strategies) + " |")


def _cells(row: dict, strategy: str, baseline: str | None) -> str:
    m = row[strategy]
    accepted = "-" if m["draft_acceptance"] is None else f"{100 * m['draft_acceptance']:.0f} %"
    speed = f"{m['tokens_per_second'] / row[baseline]['tokens_per_second']:.2f}x" if baseline else "-"
    return f"{100 * m['accuracy']:.1f} % | {m['tokens_per_forward']:.2f} | {accepted} | {speed}"

if __name__ == "__main__":
    main()
