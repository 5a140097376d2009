"""Terminal views (rich): a live view of decoding, and a replay/summary of a saved trace.

Live, as the `on_round` callback of `refusion.generate`:

    view = LiveView(tokenizer, prompts)
    with view:
        out = refusion.generate(model, ids, cfg, on_round=view)
        view.finish(out)

The response canvas fills in slot by slot: masked positions are dim dots, slots committed this round are
highlighted (green: fast accept, blue: parallel completion, purple: speculative, orange: autoregressive),
slots the plan drafted but sent back (speculative: drafts rejected) show their draft in yellow. Each round
line says where its forwards went (plan / verify / complete); the stats at the end add them up, with the
tokens each kind of round committed and the share of speculative drafts accepted.
"""

from __future__ import annotations

import dataclasses
import time

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from refusion.viz.replay import (
    DROPPED,
    HIDDEN,
    HOW_LABELS,
    MASKED,
    Frame,
    Replay,
    describe_round,
    display_text,
    frames,
    phase_text,
    round_counts,
    summary_parts,
)
from refusion.viz.schema import SequenceTrace, TraceDocument, round_record, token_texts

# how -> (style once committed, style in the round that commits it)
STYLES = {
    "fast_accept": ("green3", "bold black on green3"),
    "parallel_completion": ("dodger_blue1", "bold white on dodger_blue2"),
    "speculative": ("medium_purple1", "bold white on purple3"),
    "autoregressive": ("orange1", "bold black on orange1"),
}
MASK_STYLE, DRAFT_STYLE, DROPPED_STYLE = "grey42", "italic yellow", "grey27"
MASK_CHAR = "·"


def canvas_text(frame: Frame, widths: list[int] | None = None) -> Text:
    """The response canvas of one frame; `widths` (chars per position) keeps masks as wide as their text."""
    text = Text()
    for i, cell in enumerate(frame.cells):
        width = max(1, widths[i]) if widths else 1
        if cell.state == HIDDEN:
            continue
        if cell.state in STYLES:
            text.append(display_text(cell.text), STYLES[cell.state][i in frame.committed])
        elif cell.state == MASKED and i in frame.planned:
            text.append(display_text(frame.planned[i][1]), DRAFT_STYLE)
        elif cell.state == MASKED:
            text.append(MASK_CHAR * width, MASK_STYLE)
        elif cell.state == DROPPED and widths is None:
            continue  # live view: the canvas simply ends after EOS
        elif cell.state == DROPPED:
            text.append(" " * width, DROPPED_STYLE)
    return text


def legend() -> Text:
    text = Text("  ")
    for how, (_, style) in STYLES.items():
        text.append(f" {HOW_LABELS[how]} ", style)
        text.append("  ")
    text.append("draft sent back", DRAFT_STYLE)
    text.append("  ")
    text.append(MASK_CHAR * 3 + " masked", MASK_STYLE)
    return text


def stats_line(seq: SequenceTrace, stats: dict | None = None) -> Text:
    stats = stats or seq.stats
    counts = round_counts(seq)
    tokens = stats.get("tokens", sum(c["tokens"] for c in counts.values()))
    forwards = stats.get("forwards") or sum(r.forwards for r in seq.rounds)
    line = Text(f"tokens {tokens} · rounds {len(seq.rounds)} · forwards {forwards} · tokens/forward "
                f"{tokens / forwards if forwards else 0:.2f}", "bold")
    for part, how in summary_parts(dataclasses.replace(seq, stats=stats)):
        line.append(f" · {part}", STYLES[how][0] if how else "")
    if stats.get("seconds"):
        line.append(f" · {stats['seconds']:.2f} s")
    if stats.get("finish_reason"):
        line.append(f" · {stats['finish_reason']}")
    return line


def sequence_panel(seq: SequenceTrace, frame: Frame | None, *, total: int | None = None,
                   widths: list[int] | None = None, stats: dict | None = None, batch: bool = False) -> Group:
    title = Text(f"[{seq.index}] " if batch else "", "bold")
    title.append(seq.prompt.strip().replace("\n", " ")[:100], "bold cyan")
    parts = [title]
    if frame is None:
        parts.append(Text("(waiting for the first round)", MASK_STYLE))
    else:
        parts += [Text(describe_round(seq, frame.round, total), "grey62"), canvas_text(frame, widths)]
    if stats is not None:
        parts.append(stats_line(seq, stats))
    return Group(*parts, Text(""))


class LiveView:
    """Live terminal view of a decoding run; call it as `on_round(seq, rnd)` inside `with view:`."""

    def __init__(self, tokenizer, prompts: list[str] | None = None, *, console: Console | None = None):
        self.texts = token_texts(tokenizer)
        self.prompts = list(prompts or [])
        self.console = console or Console(stderr=True)
        self.sequences: dict[int, SequenceTrace] = {}
        self.replays: dict[int, Replay] = {}
        self.last: dict[int, Frame] = {}
        self.stats: dict[int, dict] = {}
        self._live = Live(console=self.console, auto_refresh=False, transient=False)

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        self._live.update(self.renderable(), refresh=True)
        return self

    def __exit__(self, *exc) -> None:
        self._live.update(self.renderable(), refresh=True)
        self._live.__exit__(*exc)

    def __call__(self, seq, rnd) -> None:
        trace = self.sequences.get(seq.id)
        if trace is None:
            prompt = self.prompts[seq.id] if seq.id < len(self.prompts) else f"sequence {seq.id}"
            trace = SequenceTrace(seq.id, prompt, seq.prompt_length, seq.cfg.canvas_length, "", [], "", {})
            self.sequences[seq.id] = trace
            self.replays[seq.id] = Replay(trace, dataclasses.asdict(seq.cfg))
        record = round_record(rnd, self.texts)
        trace.rounds.append(record)
        self.last[seq.id] = self.replays[seq.id].step(record)
        self._live.update(self.renderable(), refresh=True)

    def finish(self, output) -> None:
        """Add the final statistics of `generate`'s output."""
        self.stats = {i: s.to_dict() for i, s in enumerate(output.stats.per_sequence)}
        self._live.update(self.renderable(), refresh=True)

    def renderable(self) -> Group:
        n = max(len(self.prompts), len(self.sequences))
        panels = []
        for i in range(n):
            seq = self.sequences.get(i)
            if seq is None:
                prompt = self.prompts[i] if i < len(self.prompts) else f"sequence {i}"
                panels.append(sequence_panel(SequenceTrace(i, prompt, 0, 0, "", [], "", {}), None, batch=n > 1))
                continue
            panels.append(sequence_panel(seq, self.last[i], stats=self.stats.get(i), batch=n > 1))
        return Group(*panels, legend())


def rounds_table(seq: SequenceTrace) -> Table:
    """One row per round: block, how, planned slots (offset:score), committed slots, forwards."""
    p = seq.prompt_length
    table = Table(show_edge=False, pad_edge=False, box=None, header_style="bold")
    for name in ("round", "block", "how", "planned @offset:score", "committed", "fwd", "forwards by phase"):
        table.add_column(name, justify="right" if name in ("round", "block", "fwd") else "left")
    for rnd in seq.rounds:
        planned = " ".join(f"@{s.start - p}:{s.score:.2f}" if s.score is not None else f"@{s.start - p}"
                           for s in rnd.planned)
        if rnd.how == "speculative" and rnd.drafted:
            planned = f"@{rnd.planned[0].start - p} accepted {rnd.accepted}/{rnd.drafted}" if rnd.planned else ""
        committed = Text()
        for s in rnd.committed:
            committed.append(f"@{s.start - p} ", "grey62")
            committed.append("".join(display_text(t) for t in s.texts) + " ", STYLES[rnd.how][0])
        table.add_row(str(rnd.index), str(rnd.block), HOW_LABELS[rnd.how], planned, committed, str(rnd.forwards),
                      phase_text(rnd.phase_forwards, rnd.fused_plan))
    return table


def print_trace(doc: TraceDocument, console: Console | None = None, *, sequences: list[int] | None = None,
                table: bool = True) -> None:
    """The final canvas, the rounds table and the stats of each sequence of a saved trace."""
    console = console or Console()
    chosen = [doc.sequences[i] for i in sequences] if sequences is not None else doc.sequences
    console.print(Text(f"refusion trace v{doc.version} · model {doc.model or '?'} · " + settings_line(doc.settings),
                       "grey62"))
    for seq in chosen:
        all_frames = frames(seq, doc.settings)
        widths = [len(display_text(c.text)) for c in all_frames[-1].cells] if all_frames else None
        console.print(sequence_panel(seq, all_frames[-1] if all_frames else None, total=len(all_frames),
                                     widths=widths, stats=seq.stats, batch=len(doc.sequences) > 1))
        if table:
            console.print(rounds_table(seq))
            console.print()
    console.print(legend())


def play_trace(doc: TraceDocument, console: Console | None = None, *, delay: float = 0.4,
               sequences: list[int] | None = None) -> None:
    """Replay a saved trace round by round in the terminal."""
    console = console or Console()
    chosen = [doc.sequences[i] for i in sequences] if sequences is not None else doc.sequences
    all_frames = [frames(seq, doc.settings) for seq in chosen]
    widths = [[len(display_text(c.text)) for c in f[-1].cells] if f else None for f in all_frames]
    steps = max((len(f) for f in all_frames), default=0)
    with Live(console=console, auto_refresh=False) as live:
        for step in range(steps):
            panels = [sequence_panel(seq, f[min(step, len(f) - 1)] if f else None, total=len(f), widths=w,
                                     stats=seq.stats if step == steps - 1 else None, batch=len(chosen) > 1)
                      for seq, f, w in zip(chosen, all_frames, widths, strict=True)]
            live.update(Group(*panels, legend()), refresh=True)
            if step < steps - 1:
                time.sleep(delay)


def settings_line(settings: dict) -> str:
    keys = [("strategy", "strategy"), ("slot_size", "k"), ("block_size", "b"), ("slot_threshold", "τ_slot"),
            ("token_threshold", "τ_token"), ("temperature", "T"), ("max_new_tokens", "max_new_tokens")]
    if settings.get("strategy") == "speculative":
        keys = [("strategy", "strategy"), ("draft_length", "draft"), ("predraft", "predraft"),
                ("temperature", "T"), ("max_new_tokens", "max_new_tokens")]
    elif "fused_plan" in settings:
        keys.append(("fused_plan", "fused plan"))
    return " · ".join(f"{label} {settings[key]}" for key, label in keys if key in settings)
