"""`refusion eval` (accuracy and speed of ReFusion and AR on benchmarks) and `refusion bench` (sweeps).

Bad input (unknown task, missing data, bad --limit or --sweep) raises ValueError / FileNotFoundError before
the model is loaded; the main CLI prints it as one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import sys

from refusion.arguments import add_decode_arguments, add_model_arguments, decode_flag_values

EVAL_SETS = ("max_new_tokens", "strategy")
"""DecodeConfig fields with flags of their own in eval and bench; every other field is a fixed override on top
of each task's preset."""


def add_parser(subparsers) -> None:
    from refusion.eval.tasks import TASKS

    tasks = ", ".join(TASKS)
    p = subparsers.add_parser(
        "eval", help="accuracy and speed of ReFusion and AR decoding on benchmarks",
        description=f"Evaluate tasks ({tasks}) with ReFusion and the AR baseline on the same prompts and model. "
                    "Under `accelerate launch` the prompts are sharded across processes and the results merged.")
    p.add_argument("--task", action="append", required=True, metavar="TASK",
                   help="task to run (repeat or comma-separate for several)")
    _add_common(p)
    p.add_argument("--strategy", default="refusion,speculative,autoregressive",
                   help="comma-separated strategies, run on the same prompts "
                        "(default: refusion,speculative,autoregressive)")
    p.add_argument("--output", default=None, help="write the result document (JSON) here")
    p.add_argument("--samples", default=None, help="write one JSON line per example and strategy here")
    p.set_defaults(func=run_eval)

    b = subparsers.add_parser(
        "bench", help="sweep decoding settings: accuracy vs tokens/s table and Pareto plot",
        description="Run one task with every combination of the swept ReFusion settings and once with AR; "
                    "write a table (Markdown + JSON) and a Pareto plot (PNG) of accuracy against tokens/s.")
    b.add_argument("--task", required=True, help=f"task to sweep ({tasks})")
    b.add_argument("--sweep", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="a DecodeConfig field and its values, e.g. slot_threshold=0.5,0.7,0.9 or "
                        "strategy=refusion,speculative (repeatable)")
    _add_common(b)
    b.add_argument("--no-baseline", action="store_true", help="skip the AR baseline")
    b.add_argument("--output-dir", default="bench", help="folder for sweep.json, sweep.md and pareto.png")
    b.set_defaults(func=run_bench)


def _add_common(p: argparse.ArgumentParser) -> None:
    from refusion.data import DATA_DIR_ENV
    from refusion.eval.runner import DEFAULT_MAX_NEW_TOKENS

    add_model_arguments(p)
    p.add_argument("--limit", default=None, help="first N examples of each task (default: all)")
    p.add_argument("--batch-size", default="1", help="prompts decoded together (default 1, as in the paper)")
    p.add_argument("--preset", default=None,
                   help="decoding preset for every task (default: each task's paper preset; without --model, "
                        "the embedded model's preset)")
    p.add_argument("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, type=int,
                   help=f"most response tokens (default {DEFAULT_MAX_NEW_TOKENS}, the paper's gen_length)")
    add_decode_arguments(p, exclude=EVAL_SETS, preset=False, default_note="(default: from the preset)")
    p.add_argument("--data-dir", default=None,
                   help=f"data folder (default: ${DATA_DIR_ENV}, else ../shared/data, else the Hugging Face hub "
                        "through the datasets package, kept in refusion's cache)")
    p.add_argument("--no-chat", action="store_true", help="send prompts without the chat template")
    p.add_argument("--no-warmup", action="store_true", help="do not decode a warm-up prompt before timing")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per code sample in the sandbox")
    p.add_argument("--memory-mb", type=int, default=2048, help="memory limit per code sample (MiB)")
    p.add_argument("--workers", type=int, default=None, help="code samples executed in parallel")


def positive_int(name: str, text: str | None) -> int | None:
    """--limit / --batch-size: an integer >= 1, or a one-line ValueError."""
    if text is None:
        return None
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ValueError(f"--{name}={text!r} is invalid: must be an integer >= 1") from None
    if value < 1:
        raise ValueError(f"--{name}={text!r} is invalid: must be an integer >= 1")
    return value


def settings_from_args(args: argparse.Namespace, tasks: list[str], strategies: list[str]):
    from refusion.eval.runner import EvalSettings
    from refusion.eval.sandbox import SandboxLimits
    from refusion.eval.tasks import ScoreOptions

    overrides = {k: v for k, v in decode_flag_values(args).items() if k not in EVAL_SETS}
    return EvalSettings(
        tasks=tasks, strategies=strategies, limit=positive_int("limit", args.limit),
        batch_size=positive_int("batch-size", args.batch_size), preset=_preset(args), overrides=overrides,
        max_new_tokens=args.max_new_tokens, data_dir=args.data_dir, chat=not args.no_chat,
        warmup=not args.no_warmup, progress=not args.no_progress,
        score=ScoreOptions(SandboxLimits(timeout=args.timeout, memory_mb=args.memory_mb), args.workers))


def _preset(args: argparse.Namespace) -> str | None:
    """--preset; without it, the embedded model's own preset when no --model is given (else each task's)."""
    from refusion.model.embedded import PRESET_NAME, embedded_available

    if args.preset is None and getattr(args, "model", None) is None and embedded_available():
        return PRESET_NAME
    return args.preset


def _split(values: list[str]) -> list[str]:
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def _check(settings, device: str | None, configs: bool = True, outputs=()) -> None:
    """Everything that can be wrong with the input, before the (slow) model load: the tasks' data, the settings,
    --device, and that the files to write (`outputs`, None: not asked for) can be created."""
    from refusion.arguments import check_device
    from refusion.eval.tasks import load_examples
    from refusion.viz.schema import check_writable

    check_device(device)
    for path in outputs:
        if path is not None:
            check_writable(path)
    for task in settings.tasks:
        load_examples(task, settings.data_dir, 1)
        for strategy in settings.strategies if configs else []:
            settings.decode_config(task, strategy)


def _load_model(args: argparse.Namespace, processes):
    from refusion.arguments import load_from_args

    return load_from_args(args, device=args.device if args.device is not None else processes.device)


def run_eval(args: argparse.Namespace) -> int:
    from refusion.eval.runner import Processes, evaluate, format_table, write_json

    settings = settings_from_args(args, _split(args.task), _split([args.strategy]))
    _check(settings, args.device, outputs=(args.output, args.samples))
    processes = Processes.detect()
    model, tokenizer = _load_model(args, processes)
    document = evaluate(model, tokenizer, settings, processes=processes, samples_path=args.samples)
    if processes.is_main:
        print(format_table(document))
        if args.output:
            write_json(args.output, document)
            print(f"results written to {args.output}", file=sys.stderr)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from refusion.eval.runner import Processes, write_json
    from refusion.eval.sweep import format_sweep_table, parse_sweeps, plot_pareto, run_sweep

    if not args.sweep:
        raise ValueError("no --sweep given: e.g. --sweep slot_threshold=0.5,0.7,0.9")
    sweeps = parse_sweeps(args.sweep)
    strategies = ["refusion"] + ([] if args.no_baseline else ["autoregressive"])
    settings = settings_from_args(args, [args.task], strategies)
    _check(settings, args.device, configs=False)  # the swept fields are checked point by point
    from refusion.eval.sweep import grid, validate_grid
    validate_grid(settings, args.task, grid(sweeps))
    processes = Processes.detect()
    model, tokenizer = _load_model(args, processes)
    log = print if processes.is_main else (lambda *a, **k: None)
    doc = run_sweep(model, tokenizer, args.task, sweeps, settings, baseline=not args.no_baseline,
                    processes=processes, log=log)
    if not processes.is_main:
        return 0
    out = Path(args.output_dir)
    write_json(out / "sweep.json", doc)
    table = format_sweep_table(doc)
    (out / "sweep.md").write_text(table + "\n")
    print(table)
    try:
        plot = plot_pareto(doc, out / "pareto.png")
        print(f"table and plot written to {out}/ (sweep.json, sweep.md, {plot.name})", file=sys.stderr)
    except ImportError:
        print(f"table written to {out}/; no plot: matplotlib is missing (pip install 'refusion[eval]')",
              file=sys.stderr)
    return 0
