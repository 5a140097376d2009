"""Decode modes side by side on one model and one set of prompts, in one run, batch 1.

For every prompt, every mode decodes it back to back (so machine noise hits all modes alike): AR decoding
(the baseline), the exact speculative mode (single draft chain and pre-drafts), and the paper's plan and
infill with and without fused planning. Reported per mode: tokens, forwards, tokens per forward, tokens/s,
speed ratio to AR, forwards per phase, how many outputs equal AR decoding's, draft acceptance; "preset" is the
preset's own mode as `refusion generate` decodes it. Ends with one JSON line.

    python benchmarks/decode_modes.py [--model PATH|random] [--task gsm8k] [--prompts 30] [--skip 0]
                                      [--max-new-tokens 256] [--preset NAME] [--tables FILE ...] [--one-chain]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import warnings

from harness import Engine, add_rates, conditions, decode_interleaved, emit, identical, pooled, warm_up

from refusion.config import DecodeConfig, IgnoredSetting, preset
from refusion.eval.tasks import load_examples
from refusion.model.draft_table import DraftTable
from refusion.model.loading import encode_prompts, load
from refusion.model.setup import setup_of
from refusion.open_ended import SPLITS, open_ended_prompts


def modes(base: DecodeConfig, draft_lengths: list[int], draft_thresholds: list[float],
          lookup_lengths: list[int], table_lengths: list[int]) -> dict[str, DecodeConfig]:
    out = {"autoregressive": base.replace(strategy="autoregressive")}
    for d, t, lookup, table in itertools.product(draft_lengths, draft_thresholds, lookup_lengths, table_lengths):
        name = (f"speculative_d{d}" + (f"_t{t:g}" if t > 0 else "") + (f"_l{lookup}" if lookup else "")
                + (f"_n{table}" if table else ""))
        cfg = base.replace(strategy="speculative", draft_length=d, draft_threshold=t, lookup_length=lookup,
                           table_length=table)
        out[name] = cfg.replace(predraft=False)
        out[name + "_predraft"] = cfg.replace(predraft=True)
    out["refusion_fused"] = base.replace(strategy="refusion", fused_plan=True)
    out["refusion_unfused"] = base.replace(strategy="refusion", fused_plan=False)
    out["preset"] = base  # the preset's own mode and settings, as `refusion generate` decodes
    return out


def main() -> None:
    # the base config holds the settings of every mode it derives (a preset tunes several strategies)
    warnings.filterwarnings("ignore", category=IgnoredSetting)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=30)
    parser.add_argument("--task", default="gsm8k", help="the evaluation task whose prompts are decoded, or "
                        "open-ended / open-ended-test (the parts of refusion/open_ended.py's set) "
                        "(its test split, in `refusion eval`'s prompt format)")
    parser.add_argument("--skip", type=int, default=0, help="start at this example of the task")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--preset", default=None, help="ReFusion settings (default: the model's own preset)")
    parser.add_argument("--draft-lengths", default="2,4,6")
    parser.add_argument("--draft-thresholds", default="0", help="speculative modes with each draft_threshold "
                        "(0: the name without a _t suffix)")
    parser.add_argument("--lookup-lengths", default="0", help="speculative modes with each lookup_length "
                        "(0: the name without an _l suffix)")
    parser.add_argument("--table-lengths", default="0", help="speculative modes with each table_length "
                        "(0: the name without an _n suffix)")
    parser.add_argument("--modes", default=None, help="comma-separated subset of the mode names")
    parser.add_argument("--tables", nargs="+", default=[], metavar="FILE",
                        help="other draft tables (draft_table.safetensors files): every speculative mode is also run "
                             "with each of them, named with the suffix _table1, _table2, ...")
    parser.add_argument("--one-chain", action="store_true", help="also each speculative mode with the model's draft "
                        "table less its runner-ups (one chain a round, as before runner-up chains)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--attn", default=None,
                        help="attention implementation: sdpa, eager or refusion_exact (default: what load picks)")
    args = parser.parse_args()

    model, tokenizer = load(args.model, dtype=args.dtype, attn_implementation=args.attn)
    if args.task in SPLITS:
        texts = [text for _, text in open_ended_prompts(SPLITS[args.task])]
    else:
        texts = [ex.prompt for ex in load_examples(args.task, limit=args.skip + args.prompts)]
    prompts = encode_prompts(tokenizer, texts[args.skip:args.skip + args.prompts])
    settings = preset(args.preset) if args.preset else preset("refusion-smol") if args.model is None else {}
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, **settings)
    chosen = modes(base, [int(d) for d in args.draft_lengths.split(",")],
                   [float(t) for t in args.draft_thresholds.split(",")],
                   [int(n) for n in args.lookup_lengths.split(",")],
                   [int(n) for n in args.table_lengths.split(",")])
    if args.modes:
        chosen = {name: chosen[name] for name in args.modes.split(",")}
    setups = {name: setup_of(model) for name in chosen}  # the setup (draft table) each mode decodes with
    speculative = [name for name, cfg in chosen.items() if cfg.strategy == "speculative"]
    for i, path in enumerate(args.tables, 1):
        table = DraftTable.load(path)
        for name in speculative:
            chosen[f"{name}_table{i}"] = chosen[name]
            setups[f"{name}_table{i}"] = setups[name].replace(draft_table=table)
    if args.one_chain and setup_of(model).draft_table is not None:
        table = dataclasses.replace(setup_of(model).draft_table, runner_ups={})
        for name in speculative:
            chosen[f"{name}_one_chain"] = chosen[name]
            setups[f"{name}_one_chain"] = setups[name].replace(draft_table=table)
    engines = [Engine(name, model, cfg, setups[name]) for name, cfg in chosen.items()]
    warm_up(engines, prompts[0])
    decodes = decode_interleaved(engines, prompts)

    ar_decodes = decodes.get("autoregressive")
    totals = {}
    for name, mine in decodes.items():
        t = totals[name] = pooled(mine)
        t["identical_to_ar"] = identical(mine, ar_decodes) if ar_decodes else 0
    ar = totals.get("autoregressive")
    for name, t in totals.items():
        add_rates(t, ar)
        if ar:
            t["forwards_vs_ar"] = t["forwards"] / ar["forwards"]
        if t["drafted"]:
            t["draft_acceptance"] = t["accepted"] / t["drafted"]
        print(f"{name:28s} TPF {t['tokens_per_forward']:5.2f}  {t['tokens_per_second']:6.1f} tok/s  "
              f"x{t.get('speed_vs_ar', 1):.2f} AR  identical {t['identical_to_ar']}/{len(prompts)}  "
              f"forwards {t['phase_forwards']}")
    if "refusion_fused" in totals and "refusion_unfused" in totals:
        saved = 1 - totals["refusion_fused"]["forwards"] / totals["refusion_unfused"]["forwards"]
        print(f"fused planning: {100 * saved:.1f} % fewer forwards than unfused")
    emit({"benchmark": "decode_modes", "model": args.model or "refusion-smol",
          "dtype": str(next(model.parameters()).dtype), "attn": model.config._attn_implementation,
          "task": args.task, "prompts": len(prompts), "skip": args.skip, "max_new_tokens": args.max_new_tokens,
          "settings": settings, "tables": args.tables, "results": totals, **conditions()})

if __name__ == "__main__":
    main()
