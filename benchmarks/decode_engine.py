"""Decoding-engine benchmark: batching gain, time outside forwards, fused planning, KV reuse vs recompute.

Everything is measured in one run on the same model and prompts (these machines are noisy): a randomly
initialised ~100M-parameter Llama (SmolLM2-135M's shape), ReFusion and AR decoding, batch 1 vs batch B.
Plan and infill runs four ways: the default (fused planning where the measured forward costs say it pays,
`decode.costs`), always fused (a model refusion did not prepare), unfused, and unfused through transformers'
forward instead of `model.compact` and with plain products (the engine as it was before all three). The linear
layers take the kernel `refusion.prepare` would choose (`--linear`, default auto: MKL-packed fp32 products where
they give F.linear's bits, `model.sgemm`). The modes take turns repeat by repeat, so a drift of the machine touches
them alike. Ends with one JSON line.

    python benchmarks/decode_engine.py [--batch 8] [--max-new-tokens 64] [--dtype bfloat16] [--repeats 2]
                                       [--linear auto]
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time

import torch
from harness import decode_batches, emit
from transformers import LlamaConfig, LlamaForCausalLM

import refusion
from refusion.decode.costs import measure
from refusion.model.kernels.choice import choose_linear_kernel
from refusion.model.kernels.registry import LINEAR_CHOICES as LINEAR_KERNELS
from refusion.model.setup import plain_setup


def build_model(dtype: torch.dtype, seed: int = 0):
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True, eos_token_id=2)
    config.mask_token_id = config.vocab_size - 1
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # random init gives near-uniform logits; sharpen so thresholds are crossed both ways
        model.model.norm.weight.mul_(30.0)
    return model


def best_of(runs: list[dict]) -> dict:
    """The fastest of a mode's runs, with its rates and the median time."""
    best = dict(min(runs, key=lambda r: r["seconds"]))
    return dict(best, tokens_per_second=best["tokens"] / best["seconds"],
                outside_forward_fraction=1 - best["forward_seconds"] / best["seconds"],
                median_seconds=statistics.median(r["seconds"] for r in runs))


@contextlib.contextmanager
def plain_products(model):
    """The model's linear layers as nn.Linear (F.linear) inside the block, their kernels restored after it."""
    switched = {m: type(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for m in switched:
        m.__class__ = torch.nn.Linear
    try:
        yield
    finally:
        for m, kind in switched.items():
            m.__class__ = kind


def hf_generate(model, prompts, max_new_tokens: int, repeats: int) -> dict:
    """transformers' own greedy `generate`, one prompt at a time: the reference point for the AR baseline."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
        best = min(best, time.perf_counter() - start)
    tokens = max_new_tokens * len(prompts)
    return dict(tokens=tokens, seconds=best, tokens_per_second=tokens / best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--slot-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--linear", default="auto", choices=LINEAR_KERNELS[:-1],
                        help="the engine's linear kernel, as refusion.prepare chooses it (the stand-in: plain)")
    args = parser.parse_args()

    model = build_model(getattr(torch, args.dtype))
    linear, why = choose_linear_kernel(model, args.linear)
    print(f"linear kernel: {linear} ({why})")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49000, (int(n),), generator=gen).tolist()
               for n in torch.randint(24, 64, (args.batch,), generator=gen)]
    base = refusion.DecodeConfig(max_new_tokens=args.max_new_tokens, slot_size=args.slot_size,
                                 block_size=args.block_size, slot_threshold=0.5, token_threshold=0.3, eos_token_id=[])
    for context in (contextlib.nullcontext(), plain_products(model)):  # warm-up: kernels choose their code
        with context:
            refusion.generate(model, prompts[:2], base.replace(max_new_tokens=8))
            refusion.generate(model, prompts[:2], base.for_strategy("autoregressive").replace(max_new_tokens=8))

    # what `refusion.prepare` measures: the cost of each forward width (cost-aware fused planning); the
    # "always fused" mode decodes without it, as a model refusion did not prepare does
    costs = measure(model, plain_setup(model))
    with_costs, without_costs = plain_setup(model).replace(forward_costs=costs), plain_setup(model)
    transformers_forward = with_costs.replace(compact=False)  # the engine before model/compact.py
    print("forward costs:", costs.describe() if costs else None)
    modes = {"refusion": base, "refusion_always_fused": base, "refusion_unfused": base.replace(fused_plan=False),
             "refusion_unfused_transformers": base.replace(fused_plan=False),
             "refusion_recompute": base.replace(kv_cache="recompute"),
             "speculative": base.for_strategy("speculative").replace(predraft=True),
             "autoregressive": base.for_strategy("autoregressive")}
    batches = (1, args.batch)
    runs = {name: {b: [] for b in batches} for name in modes}
    for _ in range(args.repeats):  # the modes take turns: each repeat runs every mode once
        for name, cfg in modes.items():
            setup = {"refusion_always_fused": without_costs,
                     "refusion_unfused_transformers": transformers_forward}.get(name, with_costs)
            stand_in = name == "refusion_unfused_transformers"  # the engine before: plain products too
            with plain_products(model) if stand_in else contextlib.nullcontext():
                for b in batches:
                    runs[name][b].append(decode_batches(model, prompts, cfg, b, setup))
    results = {}
    for name in modes:
        results[name] = {f"batch_{b}": best_of(runs[name][b]) for b in batches}
        results[name]["batch_speedup"] = (results[name][f"batch_{args.batch}"]["tokens_per_second"]
                                          / results[name]["batch_1"]["tokens_per_second"])
    baseline = {b: results["refusion_unfused_transformers"][b]["sequences"] for b in ("batch_1", f"batch_{args.batch}")}
    for name, r in results.items():  # plan and infill's variants decode the same tokens (the promise), checked
        for b, sequences in baseline.items():
            mine = r[b].pop("sequences")
            if name.startswith("refusion"):
                r[b]["identical_to_unfused_transformers"] = mine == sequences
    with plain_products(model):  # transformers as it comes
        results["transformers_generate"] = {"batch_1": hf_generate(model, prompts, args.max_new_tokens, args.repeats)}
    b1 = "batch_1"
    summary = {
        "benchmark": "decode_engine", "model": "random Llama, SmolLM2-135M shape", "dtype": args.dtype,
        "batch": args.batch, "max_new_tokens": args.max_new_tokens, "linear": linear, "slot_size": args.slot_size,
        "block_size": args.block_size, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.machine(), "results": results,
        "fused_plan_forward_saving_batch_1": 1 - results["refusion"][b1]["forwards"]
        / results["refusion_unfused"][b1]["forwards"],
        "fused_over_unfused_tokens_per_second_batch_1": results["refusion"][b1]["tokens_per_second"]
        / results["refusion_unfused"][b1]["tokens_per_second"],
        "default_over_unfused_tokens_per_second": {
            b: results["refusion"][b]["tokens_per_second"] / results["refusion_unfused"][b]["tokens_per_second"]
            for b in (b1, f"batch_{args.batch}")},
        "default_over_unfused_transformers_forward": {
            b: results["refusion"][b]["tokens_per_second"]
            / results["refusion_unfused_transformers"][b]["tokens_per_second"] for b in (b1, f"batch_{args.batch}")},
        "reuse_over_recompute_tokens_per_second_batch_1": results["refusion"][b1]["tokens_per_second"]
        / results["refusion_recompute"][b1]["tokens_per_second"],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for name, r in results.items():
        if "batch_speedup" not in r:
            print(f"{name:20s} batch 1 {r[b1]['tokens_per_second']:7.1f} tok/s")
            continue
        print(f"{name:20s} batch 1 {r[b1]['tokens_per_second']:7.1f} tok/s ({r[b1]['forwards']} forwards)  batch {args.batch} "
              f"{r[f'batch_{args.batch}']['tokens_per_second']:7.1f} tok/s  x{r['batch_speedup']:.2f}  "
              f"outside forwards {100 * r[f'batch_{args.batch}']['outside_forward_fraction']:.1f}% / "
              f"{100 * r[b1]['outside_forward_fraction']:.1f}%")
    emit(summary)


if __name__ == "__main__":
    main()
