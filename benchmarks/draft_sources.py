"""The exact mode's copied drafts (prompt lookup, then the draft table), replayed offline on a model's own answers.

Greedy exact decoding commits, every forward, the drafts that equal the AR answer's next tokens plus one token, so
on a known AR answer its rounds can be replayed without the model: what the drafts would have been and how many
of them AR decoding would have accepted. This measures a drafting policy in seconds instead of hours, on answers
the table was not built from: the answers are split into folds, and each fold is replayed with a table counted on
the other folds (cross-validation). Reported per setting: tokens per forward, mean width of the verify forwards, and the speed
ratio to AR under a cost model (a forward of w tokens costs 1 + ROW_COST * (w - 1) one-token forwards; measure
ROW_COST with benchmarks/narrow_forwards.py). Ends with one JSON line.

    python benchmarks/draft_sources.py recipes/data/*.jsonl.gz [--fractions 0.25,0.5,1] [--lookup-lengths 8]
                                       [--table-lengths 16] [--orders 4,3,2 4,3,2,1] [--folds 5]
                                       [--min-counts 2] [--min-confidences 0.1] [--max-new-tokens 128]
                                       [--row-cost 0.028]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from refusion.decode.drafters import DraftContext, PromptLookup, TableDrafter, propose
from refusion.model.draft_table import DEFAULT_ORDERS, DraftTable, answers_with_openings
from refusion.model.loading import load
from refusion.train.data import load_training_data, response_eos_id


def replay(prompt: list[int], answer: list[int], table: DraftTable, lookup_length: int,
           table_length: int) -> list[tuple[int, int]]:
    """(drafted, accepted) of every verify forward of greedy exact decoding of `answer` (the prefill decides
    its first token)."""
    rounds, position = [], 0  # answer[position]: the token the last forward decided
    drafters = [d for d, length in ((PromptLookup(lookup_length), lookup_length),
                                    (TableDrafter(table, table_length, runner_up=False), table_length)) if length]
    while position < len(answer) - 1:
        text = prompt + answer[: position + 1]
        drafts = list(propose(drafters, DraftContext(text, len(answer) - 1 - position), position, "cpu").drafts.ids)
        accepted = 0
        for token, truth in zip(drafts, answer[position + 1:]):
            if token != truth:
                break
            accepted += 1
        rounds.append((len(drafts), accepted))
        position += accepted + 1
    return rounds


def cross_validated(prompts, answers, fraction: float, folds: int, lookup_length: int, table_length: int,
                    max_new_tokens: int, row_cost: float, orders: tuple[int, ...] = DEFAULT_ORDERS,
                    min_count: int = 2, min_confidence: float = 0.1) -> dict:
    tokens = prefills = verifies = cost = widths = 0
    sequences = answers_with_openings(prompts, answers, orders)
    for fold in range(folds):
        others = [i for i in range(len(answers)) if i % folds != fold]
        others = others[: max(1, int(len(others) * fraction))]
        table = DraftTable.from_sequences([sequences[i] for i in others], orders, min_count, min_confidence)
        for i in range(fold, len(answers), folds):
            answer = answers[i][:max_new_tokens]
            rounds = replay(prompts[i], answer, table, lookup_length, table_length)
            tokens += len(answer)
            prefills += 1
            verifies += len(rounds)
            cost += 1 + sum(1 + row_cost * drafted for drafted, _ in rounds)
            widths += sum(1 + drafted for drafted, _ in rounds)
    return {"table_answers": len(others), "tokens": tokens, "tokens_per_forward": tokens / (prefills + verifies),
            "mean_width": widths / max(1, verifies), "modelled_speed_vs_ar": tokens / cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", nargs="+", help="training record files of the model's own answers")
    parser.add_argument("--model", default="smollm2", help="whose tokenizer reads the answers")
    parser.add_argument("--fractions", default="1", help="fractions of the other folds the table is counted on")
    parser.add_argument("--lookup-lengths", default="8")
    parser.add_argument("--table-lengths", default="16")
    parser.add_argument("--orders", nargs="+", default=[",".join(map(str, DEFAULT_ORDERS))],
                        help="the run lengths of each table compared (comma-separated), e.g. 4,3,2 4,3,2,1")
    parser.add_argument("--min-counts", default="2", help="the tables' min_count values compared")
    parser.add_argument("--min-confidences", default="0.1", help="the tables' min_confidence values compared")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--row-cost", type=float, default=0.028,
                        help="cost of one more token in a forward, in one-token forwards")
    args = parser.parse_args()

    _, tokenizer = load(args.model)
    data = load_training_data(tuple(args.data), tokenizer, eos_id=response_eos_id(tokenizer), max_length=2**31)
    prompts, answers = [p.tolist() for p in data.prompts], [r.tolist() for r in data.responses]
    results = []
    for orders, fraction, lookup, table, min_count, min_confidence in itertools.product(
            [tuple(int(n) for n in o.split(",")) for o in args.orders], [float(f) for f in args.fractions.split(",")],
            [int(n) for n in args.lookup_lengths.split(",")], [int(n) for n in args.table_lengths.split(",")],
            [int(n) for n in args.min_counts.split(",")], [float(c) for c in args.min_confidences.split(",")]):
        r = cross_validated(prompts, answers, fraction, args.folds, lookup, table, args.max_new_tokens, args.row_cost,
                            orders, min_count, min_confidence)
        r |= {"fraction": fraction, "lookup_length": lookup, "table_length": table, "orders": orders,
              "min_count": min_count, "min_confidence": min_confidence}
        results.append(r)
        print(f"orders {','.join(map(str, orders)):9s} table of {r['table_answers']:5d} answers  lookup {lookup:2d}  "
              f"table {table:2d}  min count {min_count}  min confidence {min_confidence:g}  "
              f"TPF {r['tokens_per_forward']:.3f}  width {r['mean_width']:.2f}  "
              f"x{r['modelled_speed_vs_ar']:.3f} AR (modelled)", flush=True)
    print(json.dumps({"benchmark": "draft_sources", "data": args.data, "answers": len(answers), "folds": args.folds,
                      "max_new_tokens": args.max_new_tokens, "row_cost": args.row_cost,
                      "results": results, "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))


if __name__ == "__main__":
    main()
