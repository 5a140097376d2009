"""`refusion train`: fine-tune a model with the hybrid AR + masked-diffusion objective.

The flags are the TrainConfig fields (``--grad-accum`` sets ``grad_accum``); ``--config recipe.yaml`` (or the
name of a packaged recipe) supplies values that flags on the command line override. Runs unchanged under
``torchrun`` and ``accelerate launch``. ``python -m refusion.train.cli ...`` runs the subcommand alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from refusion.arguments import add_dataclass_arguments
from refusion.train.config import TrainConfig

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"

# flags that take no value / an optional value; others take one value of the field's type
_SPECIAL = {
    "data": dict(action="append", metavar="D"),
    "slot_sizes": dict(type=lambda s: tuple(int(k) for k in s.split(",")), metavar="K,K,..."),
    "resume": dict(nargs="?", const="latest", metavar="CHECKPOINT"),
    "report_to": dict(type=lambda s: tuple(t.strip() for t in s.split(",") if t.strip()), metavar="TRACKER[,TRACKER]"),
}
_SHORT_HELP = {
    "data": "Data file (JSON / JSONL) or built-in name (gsm8k, mbpp, math); repeat for several.",
    "resume": "Continue from the newest checkpoint in --output (or from CHECKPOINT), with optimizer, "
              "scheduler and RNG state.",
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train", help="fine-tune a model with the hybrid AR + MDM objective",
                                   description=__doc__.splitlines()[0], argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--config plus one flag per TrainConfig field (help = the field's docstring)."""
    parser.add_argument("--config", metavar="RECIPE",
                        help=f"YAML recipe of TrainConfig fields, or a packaged recipe name ({', '.join(recipe_names())})")
    add_dataclass_arguments(parser, TrainConfig, special=_SPECIAL, help_text=_SHORT_HELP)


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def read_recipe(name_or_path: str) -> dict:
    """Values of a recipe file, or of the packaged recipe with that name."""
    import yaml

    from refusion.jsonl import not_utf8

    path = Path(name_or_path)
    if not path.is_file() and (RECIPES_DIR / f"{name_or_path}.yaml").is_file():
        path = RECIPES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"--config {name_or_path}: no such file or packaged recipe "
                                f"(packaged: {', '.join(recipe_names())})")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise not_utf8(f"--config {path}", e) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        raise ValueError(f"--config {path}: not valid YAML ({getattr(e, 'problem', None) or e}{at})") from None
    if not isinstance(values, dict):
        raise ValueError(f"--config {path}: expected a mapping of TrainConfig fields, got {type(values).__name__}")
    return values


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Recipe values overridden by the flags given on the command line."""
    values = dict(read_recipe(args.config)) if getattr(args, "config", None) else {}
    source = f"--config {args.config}" if values else "flags"
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values.update({k: v for k, v in vars(args).items() if k in names})
    return TrainConfig.from_dict(values, source=source)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    from refusion.train.trainer import train

    result = train(config)
    if os.environ.get("RANK", "0") == "0":
        print(f"refusion train: {result.steps} steps; final model in {result.output}"
              + (f"; final loss {result.final_metrics['loss']:.4f}" if result.final_metrics else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`refusion train` on its own (for `python -m refusion.train.cli`)."""
    parser = argparse.ArgumentParser(prog="refusion train", description=__doc__.splitlines()[0],
                                     argument_default=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"refusion train: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
