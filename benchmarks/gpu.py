"""The GPU path: what a forward costs by width, what a step costs outside the model, and tokens/s of every mode.

Nothing is downloaded: the model is randomly initialised with Qwen3-8B's configuration (`--config qwen3-8b`, bf16,
~16 GB on the GPU) or a small one (`--config small`, what the test suite runs on the CPU in seconds). It reports,
measured in one run on one device:

* milliseconds per forward of 1, 8, 32 and 128 new tokens over a cached prompt (`--widths`), and each width's
  cost relative to one token (what plan and infill and the exact mode pay for their wider forwards);
* per decoding mode of refusion (AR, plan and infill, the exact mode): tokens/s, tokens per forward, and the time
  of a step spent outside the model's forwards (the engine's own work), as a fraction and in milliseconds;
* transformers' `generate` (greedy, eager) and, with `--compile`, with its static cache and `torch.compile`
  (`mode="reduce-overhead"`, CUDA graphs, on a GPU): the AR numbers users would get without refusion;
* with `--compile`, refusion's modes again with compiled forwards (`refusion.model.compiled`), per compiler
  backend of `--compile-backends` ("inductor": generated kernels, CUDA graphs on a GPU; "cudagraphs": the eager
  kernels replayed as CUDA graphs, compiles in seconds): the first (compiling) decode's seconds, then tokens/s, and
  how many graphs were compiled while timing (0 when the warm-up decode met every shape). `--compile-budget` stops
  starting compiled runs after that many seconds. Ends with one JSON line.

    python benchmarks/gpu.py                              # Qwen3-8B shape on the GPU, bf16, ~5 minutes
    python benchmarks/gpu.py --config small --device cpu  # the same measurements on a small model
    python benchmarks/gpu.py --no-eager --compile-runs inductor:plan_and_infill  # widths, transformers compiled, one mode
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

import torch
from harness import decode_batches, emit
from torch._dynamo.utils import counters
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import refusion
from refusion.config import IgnoredSetting
from refusion.decode.cache import cache_keyword
from refusion.model.compiled import compile_model
from refusion.model.setup import setup_of

CONFIGS = {
    "qwen3-8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, tie_word_embeddings=False),
    "small": dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32, max_position_embeddings=4096,
                  tie_word_embeddings=False),
}
"""Qwen3 configurations by name: Qwen3-8B's own, and a small one of the same family."""


COMPILE_RUNS = ("inductor:autoregressive", "inductor:exact", "inductor:plan_and_infill", "cudagraphs:autoregressive",
                "cudagraphs:exact", "cudagraphs:plan_and_infill")
"""refusion's compiled runs (torch.compile backend: decoding mode), in the order they are timed: inductor (what
`compile=True` runs) first. On an H200 the eager part took ~4 minutes and inductor's AR ~45 s of compiling."""


def build_model(name: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A randomly initialised Qwen3 of configuration `name`, built on `device` (no host copy of 8B weights), with
    its last vocabulary id as the mask token and sharpened logits (random weights give near-uniform ones)."""
    config = AutoConfig.for_model("qwen3", eos_token_id=2, bos_token_id=1, pad_token_id=0, **CONFIGS[name])
    config.mask_token_id = config.vocab_size - 1
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model.eval()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def forward_ms_by_width(model, device: torch.device, prompt_length: int, widths: list[int], repeats: int) -> dict:
    """Median milliseconds of a forward of `w` new tokens over a cached prompt of `prompt_length` tokens."""
    vocab = model.config.vocab_size
    prompt = torch.randint(3, vocab - 1, (1, prompt_length), device=device)
    cache = DynamicCache(config=model.config)
    keyword = cache_keyword(model)
    model(input_ids=prompt, use_cache=True, **{keyword: cache})
    out = {}
    for width in widths:
        tokens = torch.randint(3, vocab - 1, (1, width), device=device)
        positions = torch.arange(prompt_length, prompt_length + width, device=device)[None]
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            synchronize(device)
            start = time.perf_counter()
            model(input_ids=tokens, position_ids=positions, use_cache=True, logits_to_keep=width, **{keyword: cache})
            synchronize(device)
            times.append(time.perf_counter() - start)
            cache.crop(-width)  # back to the prompt alone
        out[width] = 1000 * statistics.median(times[1:])
    return {"ms": out, "relative_to_one_token": {w: ms / out[widths[0]] for w, ms in out.items()}}


def refusion_modes(max_new_tokens: int) -> dict[str, refusion.DecodeConfig]:
    base = dict(max_new_tokens=max_new_tokens, eos_token_id=[])
    return {"autoregressive": refusion.DecodeConfig(strategy="autoregressive", **base),
            "plan_and_infill": refusion.DecodeConfig(strategy="refusion", slot_size=8, block_size=32,
                                                     slot_threshold=0.5, token_threshold=0.3, **base),
            "exact": refusion.DecodeConfig(strategy="speculative", draft_length=4, **base)}


def time_refusion(model, prompts: list[list[int]], cfg: refusion.DecodeConfig, setup=None) -> dict:
    """Batch-1 decode of every prompt; tokens/s, tokens per forward and the time outside the model's forwards."""
    run = decode_batches(model, prompts, cfg, 1, setup)
    tokens, forwards, seconds = run["tokens"], run["forwards"], run["seconds"]
    outside = seconds - run["forward_seconds"]
    return {"tokens": tokens, "forwards": forwards, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "tokens_per_forward": tokens / forwards, "outside_model_fraction": outside / seconds,
            "outside_model_ms_per_step": 1000 * outside / forwards, "compiled": setup is not None}


def time_refusion_compiled(model, prompts: list[list[int]], cfg: refusion.DecodeConfig, backend: str) -> dict:
    """`time_refusion` with the forward compiled by `backend`, after a first pass over the prompts that compiles
    (its seconds are reported)."""
    setup = setup_of(model).replace(compiled=compile_model(model, backend=backend))
    counters["stats"].clear()
    start = time.perf_counter()
    for prompt in prompts:
        refusion.generate(model, [prompt], cfg, setup=setup)
    first = time.perf_counter() - start
    graphs = counters["stats"]["unique_graphs"]
    result = time_refusion(model, prompts, cfg, setup)
    return result | {"backend": backend, "first_call_seconds": first, "graphs_compiled_in_warmup": graphs,
                     "graphs_compiled_while_timing": counters["stats"]["unique_graphs"] - graphs}


@torch.inference_mode()
def time_transformers(model, prompts: list[list[int]], max_new_tokens: int, device: torch.device,
                      compiled: bool) -> dict:
    """transformers' greedy `generate`, batch 1: eager, or with its static cache and a compiled forward."""
    kwargs = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if compiled:  # transformers compiles the forward of a static-cache generate itself (CUDA graphs on a GPU)
        kwargs |= dict(cache_implementation="static")
    first = torch.tensor([prompts[0]], device=device)
    start = time.perf_counter()
    model.generate(first, **kwargs)  # warm-up (and, compiled, the compilation)
    synchronize(device)
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for prompt in prompts:
        model.generate(torch.tensor([prompt], device=device), **kwargs)
    synchronize(device)
    seconds = time.perf_counter() - start
    tokens = max_new_tokens * len(prompts)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
            "first_call_seconds": warmup, "compiled": compiled}


def profile_ar(model, prompt: list[int], tokens: int = 16) -> None:
    """Print the operators that take the host's time in refusion's AR decoding and in transformers' `generate`."""
    from torch.profiler import ProfilerActivity, profile

    cfg = refusion_modes(tokens)["autoregressive"]
    kwargs = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    for name, decode in (("refusion AR", lambda: refusion.generate(model, [prompt], cfg)),
                         ("transformers generate", lambda: model.generate(torch.tensor([prompt], device=model.device),
                                                                          **kwargs))):
        decode()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode()
        print(f"== {name}, {tokens} tokens")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14), flush=True)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="qwen3-8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--prompts", type=int, default=4, help="batch-1 prompts decoded by each mode")
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--widths", default="1,8,32,128")
    parser.add_argument("--repeats", type=int, default=10, help="timed forwards per width")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="also time transformers' static-cache compiled generate and refusion's compiled "
                             "modes (default: on a GPU)")
    parser.add_argument("--profile", action="store_true", help="print the host's operator time of AR decoding")
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                        help="time the eager decodes (refusion's modes, transformers' generate); --no-eager: only "
                             "the forwards by width and the compiled runs, for a short GPU call")
    parser.add_argument("--compile-runs", default=",".join(COMPILE_RUNS),
                        help="refusion's compiled runs, BACKEND:MODE, timed in this order")
    parser.add_argument("--compile-budget", type=float, default=200.0,
                        help="seconds after which no further compiled refusion run starts")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=IgnoredSetting)

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    compiled = args.compile if args.compile is not None else device.type == "cuda"
    widths = [int(w) for w in args.widths.split(",")]
    model = build_model(args.config, device, dtype)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.config.vocab_size - 1, (args.prompt_length,), generator=gen).tolist()
               for _ in range(args.prompts)]

    results = {"forward_by_width": forward_ms_by_width(model, device, args.prompt_length, widths, args.repeats)}
    print("forward_by_width", json.dumps(results["forward_by_width"]), flush=True)
    for name, cfg in refusion_modes(args.max_new_tokens).items() if args.eager else ():
        refusion.generate(model, prompts[:1], cfg.replace(max_new_tokens=min(8, args.max_new_tokens)))  # warm-up
        results[f"refusion_{name}"] = time_refusion(model, prompts, cfg)
        print(f"refusion_{name}", json.dumps(results[f"refusion_{name}"]), flush=True)
    if args.profile:
        profile_ar(model, prompts[0])
    if args.eager:
        results["transformers_generate"] = time_transformers(model, prompts, args.max_new_tokens, device, False)
        print("transformers_generate", json.dumps(results["transformers_generate"]), flush=True)
    if compiled:
        try:
            results["transformers_generate_compiled"] = time_transformers(model, prompts, args.max_new_tokens,
                                                                          device, True)
        except Exception as e:  # a compiler failure is a result too: say which
            results["transformers_generate_compiled"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print("transformers_generate_compiled", json.dumps(results["transformers_generate_compiled"]), flush=True)
        modes, budget_start = refusion_modes(args.max_new_tokens), time.perf_counter()
        for run in args.compile_runs.split(","):
            backend, name = run.split(":")
            key = f"refusion_{name}_compiled_{backend}"
            if time.perf_counter() - budget_start > args.compile_budget:
                results[key] = {"skipped": f"--compile-budget {args.compile_budget:.0f} s spent"}
                continue
            try:
                results[key] = time_refusion_compiled(model, prompts, modes[name], backend)
            except Exception as e:
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(key, json.dumps(results[key]), flush=True)
    ar = results.get("refusion_autoregressive", {}).get("tokens_per_second")  # eager AR: the ratios' unit
    summary = {
        "benchmark": "gpu", "config": args.config, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
        "dtype": str(dtype).removeprefix("torch."), "prompts": args.prompts, "prompt_length": args.prompt_length,
        "max_new_tokens": args.max_new_tokens, "torch": torch.__version__, "results": results,
        "speed_over_refusion_ar": {name: r["tokens_per_second"] / ar for name, r in results.items()
                                   if "tokens_per_second" in r} if ar else {},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    for name, r in results.items():
        if "tokens_per_second" in r:
            outside = (f"  outside model {100 * r['outside_model_fraction']:.0f}% "
                       f"({r['outside_model_ms_per_step']:.2f} ms/step)" if "outside_model_fraction" in r else "")
            print(f"{name:32s} {r['tokens_per_second']:8.1f} tok/s{outside}")
    print("forward ms by width: " + ", ".join(f"{w}: {ms:.2f}" for w, ms in results["forward_by_width"]["ms"].items()))
    emit(summary)
    return summary


if __name__ == "__main__":
    main()
