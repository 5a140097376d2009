"""The embedded model's exact mode and AR decoding against transformers' own `generate` on the same weights.

"× AR" elsewhere is against refusion's row-exact AR decoding; this benchmark also puts it beside the plainest fast
AR a user of transformers runs on this machine: `model.generate` (greedy, sdpa attention, nn.Linear products) in
bf16 and in fp32, and transformers' prompt lookup (`prompt_lookup_num_tokens`, its n-gram speculation), on the
same held-out prompts (`serving.held_out_prompts`: task slices no setting was chosen on, and open-ended requests
written for the benchmarks), chat template, natural-length answers (up to `--max-new-tokens`), batch 1. Every
prompt is decoded by every engine in turn, so a drift of the machine touches them alike; each engine is warmed up
first. Reported: pooled tokens/s of each, each over refusion's AR and over the fastest transformers AR, and how
many answers equal refusion AR's token for token (bf16 products round differently in transformers' kernels, so a
few answers may part after a near-tie). Ends with one JSON line.

    python benchmarks/against_transformers.py [--per-task 4] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch
from harness import conditions, cpu_name, emit
from serving import held_out_prompts

import refusion
from refusion.model.embedded import PRESET_NAME


def transformers_generate(model, eos: list[int], lookup: int | None = None):
    """A decode function: transformers' greedy `generate` (with prompt lookup of `lookup` tokens when given)."""
    extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}

    def run(ids: list[int], max_new_tokens: int) -> list[int]:
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos[0], **extra)
        return out[0, len(ids):].tolist()

    return run


def refusion_generate(model, config):
    def run(ids: list[int], max_new_tokens: int) -> list[int]:
        return refusion.generate(model, [ids], config.replace(max_new_tokens=max_new_tokens)).sequences[0]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=4, help="held-out prompts of each task slice")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup", type=int, default=10, help="transformers' prompt_lookup_num_tokens")
    args = parser.parse_args()

    model, tokenizer = refusion.load()
    preset = refusion.DecodeConfig.from_preset(PRESET_NAME)
    eos = list(refusion.setup_of(model).special_tokens.eos_token_ids)
    plain = {}  # the base model (the embedded model's AR weights: its adapter acts on masks alone) as transformers
    for dtype in (torch.bfloat16, torch.float32):  # runs it: nn.Linear products, sdpa attention
        plain[dtype], _ = refusion.load("smollm2", dtype=dtype, attn_implementation="sdpa", linear="plain",
                                        implementation="transformers")  # its `generate`
    engines = {"refusion_exact": refusion_generate(model, preset),
               "refusion_ar": refusion_generate(model, preset.for_strategy("autoregressive")),
               "transformers_bf16": transformers_generate(plain[torch.bfloat16], eos),
               "transformers_fp32": transformers_generate(plain[torch.float32], eos),
               "transformers_lookup_bf16": transformers_generate(plain[torch.bfloat16], eos, args.lookup)}
    prompts = refusion.encode_prompts(tokenizer, held_out_prompts(args.per_task))
    for run in engines.values():
        run(prompts[0], 8)
    answers = {name: [] for name in engines}
    seconds = dict.fromkeys(engines, 0.0)
    for i, ids in enumerate(prompts):
        for name, run in engines.items():
            start = time.perf_counter()
            answers[name].append(run(ids, args.max_new_tokens))
            seconds[name] += time.perf_counter() - start
        print(f"prompt {i + 1}/{len(prompts)}", flush=True)
    rates = {name: sum(map(len, answers[name])) / seconds[name] for name in engines}
    fastest_plain = max(rates["transformers_bf16"], rates["transformers_fp32"])
    results = {name: {"tokens": sum(map(len, answers[name])), "seconds": round(seconds[name], 2),
                      "tokens_per_second": round(rates[name], 1),
                      "over_refusion_ar": round(rates[name] / rates["refusion_ar"], 3),
                      "over_fastest_transformers_ar": round(rates[name] / fastest_plain, 3),
                      "answers_equal_refusion_ar": f"{sum(a == b for a, b in zip(answers[name], answers['refusion_ar']))}"
                                                   f"/{len(prompts)}"}
               for name in engines}
    emit({"benchmark": "against_transformers", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
          "cpu": cpu_name(), "results": results, **conditions()})


if __name__ == "__main__":
    main()
