"""How well a ReFusion model's masked drafts agree with its own AR continuation, offset by offset.

This is the quantity that bounds ReFusion's speed: the plan step drafts the k tokens of the slot after the
context from mask tokens, and verification keeps the drafts the model's AR distribution agrees with. For
N prompts the model first writes its greedy AR answer; then, at several cut points j of that answer,
context = prompt + answer[:j] is followed by k masks and the drafts are compared with answer[j:j+k].
Printed per offset i (0 = the token right after the context): top-1 agreement, and mean confidence of
the drafts. Ends with one JSON line.

    python benchmarks/draft_agreement.py --model PATH [--task-file ../shared/data/gsm8k/test.jsonl] [--prompts 10]
"""

from __future__ import annotations

import argparse
import json

import torch

import refusion
from refusion.data_files import data_file
from refusion.jsonl import read_jsonl
from refusion.model.setup import setup_of


def draft_agreement(model, prompts: list[list[int]], answers: list[list[int]], k: int, cuts: int) -> dict:
    mask_id = setup_of(model).special_tokens.mask_token_id
    hits = torch.zeros(k)
    confidence = torch.zeros(k)
    count = torch.zeros(k)
    for prompt, answer in zip(prompts, answers):
        for j in torch.linspace(0, max(len(answer) - k, 0), cuts).long().unique().tolist():
            context = prompt + answer[:j]
            ids = torch.tensor([context + [mask_id] * k])
            with torch.inference_mode():
                logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                               attention_mask=torch.ones_like(ids)).logits[0, -k:].float()
            probs = logits.softmax(-1)
            drafts = probs.argmax(-1)
            target = torch.tensor(answer[j:j + k])
            n = target.numel()
            hits[:n] += (drafts[:n] == target).float()
            confidence[:n] += probs.max(-1).values[:n]
            count[:n] += 1
    return {"agreement": (hits / count).tolist(), "confidence": (confidence / count).tolist(), "samples": count.tolist()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--task-file", default=None, help="a GSM8K-format JSONL file (default: GSM8K test, found "
                        "as `refusion eval` finds it)")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--slot-size", type=int, default=4)
    parser.add_argument("--cuts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()

    model, tokenizer = refusion.load(args.model, dtype=args.dtype, device="cpu")
    rows = read_jsonl(args.task_file or data_file("gsm8k/test.jsonl"))[: args.prompts]
    from refusion.eval.tasks import BOXED_INSTRUCTION

    prompts = refusion.encode_prompts(tokenizer, [f"{r['question']}\n{BOXED_INSTRUCTION}" for r in rows])
    answers = refusion.generate(model, prompts, max_new_tokens=args.max_new_tokens, strategy="autoregressive").sequences
    result = draft_agreement(model, prompts, answers, args.slot_size, args.cuts)
    for i, (a, c) in enumerate(zip(result["agreement"], result["confidence"])):
        print(f"offset {i}: drafts agree with the AR answer {100 * a:5.1f} %  mean draft confidence {c:.2f}")
    print(json.dumps({"benchmark": "draft_agreement", "model": args.model, "slot_size": args.slot_size,
                      "prompts": args.prompts, **result}))


if __name__ == "__main__":
    main()
