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
import platform
import warnings

import torch
from harness import Decoded, Engine, add_rates, decode_interleaved, emit, identical, pooled, warm_up
from linear_kernels import prompt_groups

from refusion.config import DecodeConfig, IgnoredSetting
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

    def updates_by(label: str):
        def switch():
            mask_rows.kernel = label != ATEN
        return switch

    engines = [Engine(f"{label}:{name}", model, cfg, switch=updates_by(label)) for label, name, cfg, model in engines]
    tokenizer = models["embedded"][1]
    groups = prompt_groups(args.per_group)
    warm_up(engines, [1, 2, 3], max_new_tokens=4)

    results, everything = {}, {engine.name: [] for engine in engines}
    for group, texts in groups.items():
        decodes = decode_interleaved(engines, encode_prompts(tokenizer, texts), label=group)
        for name, mine in decodes.items():
            everything[name] += mine
        report(group, decodes, results)
    report("pooled", everything, results)
    emit({"benchmark": "drafters", "compare": args.compare, "per_group": args.per_group,
          "max_new_tokens": args.max_new_tokens, "draft_length": args.draft_length,
          "aten_updates": args.aten_updates, "threads": torch.get_num_threads(),
          "cpu": platform.processor() or platform.machine(), "results": results})


def totals_of(decodes: list[Decoded], ar: list[Decoded]) -> dict:
    """An engine's pooled decodes, its answers' likeness to AR decoding's and their repetition."""
    t = pooled(decodes, ("tokens", "forwards", "seconds"))
    t["verify"] = sum(d.stats.phase_forwards.get("verify", 0) for d in decodes)
    t["identical_to_ar"] = identical(decodes, ar)
    repetition = [distinct_4grams(list(d.sequence)) for d in decodes]
    t["distinct_4grams"] = sum(repetition) / len(decodes)
    t["looping"] = sum(r < 0.5 for r in repetition)
    t["runs_of_8"] = sum(longest_run(list(d.sequence)) >= 8 for d in decodes)
    return t

def report(group: str, decodes: dict[str, list[Decoded]], results: dict) -> None:
    """Each engine's totals with their ratios, a line per engine, filed under `group` in `results`."""
    ar = decodes["-:autoregressive"]
    totals = {name: totals_of(mine, ar) for name, mine in decodes.items()}
    base = totals["-:autoregressive"]
    for name, t in totals.items():
        add_rates(t, base)
        t["tokens_per_verify"] = t["tokens"] / t["verify"] if t["verify"] else None
        results.setdefault(group, {})[name] = t
        label, engine = name.split(":", 1)
        per_verify = f"{t['tokens_per_verify']:5.2f}" if t["tokens_per_verify"] else "    -"
        print(f"{group:11s} {label:10.10s} {engine:22s} TPF {t['tokens_per_forward']:5.2f}  per verify {per_verify}"
              f"  {t['tokens_per_second']:6.1f} tok/s  x{t['speed_vs_ar']:.2f} AR  "
              f"identical {t['identical_to_ar']}/{len(ar)}  distinct 4-grams {t['distinct_4grams']:.2f}  "
              f"looping {t['looping']}", flush=True)

if __name__ == "__main__":
    main()
