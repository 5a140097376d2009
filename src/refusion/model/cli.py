"""Commands about a model's files and this machine: `refusion draft-table`, `refusion export-adapter` and
`refusion calibrate`."""

from __future__ import annotations

import argparse
from pathlib import Path

from refusion.model.draft_table import DEFAULT_ORDERS, TABLE_FILE


def add_parser(subparsers) -> None:
    _add_draft_table_parser(subparsers)
    _add_export_adapter_parser(subparsers)
    _add_calibrate_parser(subparsers)


# --------------------------------------------------------------------------------- draft-table
def _add_draft_table_parser(subparsers) -> None:
    p = subparsers.add_parser("draft-table", help="build a model's draft table from its own answers",
                              description="Build the draft table of a model (n-gram statistics of its own "
                                          "answers, drafts for the exact mode) from training records "
                                          '({"query", "response"} JSONL, .gz allowed), and save it as '
                                          f"DIR/{TABLE_FILE}, where `refusion.load(DIR)` finds it.")
    p.add_argument("data", nargs="+", help="training record files (the model's own answers)")
    p.add_argument("--model", default=None, help="the model whose tokenizer reads the answers (default: embedded)")
    p.add_argument("--output", required=True, metavar="DIR", help="the model or adapter directory to save it in")
    p.add_argument("--orders", default=",".join(map(str, DEFAULT_ORDERS)), help="lengths of the token runs the table keys on")
    p.add_argument("--min-count", type=int, default=2)
    p.add_argument("--min-confidence", type=float, default=0.1)
    p.set_defaults(func=_run_draft_table, loads_model=True)  # threads chosen before the load (`refusion.cpu`)


def _run_draft_table(args: argparse.Namespace) -> int:
    from refusion.model.draft_table import DraftTable, answers_with_openings
    from refusion.model.loading import load
    from refusion.train.data import load_training_data, response_eos_id

    output = Path(args.output)
    if not output.is_dir():
        raise ValueError(f"--output {output} is not a directory")
    try:
        orders = tuple(int(o) for o in args.orders.split(","))
    except ValueError:
        raise ValueError(f"--orders {args.orders!r} is not a comma-separated list of integers") from None
    _, tokenizer = load(args.model)
    data = load_training_data(tuple(args.data), tokenizer, eos_id=response_eos_id(tokenizer), max_length=2**31)
    answers = answers_with_openings([p.tolist() for p in data.prompts], [r.tolist() for r in data.responses], orders)
    table = DraftTable.from_sequences(answers, orders, args.min_count, args.min_confidence)
    table.save(output / TABLE_FILE)
    print(f"draft table: {len(table.followers)} runs of {', '.join(map(str, table.orders))} tokens from "
          f"{len(answers)} answers -> {output / TABLE_FILE}")
    return 0


# --------------------------------------------------------------------------------- export-adapter
def _add_export_adapter_parser(subparsers) -> None:
    parser = subparsers.add_parser("export-adapter", help="copy a LoRA adapter in a smaller dtype, ready to ship",
                                   description="Copy an adapter directory with its floating tensors cast to a "
                                               "smaller dtype and its base recorded portably.")
    parser.add_argument("source", help="adapter directory (OUTPUT/adapter of a LoRA run of `refusion train`)")
    parser.add_argument("target", help="directory to write")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default), float16 or float32")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty target directory")
    parser.add_argument("--rank", type=int, default=None,
                        help="cut every layer's update to its best approximation of this rank (truncated SVD): "
                             "a cheaper forward wherever the adapter runs")
    parser.set_defaults(func=_run_export_adapter)


def _run_export_adapter(args) -> int:
    from refusion.model.adapter import export_adapter

    path = export_adapter(args.source, args.target, dtype=args.dtype, overwrite=args.overwrite, rank=args.rank)
    print(f"refusion export-adapter: wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.dtype})")
    return 0


# --------------------------------------------------------------------------------- calibrate
def _add_calibrate_parser(subparsers) -> None:
    from refusion.arguments import add_model_arguments

    parser = subparsers.add_parser(
        "calibrate", help="measure again what this machine records for a model (kernel probes, forward costs)",
        description="Time again, on this machine, what refusion measures once per machine and model and records "
                    "beside the model cache (calibration.json): the linear-kernel probes (CPUs without native "
                    "bf16) and the forward costs by width that price the exact mode's drafts. Every later process "
                    "reads the new record. Run it on a quiet machine. --show prints what is recorded for this "
                    "machine instead, measuring nothing; deleting the file resets every entry.")
    add_model_arguments(parser)
    parser.add_argument("--show", action="store_true",
                        help="print what is recorded for this machine (at this thread count), measure nothing")
    parser.add_argument("--json", action="store_true", help="with --show: one JSON object")
    parser.set_defaults(func=_run_calibrate)


def _run_calibrate(args) -> int:
    from refusion.arguments import load_from_args
    from refusion.decode.costs import forward_costs_of
    from refusion.model import calibration
    from refusion.model.setup import setup_of

    if args.show or args.json:
        return _show_calibration(as_json=args.json)
    with calibration.remeasuring():
        model, _ = load_from_args(args)
        setup = setup_of(model)
        costs = forward_costs_of(model, setup)
    where = calibration.record_path() or "nowhere: the model cache is off (REFUSION_CACHE=off)"
    print(f"refusion calibrate: {setup.describe()} ({setup.kernels.reason})")
    print(f"refusion calibrate: forward costs {costs.describe() if costs else 'not priced (a slow forward)'}")
    print(f"refusion calibrate: recorded in {where}")
    return 0


def _show_calibration(as_json: bool) -> int:
    """`refusion calibrate --show [--json]`: the record's entries for this machine as it is set now."""
    import json

    from refusion.model import calibration

    path = calibration.record_path()
    entries = calibration.recorded_here()
    machine = calibration.machine_key()
    if as_json:
        print(json.dumps({"record": str(path) if path else None, "machine": machine, "entries": entries},
                         default=str))
        return 0
    if path is None:
        print("refusion calibrate: nothing is recorded: the model cache is off (REFUSION_CACHE=off)")
        return 0
    dispatch = machine["dispatch"]
    env = "".join(f", {k}={v}" for k, v in dispatch["env"].items())
    count = f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"
    print(f"refusion calibrate: {path}, {count} for this machine ({machine['cpu']}, "
          f"{machine['threads']} threads, torch {machine['torch']}, refusion {machine['refusion']}, "
          f"{dispatch['capability']}{env})")
    for entry in entries:
        print(f"  {calibration.describe_entry(entry)}")
    return 0
