"""Narrow forwards: plain `F.linear` vs weight-major `NarrowLinear` layers (without and with the row padding the
probe picks), on one model, in one run; a model whose linears are packed (row-exact bf16) is timed as loaded.

1. Cost of one forward by width (new tokens over a 200-token cached context, half of them masks when the model
   has a mask token, unless --no-masks), every kind of layers timed back to back at every width.
2. Decoding of the first N GSM8K test problems, batch 1: AR and the exact mode (draft lengths given) with both
   kinds of layers, every configuration back to back on every prompt; tokens/s and the ratio to AR with the
   same layers. Ends with one JSON line.

    python benchmarks/narrow_forwards.py [--model PATH] [--prompts 3] [--max-new-tokens 96] [--draft-lengths 1,2]
                                         [--prompts 0: forward costs only]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

import torch
from harness import Engine, add_rates, decode_interleaved, identical, pooled
from torch import nn
from transformers import DynamicCache

from refusion.config import DecodeConfig, IgnoredSetting, preset
from refusion.decode.cache import cache_keyword
from refusion.eval.tasks import load_examples
from refusion.model.kernels.narrow import NarrowLinear, row_padding, weight_major_row_times
from refusion.model.loading import encode_prompts, load

Kinds = dict[str, tuple[type, tuple[int, ...]]]
"""Each kind of linear layer compared: its class and its row padding."""


def layer_kinds(padded_rows: tuple[int, ...]) -> Kinds:
    return {"plain": (nn.Linear, ()), "narrow": (NarrowLinear, ()), "padded": (NarrowLinear, padded_rows)}


def set_linears(layers: list[nn.Linear], kind: tuple[type, tuple[int, ...]] | None) -> None:
    if kind is None:  # the layers as loaded (packed bf16 linears: nothing to compare them with)
        return
    cls, padded_rows = kind
    for layer in layers:
        layer.__class__ = cls
        layer.padded_rows = padded_rows


@torch.inference_mode()
def forward_cost(model, layers, kinds: Kinds, widths: list[int], repeats: int, context: int = 200,
                 masks: bool = True) -> dict:
    """Median milliseconds of a forward of each width, with each kind of linear layer."""
    mask_id = getattr(model.config, "mask_token_id", None) if masks else None
    generator = torch.Generator().manual_seed(0)
    cache = DynamicCache()
    with_cache = {cache_keyword(model): cache}  # worked out once, outside the timed forwards
    model(input_ids=torch.randint(100, 10000, (1, context), generator=generator), **with_cache)
    times = {kind: {w: [] for w in widths} for kind in kinds}
    for _ in range(repeats):
        for width in widths:
            ids = torch.randint(100, 10000, (1, width), generator=generator)
            if mask_id is not None:
                ids[0, width - width // 2:] = mask_id
            positions = torch.arange(context, context + width)[None]
            for kind in kinds:
                set_linears(layers, kinds[kind])
                start = time.perf_counter()
                model(input_ids=ids, position_ids=positions, **with_cache, logits_to_keep=width)
                times[kind][width].append(1000 * (time.perf_counter() - start))
                cache.crop(-width)
    return {kind: {w: statistics.median(t) for w, t in by_width.items()} for kind, by_width in times.items()}


def decoding(model, layers, kinds: Kinds, prompts: list[list[int]], configs: dict[str, DecodeConfig]) -> dict:
    """Tokens, forwards and seconds (the `generate` calls, wall clock) of each (kind, mode), every one run back to
    back on every prompt."""
    engines = [Engine(f"{kind}/{mode}", model, cfg, switch=lambda kind=kind: set_linears(layers, kinds[kind]))
               for kind in kinds for mode, cfg in configs.items()]
    decodes = decode_interleaved(engines, prompts)
    results = {}
    for kind in kinds:
        for mode in configs:
            total = pooled(decodes[f"{kind}/{mode}"], ("tokens", "forwards", "seconds"), clock="wall")
            results.setdefault(kind, {})[mode] = add_rates(total)
    for kind, by_mode in results.items():
        for mode, total in by_mode.items():
            total["speed_vs_ar_same_layers"] = total["tokens_per_second"] / by_mode["autoregressive"]["tokens_per_second"]
            total["identical_to_ar"] = identical(decodes[f"{kind}/{mode}"], decodes[f"{kind}/autoregressive"])
    first = next(iter(kinds))
    results["same_tokens_every_kind"] = all(identical(decodes[f"{kind}/{m}"], decodes[f"{first}/{m}"]) == len(prompts)
                                            for kind in kinds for m in configs)
    return results

def main() -> None:
    # the base config holds the settings of every mode it derives (a preset tunes several strategies)
    warnings.filterwarnings("ignore", category=IgnoredSetting)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model path or name (default: the embedded model)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--draft-lengths", default="1,2")
    parser.add_argument("--widths", default="1,2,3,4,6,8,12,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-masks", action="store_true", help="forward costs without masks among the new tokens")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--attn", default=None,
                        help="attention implementation: sdpa, eager or refusion_exact (default: what load picks)")
    args = parser.parse_args()

    model, tokenizer = load(args.model, dtype=args.dtype, attn_implementation=args.attn)
    layers = [m for m in model.modules() if type(m) in (nn.Linear, NarrowLinear)]
    if layers:
        padded_rows = row_padding(weight_major_row_times(layers))
        print(f"row padding the probe picks (index: rows): {padded_rows}")
        kinds = layer_kinds(padded_rows)
    else:
        padded_rows, kinds = (), {"loaded": None}
    widths = [int(w) for w in args.widths.split(",")]
    cost = forward_cost(model, layers, kinds, widths, args.repeats, masks=not args.no_masks)
    print("width " + " ".join(f"{w:>6}" for w in widths))
    for kind, by_width in cost.items():
        print(f"{kind:6s}" + " ".join(f"{by_width[w]:6.0f}" for w in widths) + "  ms")

    report = {"benchmark": "narrow_forwards", "model": args.model or "refusion-smol", "dtype": str(model.dtype),
              "attn": model.config._attn_implementation, "layers": len(layers), "padded_rows": padded_rows, "masks": not args.no_masks, "threads": torch.get_num_threads(),
              "torch": torch.__version__, "machine": platform.machine(), "forward_ms": cost}
    if args.prompts == 0:
        print(json.dumps(report | {"time": time.strftime("%Y-%m-%dT%H:%M:%S")}))
        return
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in load_examples("gsm8k", limit=args.prompts)])
    base = DecodeConfig(**preset("refusion-smol"), max_new_tokens=args.max_new_tokens)
    configs = {"autoregressive": base.replace(strategy="autoregressive")}
    for d in (int(x) for x in args.draft_lengths.split(",")):
        configs[f"exact_d{d}"] = base.replace(strategy="speculative", draft_length=d, predraft=False)
    results = decoding(model, layers, kinds, prompts, configs)
    for kind in kinds:
        for mode, r in results[kind].items():
            print(f"{kind:6s} {mode:15s} {r['tokens_per_second']:5.1f} tok/s  TPF {r['tokens_per_forward']:.2f}  "
                  f"x{r['speed_vs_ar_same_layers']:.2f} AR  identical {r['identical_to_ar']}/{len(prompts)}")
    print(json.dumps(report | {"decoding": results, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))


if __name__ == "__main__":
    main()
