"""The `refusion` command line: generate | train | eval | bench | serve | trace | export-adapter.

Each subcommand lives next to the code it drives and exposes `add_parser(subparsers)`; heavy imports
happen inside the command, so `refusion --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# module path of each subcommand's `add_parser`, in the order `--help` lists them
SUBCOMMANDS = [
    "refusion.decode.cli",
    "refusion.train.cli",
    "refusion.eval.cli",
    "refusion.serve.cli",
    "refusion.viz.cli",
    "refusion.model.adapter",
]


class UserError(Exception):
    """A problem with the user's input, printed as one line (exit code 2)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="refusion", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"refusion {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(sub)
    return parser


def _version() -> str:
    from refusion import __version__
    return __version__


def quiet_libraries() -> None:
    """Keep transformers' load-time warnings and progress bars off the terminal (REFUSION_VERBOSE=1 keeps them)."""
    if os.environ.get("REFUSION_VERBOSE"):
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet_libraries()
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError, UserError) as e:
        print(f"refusion {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"refusion {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
