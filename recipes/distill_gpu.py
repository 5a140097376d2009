"""Distil the base's greedy answers on a CUDA GPU, thousands of rows at a time.

`refusion generate --input ... --output ...` (recipes/refusion-smol-v2-distill.sh) is the reference path and what
a CPU runs; its engine keeps per-row state on the host, which at a GPU's batch sizes costs more than the forward.
Here transformers' `generate` decodes prompts sorted by length in batches of `--batch-size` (greedy, fp32, left
padding), with refusion's prompt format and EOS tokens, and writes the same records as `refusion generate`
(`{"query", "response", "origin", "stats": {"tokens", "finish_reason"}}`, in --input's order), so the distill
script's packing step reads them unchanged. The answers are the base's fp32 greedy ones up to the GPU's rounding.

    python recipes/distill_gpu.py --input distill-mix --skip 3100 --shortest 8192 --output runs/v3/answers.jsonl

With `--seconds`, batches stop starting once that much time has passed: the records written are the prompts
decoded so far (shortest prompts first), and a later run with the same arguments continues with the others.
`--exclude` leaves out the prompts of packed sets already made; `--skip-shortest M` the M shortest, those an
earlier `--shortest M` run answered (the next 5120 of the mix after v3's set, recipes/refusion-smol-table.sh:
`--input distill-mix --skip 3100 --skip-shortest 8192 --shortest 13312`).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="a built-in prompt set (distill-mix, open-ended) or a JSONL file")
    p.add_argument("--output", required=True, help="JSONL of records; prompts already there are not decoded again")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--skip", type=int, default=0, help="leave out the first M prompts")
    p.add_argument("--limit", type=int, default=None, help="only prompts up to N")
    p.add_argument("--shortest", type=int, default=None,
                   help="only the N shortest prompts (by tokens; ties in --input's order)")
    p.add_argument("--skip-shortest", type=int, default=0, metavar="M",
                   help="leave out the M shortest prompts (those an earlier run with --shortest M answered)")
    p.add_argument("--exclude", nargs="+", default=[], metavar="PACKED",
                   help="leave out the prompts answered in these packed sets (recipes/data/*.jsonl.gz)")
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--max-new-tokens", type=int, default=384)
    p.add_argument("--seconds", type=float, default=None, help="start no batch after this many seconds")
    p.add_argument("--device", default="cuda")
    return p.parse_args(argv)


def write_records(path: str, prompts: list[tuple[str, str]], done: dict) -> None:
    """The answered prompts' records, in the prompts' order, replacing `path` at once."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        for origin, query in prompts:
            if (origin, query) in done:
                f.write(json.dumps(done[origin, query]) + "\n")
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    import refusion
    from refusion.decode.cli import read_prompt_file
    from refusion.model.loading import encode_prompts
    from refusion.model.setup import setup_of

    args = parse_args(argv)
    started = time.perf_counter()
    prompts = read_prompt_file(args.input)[args.skip:args.limit]
    done = {}
    if os.path.exists(args.output):
        with open(args.output, encoding="utf-8") as f:
            for record in map(json.loads, f):
                done[record["origin"], record["query"]] = record
    excluded = set()
    for path in args.exclude:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            excluded.update((r["origin"], r["query"]) for r in map(json.loads, f))
    prompts = [key for key in prompts if key not in excluded]
    model, tokenizer = refusion.load(args.model, dtype="float32", device=args.device,
                                     implementation="transformers")  # its batched `generate`
    eos = list(setup_of(model).special_tokens.eos_token_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    ids = encode_prompts(tokenizer, [query for _, query in prompts])
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))  # shortest first, ties in --input's order
    if args.shortest is not None:  # the N shortest of all the prompts, those already answered included
        order = order[: args.shortest]
    order = order[args.skip_shortest:]
    order = [i for i in order if prompts[i] not in done]
    tokens_out = 0
    for start in range(0, len(order), args.batch_size):
        if args.seconds is not None and time.perf_counter() - started > args.seconds:
            break
        batch = order[start:start + args.batch_size]
        width = max(len(ids[j]) for j in batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for row, j in enumerate(batch):
            input_ids[row, width - len(ids[j]):] = torch.tensor(ids[j])
            attention[row, width - len(ids[j]):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device),
                                 max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=eos,
                                 pad_token_id=pad)
        for row, j in enumerate(batch):
            response = out[row, width:].tolist()
            ends = [k for k, t in enumerate(response) if t in eos]
            response = response[: ends[0] + 1] if ends else response
            origin, query = prompts[j]
            done[origin, query] = {"query": query, "response": tokenizer.decode(response, skip_special_tokens=True),
                                   "origin": origin, "stats": {"tokens": len(response),
                                                               "finish_reason": "eos" if ends else "length"}}
            tokens_out += len(response)
        write_records(args.output, prompts, done)  # after every batch: a run stopped from outside loses one batch
        elapsed = time.perf_counter() - started
        print(f"distil: {min(start + args.batch_size, len(order))}/{len(order)} prompts, {tokens_out} tokens, "
              f"{elapsed:.0f} s", flush=True)
    print(f"distil: {args.output} holds {sum(key in done for key in prompts)} of {len(prompts)} answers")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (OSError, ValueError, RuntimeError) as e:  # a missing file, a bad record, no such device: one line
        sys.exit(f"distill_gpu: {e}")
