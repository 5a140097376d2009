"""Training throughput: hybrid AR + MDM objective vs plain next-token fine-tuning, same model, data, batches.

One process, one model, the variants interleaved step by step (so that load from other processes hits all
of them alike). A timed step = building the micro-batch (the hybrid objective's extra work: slot sizes,
masking, permutation) + forward + backward + AdamW step, under bf16 autocast where supported, exactly as
`refusion train` does it. Throughput = input tokens (prompt + response, no padding) per second; median over
the steps after warm-up. The variants differ only in objective ("ar" = plain next-token fine-tuning) and
in whether the LM head runs on every position (as plain fine-tuning does) or only on labelled ones.
Ends with one JSON line.

    PYTHONPATH=src python benchmarks/train_throughput.py [--model smollm2] [--steps 6] [--batch-size 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

VARIANTS = {  # name: (objective, logits_on_labels)
    "ar_full_logits": ("ar", False),
    "hybrid_full_logits": ("hybrid", False),
    "ar_logits_on_labels": ("ar", True),
    "hybrid_logits_on_labels": ("hybrid", True),
}


def main() -> None:
    from refusion.model.prepare import add_mask_token
    from refusion.train.batching import BatchRecipe, MicroBatchStream
    from refusion.train.data import load_training_data, response_eos_id
    from refusion.train.loss import HybridObjective
    from refusion.train.trainer import load_model_and_tokenizer, resolve_mixed_precision

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--data", default="gsm8k")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--mixed-precision", default="auto")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()

    # 1. model, data, one batch stream per objective over the same sample order
    model, tokenizer = load_model_and_tokenizer(args.model)
    mask_id, eos_id = add_mask_token(model, tokenizer), response_eos_id(tokenizer)
    data = load_training_data((args.data,), tokenizer, eos_id=eos_id, max_length=args.max_length,
                              max_samples=args.batch_size * (args.steps + args.warmup))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    names = args.variants.split(",")
    streams = {objective: MicroBatchStream(data, BatchRecipe(objective, (4, 8, 16, 32), mask_id, pad_id, eos_id),
                                           seed=0, batch_size=args.batch_size, world_size=1, rank=0)
               for objective in ("ar", "hybrid")}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    bf16 = resolve_mixed_precision(args.mixed_precision) == "bf16"
    model.train()

    # 2. interleaved timed steps
    rates: dict[str, list[float]] = {name: [] for name in names}
    for step in range(args.warmup + args.steps):
        for name in names:
            objective_name, on_labels = VARIANTS[name]
            objective = HybridObjective(model, logits_on_labels=on_labels)
            start = time.perf_counter()
            batch = streams[objective_name][step]
            tokens = int(batch.pop("num_tokens"))
            batch.pop("sample_indices")
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = objective(batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step >= args.warmup:
                rates[name].append(tokens / (time.perf_counter() - start))
        print(f"step {step}: " + ", ".join(f"{n} {rates[n][-1]:.0f} tok/s" for n in names if rates[n]), flush=True)

    # 3. report
    results = {n: {"tokens_per_s_median": round(statistics.median(r), 1), "tokens_per_s_min": round(min(r), 1),
                   "tokens_per_s_max": round(max(r), 1)} for n, r in rates.items()}
    out = {"benchmark": "train_throughput", "model": args.model, "data": args.data, "batch_size": args.batch_size,
           "steps": args.steps, "bf16": bf16, "threads": torch.get_num_threads(), "results": results}
    for suffix in ("full_logits", "logits_on_labels"):
        ar, hybrid = results.get(f"ar_{suffix}"), results.get(f"hybrid_{suffix}")
        if ar and hybrid:
            out[f"hybrid_over_ar_{suffix}"] = round(hybrid["tokens_per_s_median"] / ar["tokens_per_s_median"], 3)
            # best step of each: the least disturbed by other processes on a shared machine
            out[f"hybrid_over_ar_{suffix}_best"] = round(hybrid["tokens_per_s_max"] / ar["tokens_per_s_max"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
