"""The benchmarks' one decode-and-pool loop.

A benchmark names its engines (a model, a DecodeConfig, the setup it decodes with) and its prompts; the harness

1. warms every engine up on a short decode (`warm_up`: kernels choose their code, fused weights are built);
2. decodes every prompt with every engine back to back, batch 1, so that a drift of the machine touches every
   engine alike (`decode_interleaved`), or a list of prompts in batches of B (`decode_batches`);
3. pools an engine's decodes (`pooled`: tokens, forwards, seconds, the exact mode's drafts and the forwards per
   phase, summed) and derives the rates from the sums (`add_rates`: tokens per forward, tokens/s, the ratio to AR
   decoding), so that long answers weigh as much as they cost;
4. reports the conditions (`conditions`) and ends with one JSON line (`emit`).

It imports refusion only inside its functions, through the public API where it can: `benchmarks/against_commit.py`
runs it in a child process over an earlier commit's code. Benchmarks run as `python benchmarks/NAME.py`, which puts
this folder on their path.
"""

from __future__ import annotations

import json
import platform
import signal
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Engine:
    """One way of decoding that a benchmark compares: the model, its settings and what it decodes with."""

    name: str
    """The engine's key in the benchmark's results."""
    model: Any
    """The model `refusion.generate` decodes with."""
    config: Any
    """Its `refusion.DecodeConfig`."""
    setup: Any = None
    """The `ModelSetup` it decodes with (None: the model's own)."""
    switch: Callable[[], None] | None = None
    """Called before each of its decodes, for what lives on the model rather than in the setup (its layers'
    kernels)."""


@dataclass(frozen=True)
class Decoded:
    """One prompt decoded by one engine, batch 1."""

    sequence: list[int]
    """The generated ids, up to and including EOS."""
    stats: Any
    """Its `SequenceStats`: tokens, forwards, forwards per phase, drafts, seconds inside `generate`."""
    wall_seconds: float
    """Seconds of the whole `refusion.generate` call, as the caller sees them."""


def decode(engine: Engine, prompt: list[int]) -> Decoded:
    """One batch-1 decode of `prompt` by `engine`."""
    import refusion

    if engine.switch is not None:
        engine.switch()
    with_setup = {"setup": engine.setup} if engine.setup is not None else {}  # an earlier commit's may take none
    start = time.perf_counter()
    out = refusion.generate(engine.model, [prompt], engine.config, **with_setup)
    return Decoded(out.sequences[0], out.stats.per_sequence[0], time.perf_counter() - start)


def warm_up(engines: Iterable[Engine], prompt: list[int], max_new_tokens: int = 8) -> None:
    """A short decode by every engine before anything is timed."""
    for engine in engines:
        decode(Engine(engine.name, engine.model, engine.config.replace(max_new_tokens=max_new_tokens), engine.setup,
                      engine.switch), prompt)


def decode_interleaved(engines: Sequence[Engine], prompts: Sequence[list[int]], label: str = "prompt",
                       after_prompt: Callable[[int, list[int]], None] | None = None) -> dict[str, list[Decoded]]:
    """Every prompt decoded by every engine in turn (prompt by prompt, the engines in their order), batch 1: each
    engine's decodes in prompt order. `after_prompt(i, prompt)` runs after the engines on each prompt (another
    program's decode of it); a progress line is printed per prompt."""
    decodes: dict[str, list[Decoded]] = {engine.name: [] for engine in engines}
    for i, prompt in enumerate(prompts):
        for engine in engines:
            decodes[engine.name].append(decode(engine, prompt))
        if after_prompt is not None:
            after_prompt(i, prompt)
        print(f"{label} {i + 1}/{len(prompts)}", flush=True)
    return decodes


def decode_batches(model, prompts: Sequence[list[int]], config, batch: int, setup=None, *,
                   clock: str = "generate") -> dict:
    """`prompts` decoded in batches of `batch`, in order: tokens, forwards, seconds (clock "generate": the time
    `generate` reports, prefill included; "wall": the calls as the caller sees them), seconds inside the model's
    forwards, and the sequences."""
    import refusion

    if clock not in ("generate", "wall"):
        raise ValueError(f"clock={clock!r} is invalid: must be 'generate' or 'wall'")
    tokens = forwards = 0
    seconds = forward_seconds = 0.0
    sequences = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        out = refusion.generate(model, list(prompts[i:i + batch]), config,
                                **({"setup": setup} if setup is not None else {}))
        sequences += out.sequences
        tokens += out.stats.batch.tokens
        forwards += out.stats.batch.forwards
        seconds += out.stats.batch.seconds
        forward_seconds += out.stats.batch.forward_seconds
    if clock == "wall":
        seconds = time.perf_counter() - start
    return dict(tokens=tokens, forwards=forwards, seconds=seconds, forward_seconds=forward_seconds,
                sequences=sequences)


POOLED = ("tokens", "forwards", "seconds", "drafted", "accepted", "phase_forwards", "committed_by")
"""What `pooled` sums, in its order."""


def pooled(decodes: Iterable[Decoded], fields: Sequence[str] = POOLED, *, clock: str = "generate") -> dict:
    """The sums of `fields` over an engine's decodes ("seconds": `generate`'s own, or with clock "wall" the calls
    as the caller sees them; "phase_forwards" and "committed_by": counts by key)."""
    totals: dict = {field: {} if field in ("phase_forwards", "committed_by") else 0 for field in fields}
    if "seconds" in totals:
        totals["seconds"] = 0.0
    for d in decodes:
        for field in fields:
            if field == "seconds":
                totals[field] += d.wall_seconds if clock == "wall" else d.stats.seconds
            elif field in ("phase_forwards", "committed_by"):
                for key, count in getattr(d.stats, field).items():
                    totals[field][key] = totals[field].get(key, 0) + count
            else:
                totals[field] += getattr(d.stats, field)
    return totals


def identical(decodes: Sequence[Decoded], reference: Sequence[Decoded]) -> int:
    """How many of `decodes` generated the same ids as `reference` did on the same prompt."""
    return sum(a.sequence == b.sequence for a, b in zip(decodes, reference, strict=True))


def add_rates(totals: dict, ar: dict | None = None) -> dict:
    """`totals` with tokens_per_forward, tokens_per_second and, given AR decoding's totals, speed_vs_ar (tokens/s
    over AR's), each from the sums."""
    totals["tokens_per_forward"] = totals["tokens"] / totals["forwards"]
    totals["tokens_per_second"] = totals["tokens"] / totals["seconds"]
    if ar is not None:
        totals["speed_vs_ar"] = totals["tokens_per_second"] / (ar["tokens"] / ar["seconds"])
    return totals


def conditions() -> dict:
    """What a result depends on besides the code: torch's threads and version, the machine, the time."""
    import torch

    return {"threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def cpu_name() -> str:
    """The CPU's model name (what a number is reported with, beside `lscpu`'s flags in docs/BENCHMARKS.md)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def exit_on_sigterm() -> None:
    """SIGTERM ends the benchmark as Ctrl-C does, through its `finally` blocks, so the servers and engines it
    started stop with it (the default action ends the process on the spot and leaves them running)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def emit(report: dict) -> None:
    """The benchmark's last line: its report as one JSON line."""
    print(json.dumps(report), flush=True)
