"""Long prompts through each attention implementation: the prefill and the decoding after it, in one run.

The embedded model (`--linear`, default int4-q8, fp32) loaded once per attention implementation (`--attentions`,
default the row-exact one over fp64 entries, the one over fp16 entries and sdpa); held-out questions (`serving.py`'s
`held_out_prompts`) behind `serving.py`'s shared system prompt of about `--system-tokens` tokens, chat-rendered.
Question by question, every implementation takes its turn in AR decoding and in the preset (the exact mode), so the
machine's drift touches each alike. Reported per implementation and mode, pooled: the prefill (seconds to the first
committed token), the decoding after it (tokens/s from the first token to the last) and, for the preset, how many
answers are its own AR decoding's, token for token (the exact mode's promise). Ends with one JSON line.

    python benchmarks/long_prompts.py [--system-tokens 1000] [--questions 4] [--max-new-tokens 48]
                                      [--attentions refusion_exact,refusion_exact_half,sdpa] [--linear int4-q8]
"""

from __future__ import annotations

import argparse
import time

from harness import conditions, cpu_name, emit
from serving import held_out_prompts, system_prompt


def decode(model, ids: list[int], max_new_tokens: int, strategy: str | None) -> dict:
    """One decode: seconds to the first committed token, seconds after it, tokens, the tokens themselves."""
    import refusion

    first = []
    start = time.perf_counter()

    def on_round(sequence, trace) -> None:  # the first round ends with the first committed token
        if not first:
            first.append(time.perf_counter())

    out = refusion.generate(model, [ids], max_new_tokens=max_new_tokens, on_round=on_round,
                            **({"strategy": strategy} if strategy else {}))
    end = time.perf_counter()
    first_token = first[0] if first else end
    return {"prefill_seconds": first_token - start, "after_seconds": end - first_token,
            "tokens": len(out.sequences[0]), "sequence": out.sequences[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--attentions", default="refusion_exact,refusion_exact_half,sdpa")
    parser.add_argument("--linear", default="int4-q8")
    args = parser.parse_args()

    import refusion

    attentions = args.attentions.split(",")
    models = {}
    for attention in attentions:
        models[attention], tokenizer = refusion.load(dtype="float32", linear=args.linear,
                                                     attn_implementation=attention)
        print(f"[{refusion.setup_of(models[attention]).describe()}]", flush=True)
    system = system_prompt(args.system_tokens)
    prompts = []
    for question in held_out_prompts(args.questions)[:args.questions]:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) else ids))
    for model in models.values():  # warm-up
        refusion.generate(model, [prompts[0][:64]], max_new_tokens=4)
    pooled = {(a, mode): {"prefill_seconds": 0.0, "after_seconds": 0.0, "tokens": 0, "same_as_ar": 0}
              for a in attentions for mode in ("autoregressive", "preset")}
    for ids in prompts:
        for attention, model in models.items():
            ar = decode(model, ids, args.max_new_tokens, "autoregressive")
            preset = decode(model, ids, args.max_new_tokens, None)
            for mode, run in (("autoregressive", ar), ("preset", preset)):
                row = pooled[attention, mode]
                for key in ("prefill_seconds", "after_seconds", "tokens"):
                    row[key] += run[key]
                row["same_as_ar"] += run["sequence"] == ar["sequence"]
    rows = []
    for (attention, mode), row in pooled.items():
        rate = (row["tokens"] - len(prompts)) / row["after_seconds"] if row["after_seconds"] else 0.0
        rows.append({"attention": attention, "mode": mode, "prefill_seconds": round(row["prefill_seconds"]
                     / len(prompts), 3), "tokens_per_second_after_prefill": round(rate, 1),
                     "tokens": row["tokens"], "same_as_ar": row["same_as_ar"]})
        print(f"{attention:20s} {mode:14s} prefill {rows[-1]['prefill_seconds']:6.2f} s, then "
              f"{rate:6.1f} tokens/s, same as AR {row['same_as_ar']}/{len(prompts)}", flush=True)
    emit({"benchmark": "long_prompts", "cpu": cpu_name(), "linear": args.linear,
          "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.max_new_tokens, "rows": rows,
          **conditions()})


if __name__ == "__main__":
    main()
