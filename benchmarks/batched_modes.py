"""The embedded model decoding requests together: AR and the preset's exact mode at batch 1 and at batch B.

The held-out prompt groups of `linear_kernels.py` (GSM8K, ARC-Challenge, MBPP past every tuning prompt, the held-out
open-ended and copy-heavy requests), each group decoded in batches of B of its own prompts and one prompt at a time,
as `refusion.generate` decodes a list of prompts (a server's dynamic batch does the same). The modes take turns batch
by batch, `--repeats` times; each mode's fastest pass counts. Reported per group and pooled: tokens/s of each mode at
each batch size, the exact mode's ratio to AR at the same batch size, and how many of its answers equal AR's (its
promise, in a batch as alone). Ends with one JSON line.

    python benchmarks/batched_modes.py [--per-group 4] [--batch 4] [--max-new-tokens 128] [--dtype float32]
                                       [--repeats 2]
"""

from __future__ import annotations

import argparse

from harness import conditions, decode_batches, emit
from linear_kernels import prompt_groups

import refusion
from refusion.model.embedded import PRESET_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: refusion.load's choice)")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    model, tokenizer = refusion.load(dtype=args.dtype)
    preset = refusion.DecodeConfig.from_preset(PRESET_NAME, max_new_tokens=args.max_new_tokens)
    modes = {"ar": preset.for_strategy("autoregressive"), "exact": preset}
    groups = {name: refusion.encode_prompts(tokenizer, texts) for name, texts in prompt_groups(args.per_group).items()}
    refusion.generate(model, groups["gsm8k"][:2], preset.replace(max_new_tokens=8))  # kernels choose their code
    batches = (1, args.batch)
    runs = {}  # (group, mode, batch) -> (best seconds, tokens, answers)
    for _ in range(args.repeats):
        for name, prompts in groups.items():
            for batch in batches:
                for mode, cfg in modes.items():
                    run = decode_batches(model, prompts, cfg, batch, clock="wall")
                    seconds, tokens, answers = run["seconds"], run["tokens"], run["sequences"]
                    key = (name, mode, batch)
                    runs[key] = (min(seconds, runs[key][0]) if key in runs else seconds, tokens, answers)
    summary = {}
    for name in [*groups, "all"]:
        names = list(groups) if name == "all" else [name]
        row = {}
        for batch in batches:
            for mode in modes:
                seconds = sum(runs[(g, mode, batch)][0] for g in names)
                tokens = sum(runs[(g, mode, batch)][1] for g in names)
                row[f"{mode}/b{batch}"] = round(tokens / seconds, 1)
            row[f"exact_vs_ar/b{batch}"] = round(row[f"exact/b{batch}"] / row[f"ar/b{batch}"], 3)
            same = sum(a == b for g in names for a, b in zip(runs[(g, "exact", batch)][2], runs[(g, "ar", 1)][2]))
            row[f"exact_equal_ar_alone/b{batch}"] = f"{same}/{sum(len(groups[g]) for g in names)}"
        summary[name] = row
        print(name, row)
    environment = conditions()
    emit({"benchmark": "batched_modes", "dtype": str(model.dtype), "per_group": args.per_group,
          "batch": args.batch, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
          "threads": environment["threads"], "machine": environment["machine"], "summary": summary,
          "time": environment["time"]})

if __name__ == "__main__":
    main()
