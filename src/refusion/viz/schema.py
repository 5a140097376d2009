"""The trace file: what a decoding run did, round by round, readable without the model.

A trace file is one JSON object (docs/VISUALIZATION.md has the full schema):

    {"format": "refusion-trace", "version": 1, "model": ..., "settings": {DecodeConfig fields},
     "sequences": [{"index", "prompt", "prompt_length", "canvas_length", "response", "response_ids",
                    "finish_reason", "stats", "rounds": [...]}, ...]}

Each round holds the slots the plan step selected (drafts and scores) and the slots it committed, with
absolute positions (prompt length + offset in the response) and the text of every token, so renderers
need neither model nor tokenizer. Each round also says where its forwards went (`phase_forwards`,
`fused_plan`) and, for the speculative strategy, how many drafts were verified and accepted. `load_trace`
checks every field and raises ValueError naming the first problem (truncated file, wrong format, newer
version, bad field).

Versions: 1 (no per-round accounting), 2 (adds `phase_forwards`, `fused_plan`, `drafted`, `accepted` to
rounds and the "speculative" round kind). A version-1 file reads with those fields empty / false / 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from refusion.decode.outputs import RoundAccounting

FORMAT = "refusion-trace"
VERSION = 2
HOWS = ("fast_accept", "parallel_completion", "speculative", "autoregressive")
"""Kinds of round: ReFusion's fast accept and parallel completion, the exact speculative mode, AR decoding."""
PHASES = ("prefill", "plan", "verify", "complete", "decode")
"""Where a forward can go (RoundTrace.phase_forwards), in the order views list them."""


@dataclass
class SlotRecord:
    """One slot of one round: its drafts (planned) or the tokens committed."""

    start: int
    """Absolute position of the slot's first token."""
    tokens: list[int]
    """Token ids, one per position from `start`."""
    texts: list[str]
    """Text of each token (decoded alone, special tokens kept)."""
    score: float | None = None
    """Planning score (confidence of the first draft), for planned slots."""


@dataclass
class RoundRecord(RoundAccounting):
    """One round of decoding (docs/DECODING.md); for the AR strategy, one token; for the speculative
    strategy, one verify forward (its drafts are `planned`, the tokens it accepted `committed`). The
    accounting fields (`phase_forwards`, `fused_plan`, `drafted`, `accepted`) come from version 2 on; version-1
    files give their defaults."""

    index: int
    """Round number, from 0."""
    block: int
    """Block being decoded."""
    how: str
    """"fast_accept", "parallel_completion", "speculative" or "autoregressive"."""
    forwards: int
    """Forward passes spent in the round (the first one includes the prompt)."""
    masked_slots: list[int]
    """Start positions of the block's slots still masked when the round began."""
    planned: list[SlotRecord]
    """Slots selected by the plan step, with their drafts and scores."""
    committed: list[SlotRecord]
    """Slots committed in the round, in commit order (cut after EOS)."""
    finished: bool = False
    """Whether EOS was committed in this round."""


@dataclass
class SequenceTrace:
    """The decoding of one prompt of a batch."""

    index: int
    """Position of the prompt in the batch."""
    prompt: str
    """The prompt as the user gave it (before any chat template)."""
    prompt_length: int
    """Prompt tokens fed to the model (template included); response positions start here."""
    canvas_length: int
    """Response positions the decoder may fill (max_new_tokens rounded up to whole slots)."""
    response: str
    """Final response text (special tokens skipped)."""
    response_ids: list[int]
    """Final response token ids, up to and including EOS."""
    finish_reason: str
    """"eos" or "length"."""
    stats: dict
    """SequenceStats.to_dict(): tokens, forwards, rounds, seconds, tokens_per_forward, ..."""
    rounds: list[RoundRecord] = field(default_factory=list)


@dataclass
class TraceDocument:
    """A whole trace file: the settings of the run and one trace per sequence."""

    settings: dict
    """DecodeConfig fields of the run (slot_size, block_size, thresholds, strategy, ...)."""
    sequences: list[SequenceTrace]
    model: str | None = None
    """What the model was loaded from, when known."""
    version: int = VERSION

    @property
    def slot_size(self) -> int:
        return int(self.settings.get("slot_size", 1))

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": self.version, "model": self.model, "settings": self.settings,
                "sequences": [dataclasses.asdict(s) for s in self.sequences]}


# ---------------------------------------------------------------------------------------------------------
# from the engine's trace


def token_texts(tokenizer):
    """A function ids -> texts, decoding each token alone (cached; special tokens kept)."""
    cache: dict[int, str] = {}

    def texts(ids: list[int]) -> list[str]:
        for i in ids:
            if i not in cache:
                cache[i] = tokenizer.decode([i], skip_special_tokens=False)
        return [cache[i] for i in ids]

    return texts


def round_record(rnd, texts) -> RoundRecord:
    """A RoundRecord from the engine's RoundTrace; `texts` maps ids to token texts (see `token_texts`)."""
    def slots(events):
        return [SlotRecord(int(e.start), list(e.tokens), texts(list(e.tokens)), e.score) for e in events]

    return RoundRecord(rnd.index, rnd.block, rnd.how, rnd.forwards, list(rnd.masked_slots),
                       slots(rnd.planned), slots(rnd.committed), bool(rnd.finished),
                       phase_forwards={k: int(v) for k, v in getattr(rnd, "phase_forwards", {}).items()},
                       fused_plan=bool(getattr(rnd, "fused_plan", False)), drafted=int(getattr(rnd, "drafted", 0)),
                       accepted=int(getattr(rnd, "accepted", 0)))


def build_trace(output, tokenizer, prompts: list[str], input_ids: list[list[int]], cfg,
                model: str | None = None) -> TraceDocument:
    """The trace document of a `generate(..., trace=True)` run (one SequenceTrace per prompt)."""
    if output.traces is None:
        raise ValueError("the generation output has no trace: call generate(..., trace=True)")
    texts = token_texts(tokenizer)
    settings = {**dataclasses.asdict(cfg), "canvas_length": cfg.canvas_length}
    sequences = []
    for i, (prompt, ids, tokens, rounds) in enumerate(zip(prompts, input_ids, output.sequences, output.traces, strict=True)):
        stats = output.stats.per_sequence[i]
        sequences.append(SequenceTrace(
            index=i, prompt=prompt, prompt_length=len(ids), canvas_length=cfg.canvas_length,
            response=tokenizer.decode(tokens, skip_special_tokens=True), response_ids=list(tokens),
            finish_reason=stats.finish_reason, stats=stats.to_dict(),
            rounds=[round_record(r, texts) for r in rounds]))
    return TraceDocument(settings=settings, sequences=sequences, model=model)


# ---------------------------------------------------------------------------------------------------------
# save / load


def save_trace(doc: TraceDocument, path: str | os.PathLike) -> Path:
    """Write the trace as JSON (the whole file at once: a crash never leaves half a trace)."""
    path = Path(path)
    check_writable(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc.to_dict(), ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def check_writable(path: str | os.PathLike) -> None:
    """ValueError unless `path` can be created: its folder exists and it is not a folder itself."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: give a file name for the output")
    if not path.parent.is_dir():
        raise ValueError(f"cannot write {path}: folder {path.parent} does not exist")


def load_trace(path: str | os.PathLike) -> TraceDocument:
    """Read and validate a trace file; ValueError names the problem, FileNotFoundError a missing file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {path} does not exist" if not path.exists()
                                else f"{path} is not a file")
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        body = text.strip()
        truncated = e.pos >= len(text.rstrip()) or (body.startswith("{") and not body.endswith("}"))
        what = "is empty" if not body else "is truncated" if truncated else "is not valid JSON"
        raise ValueError(f"trace file {path} {what} (line {e.lineno}, column {e.colno}: {e.msg})") from None
    try:
        return trace_from_dict(data)
    except ValueError as e:
        raise ValueError(f"trace file {path}: {e}") from None


def trace_from_dict(data) -> TraceDocument:
    """Validate a decoded trace file; ValueError names the first bad field (e.g. sequences[0].rounds[2].how)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"not a refusion trace (format is {got!r}, expected {FORMAT!r})")
    version = _get(data, "version", int, "")
    if version > VERSION:
        raise ValueError(f"version {version} is newer than this refusion reads ({VERSION}): upgrade refusion")
    if version < 1:
        raise ValueError(f"version {version} is invalid (expected 1..{VERSION})")
    settings = _get(data, "settings", dict, "")
    slot_size = settings.get("slot_size")
    if not isinstance(slot_size, int) or isinstance(slot_size, bool) or slot_size < 1:
        raise ValueError(f"settings.slot_size must be a positive integer, got {slot_size!r}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ValueError(f"model must be a string or null, got {type(model).__name__}")
    raw = _get(data, "sequences", list, "")
    if not raw:
        raise ValueError("sequences is empty: the trace holds no sequence")
    sequences = [_sequence(s, f"sequences[{i}]") for i, s in enumerate(raw)]
    return TraceDocument(settings=settings, sequences=sequences, model=model, version=version)


def _get(obj, key: str, kind, where: str, optional: bool = False):
    name = f"{where}.{key}" if where else key
    if not isinstance(obj, dict):
        raise ValueError(f"{where or 'the file'} must be an object, got {type(obj).__name__}")
    if key not in obj:
        if optional:
            return None
        raise ValueError(f"{name} is missing")
    value = obj[key]
    if optional and value is None:
        return None
    kinds = (int, float) if kind is float else kind
    if not isinstance(value, kinds) or (kind in (int, float) and isinstance(value, bool)):
        expected = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
                    bool: "true or false"}[kind]
        raise ValueError(f"{name} must be {expected}, got {json.dumps(value)[:40]}")
    return value


def _sequence(obj, where: str) -> SequenceTrace:
    seq = SequenceTrace(
        index=_get(obj, "index", int, where), prompt=_get(obj, "prompt", str, where),
        prompt_length=_get(obj, "prompt_length", int, where), canvas_length=_get(obj, "canvas_length", int, where),
        response=_get(obj, "response", str, where), response_ids=_int_list(obj, "response_ids", where),
        finish_reason=_get(obj, "finish_reason", str, where), stats=_get(obj, "stats", dict, where))
    if seq.prompt_length < 0 or seq.canvas_length < 0:
        raise ValueError(f"{where}: prompt_length and canvas_length must be >= 0")
    rounds = _get(obj, "rounds", list, where)
    seq.rounds = [_round(r, f"{where}.rounds[{i}]", seq) for i, r in enumerate(rounds)]
    return seq


def _round(obj, where: str, seq: SequenceTrace) -> RoundRecord:
    how = _get(obj, "how", str, where)
    if how not in HOWS:
        raise ValueError(f"{where}.how is {how!r}, expected one of {', '.join(HOWS)}")
    rnd = RoundRecord(
        index=_get(obj, "index", int, where), block=_get(obj, "block", int, where), how=how,
        forwards=_get(obj, "forwards", int, where), masked_slots=_int_list(obj, "masked_slots", where),
        planned=[_slot(s, f"{where}.planned[{i}]", seq) for i, s in enumerate(_get(obj, "planned", list, where))],
        committed=[_slot(s, f"{where}.committed[{i}]", seq)
                   for i, s in enumerate(_get(obj, "committed", list, where))],
        finished=_get(obj, "finished", bool, where))
    # version 2: where the forwards went (absent from version-1 files: defaults)
    phases = _get(obj, "phase_forwards", dict, where, optional=True) or {}
    for phase, n in phases.items():
        if phase not in PHASES or not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"{where}.phase_forwards[{phase!r}] must be a count >= 0 of one of "
                             f"{', '.join(PHASES)}, got {json.dumps(n)[:40]}")
    rnd.phase_forwards = dict(phases)
    rnd.fused_plan = bool(_get(obj, "fused_plan", bool, where, optional=True))
    for name in ("drafted", "accepted"):
        value = _get(obj, name, int, where, optional=True) or 0
        if value < 0:
            raise ValueError(f"{where}.{name} must be >= 0, got {value}")
        setattr(rnd, name, value)
    if rnd.accepted > rnd.drafted:
        raise ValueError(f"{where}: accepted {rnd.accepted} drafts of {rnd.drafted}")
    return rnd


def _slot(obj, where: str, seq: SequenceTrace) -> SlotRecord:
    slot = SlotRecord(start=_get(obj, "start", int, where), tokens=_int_list(obj, "tokens", where),
                      texts=_get(obj, "texts", list, where), score=_get(obj, "score", float, where, optional=True))
    if not all(isinstance(t, str) for t in slot.texts) or len(slot.texts) != len(slot.tokens):
        raise ValueError(f"{where}.texts must be one string per token ({len(slot.tokens)})")
    end = seq.prompt_length + seq.canvas_length
    if not seq.prompt_length <= slot.start <= slot.start + len(slot.tokens) <= end:
        raise ValueError(f"{where}: positions {slot.start}..{slot.start + len(slot.tokens) - 1} lie outside the "
                         f"response canvas {seq.prompt_length}..{end - 1}")
    return slot


def _int_list(obj, key: str, where: str) -> list[int]:
    values = _get(obj, key, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{where}.{key} must be a list of integers")
    return values
