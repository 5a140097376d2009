"""Draft policies of the exact mode replayed on the model's own answers: tokens per forward, and speed as the
forward-cost curve prices it, without decoding.

The exact mode commits AR decoding's tokens whatever it drafts, so how many tokens a round commits depends only on
the answer AR decoding writes and on the drafts: given an answer, a draft policy can be replayed round by round
without the model (the draft accepted while it equals the answer's next tokens). This replays the held-out part of
the distilled sets (every `--every`-th answer of each set, from `--offset`; the draft table is rebuilt from the rest
with the shipped settings, so no replayed answer was counted in it), at most `--max-new-tokens` tokens of each, and
prices each round's forward by the loaded model's measured forward costs (`decode.costs.measure`, as the decoder
does), or by a flat curve (`--flat-costs`: width free, as on a GPU). Policies:

* `chain`: one chain a round (prompt lookup first, else the table; the cost-aware count per source), as the
  decoder did before runner-up chains;
* `runner_up`: what the decoder does: where the chain is the table's, a second chain beside it in the same forward
  (an attention group reading the context and the next token), from the table's runner-up follower of the run
  (`drafters.table.runner_up_drafts`), cut by the same cost rule; the longer accepted chain's tokens are committed;
* `choose`: per round, the source whose chain promises more tokens per second by its measured acceptance;
* `tree`: the chain, plus the table's chain as a second chain where both sources have drafts that differ at
  their first token.

Each policy is replayed under each `--pricings`: `frequency`, what the decoder does, prices the table's drafts by the
frequency the table states for each (`acceptance.AcceptanceByFrequency`, one record shared by all replayed answers, as a
decoder's sequences share it), and prompt lookup's and the second chains' by depth; `depth` prices every chain by
depth (`acceptance.AcceptanceByDepth`, per answer), as the decoder did before. `choose` compares sources by depth in
both. Also reported: how often the verified table drafts were accepted, by tenth of their stated frequency.

Modelled speed = (tokens x one-token cost) / (sum of each round's forward cost + a prefill priced as one token), so
AR scores 1.00; it leaves out whatever a step costs besides its forward. Counts are deterministic for given costs
(`--costs`; the probe's own vary from load to load). What the decoder measured, on held-out prompts:
docs/archive/RESULTS-LEDGER.md: *Runner-up chains*. Ends with one JSON line.

    python benchmarks/draft_replay.py [--every 20] [--offset 7] [--max-new-tokens 128] [--flat-costs | --costs ...]
                                      [--policies chain,runner_up,choose,tree] [--pricings frequency,depth]
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import time
from pathlib import Path

from refusion.decode.acceptance import (
    FREQUENCY_BINS,
    AcceptanceByDepth,
    AcceptanceByFrequency,
    expected_tokens,
)
from refusion.decode.costs import (
    ForwardCosts,
    best_draft_count,
    draft_counts,
    forward_costs_of,
)
from refusion.decode.drafters.prompt_lookup import lookup_drafts
from refusion.decode.drafters.table import runner_up_drafts
from refusion.model.draft_table import DraftTable, answers_with_openings
from refusion.model.embedded import PRESET_NAME
from refusion.train.data import load_training_data, read_json_records, response_eos_id

POLICIES = ("chain", "runner_up", "choose", "tree")
"""The draft policies `replay` knows (the module docstring)."""
PRICINGS = ("frequency", "depth")
"""How `replay` prices the table's drafts (the module docstring)."""
DATA = sorted(glob.glob(str(Path(__file__).parent.parent / "recipes" / "data" / "*.jsonl.gz")))


def accepted_prefix(drafts: list[int], answer: list[int], at: int) -> int:
    """How many of `drafts` equal the answer's tokens from `at` on."""
    n = 0
    while n < len(drafts) and at + n < len(answer) and drafts[n] == answer[at + n]:
        n += 1
    return n


def expected_rate(drafts: list[int], acceptance: AcceptanceByDepth, costs: ForwardCosts) -> float:
    """Expected tokens per second of verifying the cost-aware cut of `drafts` (the decoder's own estimate)."""
    n = best_draft_count(len(drafts), acceptance, costs) if drafts else 0
    return (1 + expected_tokens(n, acceptance)) / costs.of(1 + n)


def replay(prompt: list[int], answer: list[int], table: DraftTable, costs: ForwardCosts, policy: str,
           lookup_length: int, table_length: int, by_frequency: AcceptanceByFrequency | None = None,
           tenths: list[list[int]] | None = None) -> tuple[int, int, float, int]:
    """(tokens, forwards, seconds, rounds won by the side branch) of the exact mode writing `answer`.
    `by_frequency`: the record that prices the table's drafts (None: by depth); `tenths`: [verified, accepted] of the
    table's drafts by tenth of stated frequency, counted in place."""
    acceptance = collections.defaultdict(AcceptanceByDepth)
    text, at, forwards, seconds, side_wins = [*prompt, answer[0]], 1, 1, costs.of(1), 0  # the prefill's token
    while at < len(answer):
        walked = table.walk(text, table_length)
        look, tab, stated = lookup_drafts(text, lookup_length), [t for t, _ in walked], [f for _, f in walked]
        source = "lookup" if look else "table"
        if (policy == "choose" and look and tab
                and expected_rate(tab, acceptance["table"], costs) > expected_rate(look, acceptance["lookup"], costs)):
            source = "table"
        drafts = look if source == "lookup" else tab
        if drafts and source == "table" and by_frequency is not None:  # as the decoder's step decides
            chances = by_frequency.chances(stated)
            drafts = drafts[: draft_counts([(1, tuple((1, c) for c in chances))], [], costs)[0]]
            committed = 1 + sum(chances[: len(drafts)])
        else:
            drafts = drafts[: best_draft_count(len(drafts), acceptance[source], costs)] if drafts else []
            committed = 1 + expected_tokens(len(drafts), acceptance[source])
        side = []
        if policy == "tree" and look and tab and tab[0] != look[0]:
            side = tab
        elif policy == "runner_up" and source == "table":  # what the decoder does
            side = runner_up_drafts(text, table, table_length)
        if side:
            side = side[: best_draft_count(len(side), acceptance["side"], costs, width=1 + len(drafts),
                                           committed=committed)]
        accepted = accepted_prefix(drafts, answer, at)
        if drafts:
            acceptance[source].record(len(drafts), accepted)
        if drafts and source == "table":
            if by_frequency is not None:
                by_frequency.record(stated[: len(drafts)], accepted)
            for i, frequency in enumerate(stated[: min(accepted + 1, len(drafts))]):
                tenth = tenths[AcceptanceByFrequency.bin(frequency)] if tenths is not None else [0, 0]
                tenth[0] += 1
                tenth[1] += i < accepted
        if side:
            side_accepted = accepted_prefix(side, answer, at)
            acceptance["side"].record(len(side), side_accepted)
            side_wins += side_accepted > accepted
            accepted = max(accepted, side_accepted)
        forwards, seconds = forwards + 1, seconds + costs.of(1 + len(drafts) + len(side))
        step = min(accepted + 1, len(answer) - at)
        text += answer[at: at + step]
        at += step
    return len(answer), forwards, seconds, side_wins


def group_of(origin: str) -> str:
    """A record's prompt group: open-ended requests by kind ("rewrite" is copy-heavy), the mix by task."""
    if origin.startswith("open-ended"):
        return "copy-heavy" if origin.split(":")[1] == "rewrite" else "open-ended"
    return origin.split("/")[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", nargs="+", default=DATA, help="distilled answer sets (default: recipes/data)")
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--offset", type=int, default=7)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--flat-costs", action="store_true", help="price every width as one token (a GPU)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--pricings", default=",".join(PRICINGS))
    parser.add_argument("--costs", default=None, metavar="W:MS,...", help="forward costs by width, e.g. "
                        "1:16.1,4:16.1,8:19.3,16:26.5 (default: the loaded model's probe)")
    args = parser.parse_args()
    policies, pricings = args.policies.split(","), args.pricings.split(",")
    if unknown := [p for p in policies if p not in POLICIES]:
        parser.error(f"--policies: unknown {', '.join(unknown)} (known: {', '.join(POLICIES)})")
    if unknown := [p for p in pricings if p not in PRICINGS]:
        parser.error(f"--pricings: unknown {', '.join(unknown)} (known: {', '.join(PRICINGS)})")
    costs = None  # the loaded model's probe, unless given
    if args.costs:
        try:
            pairs = [pair.split(":") for pair in args.costs.split(",")]
            costs = ForwardCosts(tuple(int(w) for w, _ in pairs), tuple(float(ms) / 1e3 for _, ms in pairs))
        except ValueError:
            parser.error(f"--costs {args.costs!r}: expected WIDTH:MS pairs, comma-separated")

    import refusion

    model, tokenizer = refusion.load()
    setup = refusion.setup_of(model)
    preset = refusion.DecodeConfig.from_preset(PRESET_NAME)
    costs = costs or forward_costs_of(model, setup)
    if args.flat_costs or costs is None:
        costs = ForwardCosts((1, 2), (1.0, 1.0))
    shipped = setup.draft_table
    train_prompts, train_answers, held = [], [], collections.defaultdict(list)
    for path in args.data:
        origins = [record.get("origin", "") for _, record in read_json_records(path)]
        data = load_training_data((path,), tokenizer, eos_id=response_eos_id(tokenizer), max_length=2**31)
        for i, (origin, prompt, answer) in enumerate(zip(origins, data.prompts, data.responses)):
            if i % args.every == args.offset:
                held[group_of(origin)].append((prompt.tolist(), answer.tolist()[: args.max_new_tokens]))
            else:
                train_prompts.append(prompt.tolist())
                train_answers.append(answer.tolist())
    answers = answers_with_openings(train_prompts, train_answers, shipped.orders)
    table = DraftTable.from_sequences(answers, shipped.orders, min_confidence=shipped.min_confidence)
    summary, tenths = {}, {}
    for policy, pricing in [(p, q) for p in policies for q in pricings]:
        name = f"{policy}/{pricing}"
        totals, by_tenth = [0, 0, 0.0, 0], [[0, 0] for _ in range(FREQUENCY_BINS)]
        by_frequency = AcceptanceByFrequency() if pricing == "frequency" else None  # shared, as in a decoder
        for group, items in sorted(held.items()):
            counts = [0, 0, 0.0, 0]
            for prompt, answer in items:
                for k, v in enumerate(replay(prompt, answer, table, costs, policy, preset.lookup_length,
                                             preset.table_length, by_frequency, by_tenth)):
                    counts[k] += v
                    totals[k] += v
            summary.setdefault(group, {})[name] = result(counts, costs)
        summary.setdefault("all", {})[name] = result(totals, costs)
        tenths[name] = [round(a / v, 3) if v else None for v, a in by_tenth]
        print(name, "table drafts accepted by tenth of stated frequency:", tenths[name],
              "of", [v for v, _ in by_tenth])
    for group, row in summary.items():
        print(group, f"({len(held.get(group, [])) or sum(map(len, held.values()))} answers)", row)
    print(json.dumps({"benchmark": "draft_replay", "answers": {g: len(v) for g, v in held.items()},
                      "table_runs": len(table.followers), "costs": costs.describe(), "flat_costs": args.flat_costs,
                      "max_new_tokens": args.max_new_tokens, "summary": summary, "accepted_by_tenth": tenths,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))


def result(counts, costs: ForwardCosts) -> dict:
    tokens, forwards, seconds, side_wins = counts
    return {"tokens_per_forward": round(tokens / forwards, 3),
            "modelled_speed": round(tokens * costs.of(1) / seconds, 3), "side_wins": side_wins}


if __name__ == "__main__":
    main()
