"""The embedded model's drafters side by side on held-out prompts, per prompt group, in one run, batch 1.

The embedded model and, with `--compare DIR`, the same base under another mask-gated adapter (e.g. an earlier
version's) are loaded; for every prompt, back to back (so machine noise hits every mode alike), each decodes it:
AR decoding and the embedded preset's exact mode (drafts copied from the text and the draft table, no masks) once,
since a mask-gated adapter leaves both the base's; then, per adapter, the exact mode drafting from masks alone
(`draft_length` d, no copies), the same with pre-drafts (a chain of masks per possible acceptance length), copies
and masks (masks where nothing can be copied), and plan and infill (the preset's settings); with `--aten-updates`,
each of those also with the embedded adapter's mask updates computed by ATen's products instead of the native
loops (`gated_lora.mask_update`), labelled `aten`. Reported per prompt group (and pooled over the groups) and
mode: tokens, tokens per forward and per verify forward, tokens/s, the ratio to AR, how many outputs equal AR
decoding's, and how repetitive the answers are (plan and infill's are its own: the mean share of distinct 4-grams
per answer, the answers under half distinct ("looping"), and those with one token 8 or more times in a row). The
prompts are `linear_kernels.prompt_groups`: none of the tuning prompts (docs/BENCHMARKS.md, "Prompts"). Ends with
one JSON line.

    python benchmarks/drafters.py [--compare runs/v2] [--per-group 6] [--max-new-tokens 128] [--draft-length 3]
                                  [--modes masks_d3,plan_and_infill] [--slot-thresholds 0.3] [--aten-updates]
"""

from __future__ import annotations

import argparse
import json
import platform
import warnings

import torch
from linear_kernels import prompt_groups

from refusion.config import DecodeConfig, IgnoredSetting
from refusion.decode.loop import generate
from refusion.model.embedded import default_decode_settings
from refusion.model.kernels.gated_lora import mask_rows_of
from refusion.model.loading import encode_prompts, load

ATEN = "aten"
"""The label of the modes run with `--aten-updates` (the embedded adapter's mask updates by ATen's products)."""


def modes(preset: DecodeConfig, d: int, slot_thresholds: tuple[float, ...] = ()) -> dict[str, DecodeConfig]:
    """Per adapter: the modes whose drafts come from its masks (plan and infill also with each of
    `slot_thresholds` in place of the preset's)."""
    masks = preset.replace(strategy="speculative", draft_length=d, lookup_length=0, table_length=0, predraft=False)
    plan_and_infill = preset.replace(strategy="refusion")
    return {f"masks_d{d}": masks, f"masks_d{d}_predraft": masks.replace(predraft=True),
            f"copies_masks_d{d}": preset.replace(strategy="speculative", draft_length=d),
            "plan_and_infill": plan_and_infill,
            **{f"plan_and_infill_s{t:g}": plan_and_infill.replace(slot_threshold=t) for t in slot_thresholds}}


def distinct_4grams(ids: list[int]) -> float:
    """The share of an answer's 4-grams that are distinct: near 1 for varied text, low for an answer that loops."""
    grams = [tuple(ids[i:i + 4]) for i in range(len(ids) - 3)]
    return len(set(grams)) / len(grams) if grams else 1.0


def longest_run(ids: list[int]) -> int:
    """The longest run of one token repeated back to back."""
    best = run = 0
    for i, token in enumerate(ids):
        run = run + 1 if i and token == ids[i - 1] else 1
        best = max(best, run)
    return best


def main() -> None:
    warnings.filterwarnings("ignore", category=IgnoredSetting)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", default=None, metavar="DIR", help="another mask-gated adapter of the same base")
    parser.add_argument("--per-group", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft-length", type=int, default=3)
    parser.add_argument("--modes", default=None, help="comma-separated subset of the per-adapter modes (masks_dD, "
                        "masks_dD_predraft, copies_masks_dD, plan_and_infill, plan_and_infill_sT; default: all)")
    parser.add_argument("--slot-thresholds", default="", help="comma-separated slot thresholds: plan and infill "
                        "also with each (modes plan_and_infill_sT)")
    parser.add_argument("--aten-updates", action="store_true", help="each adapter mode also with the embedded "
                        "adapter's mask updates by ATen's products (label aten), as before the native loops")
    args = parser.parse_args()
    try:
        slot_thresholds = tuple(float(t) for t in args.slot_thresholds.split(",") if t)
    except ValueError:
        parser.error(f"--slot-thresholds: {args.slot_thresholds!r} is not a comma-separated list of numbers")

    models = {"embedded": load()}
    if args.compare:
        models[args.compare] = load(args.compare)
    preset = DecodeConfig(max_new_tokens=args.max_new_tokens, **default_decode_settings())
    base_model = models["embedded"][0]  # AR and the preset use no mask: the base's, whatever the adapter
    engines = [("-", "autoregressive", preset.replace(strategy="autoregressive"), base_model),
               ("-", "exact", preset, base_model)]
    chosen = modes(preset, args.draft_length, slot_thresholds)
    if args.modes:
        unknown = set(args.modes.split(",")) - set(chosen)
        if unknown:
            parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (choose from {', '.join(chosen)})")
        chosen = {name: cfg for name, cfg in chosen.items() if name in args.modes.split(",")}
    engines += [(label, name, cfg, model) for label, (model, _) in models.items() for name, cfg in chosen.items()]
    if args.aten_updates:
        engines += [(ATEN, name, cfg, base_model) for name, cfg in chosen.items()]
    mask_rows = mask_rows_of(base_model)  # the embedded adapter's: `--aten-updates` switches its updates
    tokenizer = models["embedded"][1]
    groups = prompt_groups(args.per_group)
    for label, _, cfg, model in engines:  # warm-up
        mask_rows.kernel = label != ATEN
        generate(model, [[1, 2, 3]], cfg.replace(max_new_tokens=4))

    results, pooled_totals = {}, {}
    for group, texts in groups.items():
        totals = {(label, name): dict(tokens=0, forwards=0, verify=0, seconds=0.0, identical_to_ar=0,
                                      distinct_4grams=0.0, looping=0, runs_of_8=0) for label, name, _, _ in engines}
        for i, prompt in enumerate(encode_prompts(tokenizer, texts)):
            ar = None
            for label, name, cfg, model in engines:
                mask_rows.kernel = label != ATEN
                out = generate(model, [prompt], cfg)
                s, t = out.stats.per_sequence[0], totals[label, name]
                ar = out.sequences[0] if name == "autoregressive" else ar
                t["tokens"] += s.tokens
                t["forwards"] += s.forwards
                t["verify"] += s.phase_forwards.get("verify", 0)
                t["seconds"] += s.seconds
                t["identical_to_ar"] += out.sequences[0] == ar
                answer = list(out.sequences[0])
                repetition = distinct_4grams(answer)
                t["distinct_4grams"] += repetition / len(texts)
                t["looping"] += repetition < 0.5
                t["runs_of_8"] += longest_run(answer) >= 8
            print(f"{group} {i + 1}/{len(texts)}", flush=True)
        for key, t in totals.items():  # before `report` adds the ratios
            pooled = pooled_totals.setdefault(key, dict.fromkeys(t, 0))
            for field, value in t.items():
                pooled[field] += value * len(texts) if field == "distinct_4grams" else value
        report(group, totals, len(texts), results)
    count = sum(len(texts) for texts in groups.values())
    for t in pooled_totals.values():
        t["distinct_4grams"] /= count
    report("pooled", pooled_totals, count, results)
    print(json.dumps({"benchmark": "drafters", "compare": args.compare, "per_group": args.per_group,
                      "max_new_tokens": args.max_new_tokens, "draft_length": args.draft_length,
                      "aten_updates": args.aten_updates, "threads": torch.get_num_threads(),
                      "cpu": platform.processor() or platform.machine(), "results": results}))


def report(group: str, totals: dict, prompts: int, results: dict) -> None:
    """Add the ratios to each mode's totals, print a line per mode, and file them under `group` in `results`."""
    base = totals["-", "autoregressive"]
    for (label, name), t in totals.items():
        t["tokens_per_forward"] = t["tokens"] / t["forwards"]
        t["tokens_per_verify"] = t["tokens"] / t["verify"] if t["verify"] else None
        t["tokens_per_second"] = t["tokens"] / t["seconds"]
        t["speed_vs_ar"] = t["tokens_per_second"] / (base["tokens"] / base["seconds"])
        results.setdefault(group, {})[f"{label}:{name}"] = t
        per_verify = f"{t['tokens_per_verify']:5.2f}" if t["tokens_per_verify"] else "    -"
        print(f"{group:11s} {label:10.10s} {name:22s} TPF {t['tokens_per_forward']:5.2f}  per verify {per_verify}"
              f"  {t['tokens_per_second']:6.1f} tok/s  x{t['speed_vs_ar']:.2f} AR  "
              f"identical {t['identical_to_ar']}/{prompts}  distinct 4-grams {t['distinct_4grams']:.2f}  "
              f"looping {t['looping']}", flush=True)


if __name__ == "__main__":
    main()
