"""Answers through the resident engine, printed as the in-process command prints them: the same text, the same
setup and stats lines (counts from the engine's decoder), streamed on a terminal, whole when piped.

Light imports only (`refusion.config`, `refusion.decode.outputs`, the standard library): this is the path of every
warm command.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from refusion.config import MODEL_FIELDS, OPENAI_NAMES, DecodeConfig, ignored_by
from refusion.decode.outputs import SequenceStats
from refusion.engine.client import Engine, EngineUnavailable, connect
from refusion.engine.place import parse_keep_alive

KEEP_ALIVE_HELP = ("keep the model loaded in a resident engine for this long after the answer, so that the next "
                   "command answers at once: seconds or 90s, 5m, 1h; 0 decodes in this process and starts no engine "
                   "(default: $REFUSION_KEEP_ALIVE, else 5m; `refusion ps` lists, `refusion stop` ends it)")


def add_keep_alive_argument(parser) -> None:
    parser.add_argument("--keep-alive", default=None, metavar="DURATION", help=KEEP_ALIVE_HELP)


@dataclass
class EngineAnswer:
    """One answer the engine gave."""

    text: str
    stats: SequenceStats | None
    """The decoder's statistics of the sequence (None when the engine sent none)."""


def engine_settings(cfg: DecodeConfig) -> dict | None:
    """The request fields that make the engine decode with `cfg`: the standard ones, then every field the strategy
    reads in the `"refusion"` extension (those it ignores were already warned about here). None when `cfg` needs
    the in-process path (a model field set by hand, or logprobs, which only --json prints)."""
    settings = cfg.to_dict()
    if any(settings[name] is not None for name in MODEL_FIELDS) or cfg.logprobs is not None:
        return None
    ignored = set(ignored_by(cfg.strategy))
    extension = {k: v for k, v in settings.items()
                 if k not in OPENAI_NAMES and k not in MODEL_FIELDS and k not in ignored and v is not None}
    body = {"max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "refusion": extension}
    if cfg.seed is not None:
        body["seed"] = cfg.seed
    return body


def request(prompt: str, cfg_body: dict, *, chat: bool, system: str | None) -> tuple[str, dict]:
    """(path, body) of one streamed answer: a chat turn through the model's template, else the plain text."""
    body = {"model": "refusion", "stream": True, **cfg_body}
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", {**body, "messages": messages}
    return "/v1/completions", {**body, "prompt": prompt}


def answer(engine: Engine, path: str, body: dict, spec: dict, keep_alive: float,
           write: Callable[[str], object] | None = None) -> EngineAnswer:
    """Stream one answer, `write`-ing each new piece of text as it comes."""
    text, stats = "", None
    for event in engine.stream(path, body, spec, keep_alive):
        for choice in event.get("choices", []):
            delta = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
            if delta:
                text += delta
                if write is not None:
                    write(delta)
            if choice.get("finish_reason") and isinstance(choice.get("refusion"), dict):
                stats = sequence_stats(choice["refusion"])
    return EngineAnswer(text, stats)


def sequence_stats(values: dict) -> SequenceStats:
    """The engine's per-choice statistics as the `SequenceStats` the stats line prints."""
    return SequenceStats(tokens=int(values.get("tokens", 0)), forwards=int(values.get("forwards", 0)),
                         rounds=int(values.get("rounds", 0)), seconds=float(values.get("seconds", 0.0)),
                         finish_reason=str(values.get("finish_reason", "length")),
                         phase_forwards=dict(values.get("phase_forwards", {})),
                         committed_by=dict(values.get("committed_by", {})),
                         drafted=int(values.get("drafted", 0)), accepted=int(values.get("accepted", 0)))


def open_engine(args, command: str) -> tuple[Engine, float] | None:
    """The engine for this command and its keep-alive, or None: --keep-alive 0, or the engine could not be
    started or reached (one line says why; the command then decodes in-process)."""
    keep_alive = parse_keep_alive(args.keep_alive)
    if keep_alive <= 0:
        return None
    try:
        return connect(keep_alive, notice=notice), keep_alive
    except EngineUnavailable as e:
        notice(f"refusion {command}: {e}; decoding in this process")
        return None


def load_model(engine: Engine, spec: dict, keep_alive: float, strategy: str, command: str) -> dict:
    """The engine's card of the model of `spec`, loading it (with one line saying so) when it is not resident."""
    status = engine.status() or {}
    if not any(model.get("spec") == spec for model in status.get("models", [])):
        notice(f"refusion {command}: loading the model into the engine (a first load also builds its cache and "
                "native layers: a minute or two)")
    return engine.load(spec, keep_alive, strategy)


def write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def notice(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
