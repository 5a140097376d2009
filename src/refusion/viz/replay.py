"""Replay a trace into frames: the state of the response canvas after each round.

Every renderer (terminal, HTML, GIF) draws these frames, so they all agree on what a round did. A frame
holds one `Cell` per response position of the sequence's layout; positions of blocks not reached yet are
"hidden", positions a finished sequence never committed (after EOS) are "dropped".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from refusion.decode.outputs import add_counts
from refusion.viz.schema import HOWS, PHASES, RoundRecord, SequenceTrace

MASKED, HIDDEN, DROPPED = "masked", "hidden", "dropped"
HOW_LABELS = {"fast_accept": "fast accept", "parallel_completion": "parallel completion",
              "speculative": "speculative (exact)", "autoregressive": "autoregressive"}
LEFT_TO_RIGHT = ("speculative", "autoregressive")
"""Round kinds that commit from left to right, without blocks or slots."""


@dataclass(frozen=True)
class Cell:
    """One response position in one frame."""

    state: str
    """"masked", "hidden", "dropped", or how it was committed (one of schema.HOWS)."""
    text: str = ""
    """Committed token text ("" while not committed)."""
    round: int | None = None
    """Round that committed it."""
    slot: int | None = None
    """Offset (in the response) of the slot it was committed with."""
    score: float | None = None
    """Planning score of that slot in that round."""
    draft: str | None = None
    """What the plan step drafted for this position in that round (parallel completion may change it)."""


@dataclass
class Frame:
    """The canvas after one round."""

    round: RoundRecord
    cells: list[Cell]
    """One per response position of the layout (index = offset in the response)."""
    planned: dict[int, tuple[int, str, float | None]] = field(default_factory=dict)
    """Offset -> (slot offset, draft text, slot score) for every position planned this round."""
    committed: set[int] = field(default_factory=set)
    """Offsets committed this round."""
    tokens: int = 0
    """Response tokens committed so far."""
    forwards: int = 0
    """Forward passes so far."""


def layout_length(seq: SequenceTrace, block_size: int) -> int:
    """Response positions any frame shows: up to the end of the last block touched (AR: last token)."""
    end = 0
    for rnd in seq.rounds:
        end = max(end, _visible_end(seq, rnd, block_size))
    return min(end, seq.canvas_length)


def _visible_end(seq: SequenceTrace, rnd: RoundRecord, block_size: int) -> int:
    ends = [s.start + len(s.tokens) - seq.prompt_length for s in rnd.committed + rnd.planned]
    if rnd.how not in LEFT_TO_RIGHT:
        ends.append((rnd.block + 1) * block_size)
    return min(max(ends, default=0), seq.canvas_length)


class Replay:
    """The canvas of one sequence, advanced one round at a time (`step`); the live view uses it directly.

    With `length` (from `layout_length`) every frame has the same cells; without it, the canvas grows
    as blocks are reached.
    """

    def __init__(self, seq: SequenceTrace, settings: dict, length: int | None = None):
        self.seq, self.fixed = seq, length is not None
        self.block_size = int(settings.get("block_size") or settings.get("slot_size") or 1)
        self.cells: list[Cell] = [Cell(HIDDEN)] * (length or 0)
        self.visible = self.tokens = self.forwards = 0

    def step(self, rnd: RoundRecord) -> Frame:
        p = self.seq.prompt_length
        self.visible = max(self.visible, _visible_end(self.seq, rnd, self.block_size))
        if not self.fixed and len(self.cells) < self.visible:
            self.cells += [Cell(HIDDEN)] * (self.visible - len(self.cells))
        cells = [Cell(MASKED) if c.state == HIDDEN and i < self.visible else c for i, c in enumerate(self.cells)]
        scores = {s.start: s.score for s in rnd.planned}
        planned = {}  # where two chains draft a position (the exact mode's runner-up chain), the first one's draft
        for s in rnd.planned:
            for j, text in enumerate(s.texts):
                planned.setdefault(s.start - p + j, (s.start - p, text, s.score))
        committed = set()
        for s in rnd.committed:
            for j, text in enumerate(s.texts):
                i = s.start - p + j
                if i < len(cells):
                    draft = planned.get(i, (None, None, None))[1]
                    cells[i] = Cell(rnd.how, text, rnd.index, s.start - p, scores.get(s.start), draft)
                    committed.add(i)
                    self.tokens += 1
        if rnd.finished:
            cells = [Cell(DROPPED) if c.state in (MASKED, HIDDEN) else c for c in cells]
        self.cells = cells
        self.forwards += rnd.forwards
        return Frame(rnd, cells, planned, committed, self.tokens, self.forwards)


def frames(seq: SequenceTrace, settings: dict) -> list[Frame]:
    """One frame per round of the sequence, all with the same cells (the layout of the whole run)."""
    block_size = int(settings.get("block_size") or settings.get("slot_size") or 1)
    replay = Replay(seq, settings, layout_length(seq, block_size))
    return [replay.step(rnd) for rnd in seq.rounds]


def display_text(text: str, newline: str = "↵") -> str:
    """A token's text made visible on one line (newline -> ↵, tab -> ⇥, empty -> ∅)."""
    if text == "":
        return "∅"
    return text.replace("\r", "").replace("\n", newline).replace("\t", "⇥")


def round_counts(seq: SequenceTrace) -> dict[str, dict[str, int]]:
    """Per way of committing: rounds and tokens."""
    counts = {how: {"rounds": 0, "tokens": 0} for how in HOWS}
    for rnd in seq.rounds:
        counts[rnd.how]["rounds"] += 1
        counts[rnd.how]["tokens"] += rnd.tokens
    return counts


def phase_text(phases: dict[str, int], fused_plan: bool = False) -> str:
    """Forwards per phase in the order of schema.PHASES: "plan 1 + verify 1 + complete 4" ("plan fused" when
    the plan rode on the previous forward); "" when nothing is known (a version-1 trace)."""
    parts = [f"{phase} {phases[phase]}" for phase in PHASES if phases.get(phase)]
    parts += [f"{phase} {n}" for phase, n in phases.items() if phase not in PHASES and n]
    if fused_plan and not phases.get("plan"):
        parts.insert(0, "plan fused")
    return " + ".join(parts)


def phase_totals(seq: SequenceTrace) -> dict[str, int]:
    """Forwards per phase over the whole sequence (the stats' own count when the trace has it)."""
    if seq.stats.get("phase_forwards"):
        return dict(seq.stats["phase_forwards"])
    totals: dict[str, int] = {}
    for rnd in seq.rounds:
        add_counts(totals, rnd.phase_forwards)
    return totals


def draft_totals(seq: SequenceTrace) -> tuple[int, int]:
    """(accepted, drafted) over the sequence's speculative rounds."""
    return sum(r.accepted for r in seq.rounds), sum(r.drafted for r in seq.rounds)


def summary_parts(seq: SequenceTrace) -> list[tuple[str, str | None]]:
    """Where the forwards went and what each kind of round committed, as (phrase, round kind or None):
    ("forwards plan 3 + verify 3 + complete 4", None), ("fused plans 2", None),
    ("fast accept 1 rounds / 4 tokens", "fast_accept"), ..., ("drafts accepted 9/12 (75%)", None)."""
    parts: list[tuple[str, str | None]] = []
    phases = phase_text(phase_totals(seq))
    if phases:
        parts.append((f"forwards {phases}", None))
    fused = sum(r.fused_plan for r in seq.rounds)
    if fused:
        parts.append((f"fused plans {fused}", None))
    for how, c in round_counts(seq).items():
        if c["rounds"]:
            parts.append((f"{HOW_LABELS[how]} {c['rounds']} rounds / {c['tokens']} tokens", how))
    accepted, drafted = draft_totals(seq)
    if drafted:
        parts.append((f"drafts accepted {accepted}/{drafted} ({100 * accepted / drafted:.0f}%)", None))
    return parts


def describe_round(seq: SequenceTrace, rnd: RoundRecord, total: int | None = None) -> str:
    """One line: "round 3/9 · block 1 · parallel completion · planned @8 @12 · committed 8 tokens ·
    6 fwd (plan 1 + verify 1 + complete 4)"; a speculative round tells its drafts accepted."""
    p = seq.prompt_length
    planned = " ".join(f"@{s.start - p}" for s in rnd.planned)
    tokens = rnd.tokens
    parts = [f"round {rnd.index + 1}" + (f"/{total}" if total else "")]
    if rnd.how not in LEFT_TO_RIGHT:
        parts.append(f"block {rnd.block}")
    parts.append(HOW_LABELS[rnd.how])
    if rnd.how == "speculative":
        if rnd.drafted:
            parts.append(f"accepted {rnd.accepted}/{rnd.drafted} drafts")
    elif planned:
        parts.append(f"planned {planned}")
    phases = phase_text(rnd.phase_forwards, rnd.fused_plan)
    parts += [f"committed {tokens} token{'s' * (tokens != 1)}", f"{rnd.forwards} fwd" + (f" ({phases})" if phases else "")]
    if rnd.finished:
        parts.append("EOS")
    return " · ".join(parts)
