"""An animated GIF of a trace (Pillow): one frame per round, every sequence of the batch stacked.

Each response position is a box sized by its final text, so the layout does not move between frames:
grey boxes are masked positions, yellow ones the drafts of slots the plan selected but sent back, green
and blue the slots fast-accepted and completed in parallel (bright in the round that commits them, pale
afterwards), purple the tokens of the exact speculative mode, orange those of the autoregressive baseline.
The last frame ends with the summary: forwards per phase, tokens per kind of round, drafts accepted.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from refusion.viz.replay import (
    DROPPED,
    HIDDEN,
    HOW_LABELS,
    LEFT_TO_RIGHT,
    MASKED,
    Frame,
    describe_round,
    display_text,
    frames,
    summary_parts,
)
from refusion.viz.schema import SequenceTrace, TraceDocument, check_writable
from refusion.viz.terminal import settings_line

# how -> (fill once committed, fill in the round that commits it, text colour in that round)
COLOURS = {
    "fast_accept": ((208, 243, 208), (40, 170, 40), (255, 255, 255)),
    "parallel_completion": ((212, 228, 255), (31, 105, 215), (255, 255, 255)),
    "speculative": ((234, 220, 250), (138, 63, 209), (255, 255, 255)),
    "autoregressive": ((255, 228, 194), (230, 130, 0), (255, 255, 255)),
}
BACKGROUND, INK, GREY_INK, PROMPT_INK = (255, 255, 255), (30, 30, 30), (110, 110, 110), (0, 90, 180)
MASK_FILL, DRAFT_FILL, DRAFT_INK, DROPPED_LINE = (222, 222, 222), (255, 240, 170), (150, 110, 0), (215, 215, 215)

MONO_FONTS = [  # tried in order; the last resort is Pillow's built-in scalable font
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf",
    "/usr/share/fonts/TTF/DejaVuSansMono.ttf",
    "/usr/share/fonts/dejavu/DejaVuSansMono.ttf",
    "/Library/Fonts/Menlo.ttc",
    "/System/Library/Fonts/Menlo.ttc",
    "C:/Windows/Fonts/consola.ttf",
]


def _require_pillow() -> None:
    try:
        import PIL  # noqa: F401
    except ImportError:
        raise ValueError("drawing a GIF needs Pillow: pip install 'refusion[viz]' (or pip install pillow)") from None


def find_font(size: int, path: str | None = None):
    """A monospace TrueType font: `path`, matplotlib's DejaVu Sans Mono, a system one, or Pillow's default."""
    _require_pillow()
    from PIL import ImageFont

    if path:
        try:
            return ImageFont.truetype(path, size)
        except OSError as e:
            raise ValueError(f"cannot load font {path}: {e}") from None
    candidates = list(MONO_FONTS)
    spec = importlib.util.find_spec("matplotlib")
    if spec is not None and spec.submodule_search_locations:
        root = Path(next(iter(spec.submodule_search_locations)))
        candidates.insert(0, str(root / "mpl-data" / "fonts" / "ttf" / "DejaVuSansMono.ttf"))
    for candidate in candidates:
        if os.path.isfile(candidate):
            try:
                return ImageFont.truetype(candidate, size)
            except OSError:
                continue
    return ImageFont.load_default(size=size)


@dataclass
class Style:
    """Sizes of the drawing, all derived from the font size."""

    width: int = 960
    """Image width in pixels."""
    font_size: int = 18
    """Token text size in points."""

    @property
    def margin(self) -> int:
        return self.font_size

    @property
    def line_height(self) -> int:
        return int(self.font_size * 1.75)

    @property
    def pad(self) -> int:
        return max(2, self.font_size // 6)


class _Painter:
    """Lays out every sequence once (from its final texts), then draws any frame on that layout."""

    def __init__(self, doc: TraceDocument, sequences: list[SequenceTrace], style: Style, font_path: str | None):
        self.doc, self.style = doc, style
        self.font = find_font(style.font_size, font_path)
        self.small = find_font(max(10, int(style.font_size * 0.72)), font_path)
        name = " ".join(self.font.getname()) if hasattr(self.font, "getname") else ""
        self.newline = "↵" if "DejaVu" in name or "Menlo" in name else "\\n"
        self.sequences = sequences
        self.frames = [frames(s, doc.settings) for s in sequences]
        self.layouts = [self._layout(s, f) for s, f in zip(sequences, self.frames, strict=True)]
        self.height = self._total_height()

    def text(self, t: str) -> str:
        return display_text(t, self.newline)

    def _layout(self, seq: SequenceTrace, seq_frames: list[Frame]) -> tuple[list[tuple[int, int, int]], int]:
        """Per position (x, line, box width), and the number of lines."""
        st = self.style
        k = 1 if all(r.how in LEFT_TO_RIGHT for r in seq.rounds) else self.doc.slot_size
        final = seq_frames[-1].cells if seq_frames else []
        min_width = int(self.font.getlength("M"))
        x, line, boxes = st.margin, 0, []
        for i, cell in enumerate(final):
            w = max(min_width, int(self.font.getlength(self.text(cell.text)))) + 2 * st.pad
            gap = st.pad * 2 if i % k == 0 and i else 1
            if x + gap + w > st.width - st.margin and x > st.margin:
                x, line = st.margin, line + 1
            elif i:
                x += gap
            boxes.append((x, line, w))
            x += w
            if "\n" in cell.text:
                x, line = st.width, line  # next token wraps
        return boxes, (line + 1 if boxes else 1)

    def _block_height(self, lines: int) -> int:
        return self.style.line_height * (2 + lines) + self.style.margin

    def _total_height(self) -> int:
        st = self.style
        body = sum(self._block_height(lines) for _, lines in self.layouts)
        summary = len(self.sequences)  # one summary line per sequence
        return st.margin + st.line_height + body + (2 + summary) * st.line_height  # legend, stats, summaries

    def draw(self, step: int):
        from PIL import Image, ImageDraw

        st = self.style
        image = Image.new("RGB", (st.width, self.height), BACKGROUND)
        draw = ImageDraw.Draw(image)
        y = st.margin
        self._line(draw, y, f"ReFusion · {settings_line(self.doc.settings)}", GREY_INK, self.small)
        y += st.line_height
        last = all(step >= len(f) - 1 for f in self.frames)
        for seq, seq_frames, (boxes, lines) in zip(self.sequences, self.frames, self.layouts, strict=True):
            frame = seq_frames[min(step, len(seq_frames) - 1)] if seq_frames else None
            prefix = f"[{seq.index}] " if len(self.doc.sequences) > 1 else ""
            self._line(draw, y, prefix + seq.prompt.strip().replace("\n", " "), PROMPT_INK, self.font)
            y += st.line_height
            info = describe_round(seq, frame.round, len(seq_frames)) if frame else "no rounds"
            if frame:
                info += f" · {frame.tokens} tokens / {frame.forwards} fwd"
            self._line(draw, y, info, GREY_INK, self.small)
            y += st.line_height
            if frame:
                self._canvas(draw, frame, boxes, y)
            y += lines * st.line_height + st.margin
        self._legend(draw, y)
        if last:
            self._line(draw, y + st.line_height, self._stats(), INK, self.small)
            for i, text in enumerate(self._summaries()):
                self._line(draw, y + (2 + i) * st.line_height, text, GREY_INK, self.small)
        return image

    def _canvas(self, draw, frame: Frame, boxes, top: int) -> None:
        st = self.style
        for i, cell in enumerate(frame.cells):
            if cell.state == HIDDEN:
                continue
            x, line, w = boxes[i]
            y0 = top + line * st.line_height
            y1 = y0 + st.line_height - st.pad * 2
            rect = (x, y0, x + w, y1)
            if cell.state in COLOURS:
                pale, bright, bright_ink = COLOURS[cell.state]
                now = i in frame.committed
                draw.rounded_rectangle(rect, radius=st.pad, fill=bright if now else pale)
                self._cell_text(draw, rect, self.text(cell.text), bright_ink if now else INK)
            elif cell.state == MASKED and i in frame.planned:
                draw.rounded_rectangle(rect, radius=st.pad, fill=DRAFT_FILL)
                self._cell_text(draw, rect, self.text(frame.planned[i][1]), DRAFT_INK)
            elif cell.state == MASKED:
                draw.rounded_rectangle(rect, radius=st.pad, fill=MASK_FILL)
            elif cell.state == DROPPED:
                draw.rounded_rectangle(rect, radius=st.pad, outline=DROPPED_LINE)

    def _cell_text(self, draw, rect, text: str, ink) -> None:
        x0, y0, x1, y1 = rect
        while text and self.font.getlength(text) > x1 - x0 - 2:
            text = text[:-1]  # a draft wider than its final token
        draw.text(((x0 + x1) / 2, (y0 + y1) / 2), text, fill=ink, font=self.font, anchor="mm")

    def _line(self, draw, y: int, text: str, ink, font) -> None:
        limit = self.style.width - 2 * self.style.margin
        if font.getlength(text) > limit:
            while text and font.getlength(text + "…") > limit:
                text = text[:-1]
            text += "…"
        draw.text((self.style.margin, y), text, fill=ink, font=font)

    def _legend(self, draw, y: int) -> None:
        st, x = self.style, self.style.margin
        used = {r.how for seq in self.sequences for r in seq.rounds}
        items = [(COLOURS[h][1], COLOURS[h][2], HOW_LABELS[h]) for h in COLOURS if h in used]
        if used - {"autoregressive"}:
            items += [(DRAFT_FILL, DRAFT_INK, "draft sent back"), (MASK_FILL, INK, "masked")]
        for fill, ink, label in items:
            w = int(self.small.getlength(label)) + 2 * st.pad
            draw.rounded_rectangle((x, y, x + w, y + st.line_height - 2 * st.pad), radius=st.pad, fill=fill)
            draw.text((x + w / 2, y + (st.line_height - 2 * st.pad) / 2), label, fill=ink, font=self.small,
                      anchor="mm")
            x += w + st.pad * 3

    def _stats(self) -> str:
        parts = []
        for seq in self.sequences:
            s = seq.stats
            tokens = s.get("tokens", 0)
            forwards = s.get("forwards") or sum(r.forwards for r in seq.rounds)
            prefix = f"[{seq.index}] " if len(self.sequences) > 1 else ""
            parts.append(f"{prefix}{tokens} tokens, {len(seq.rounds)} rounds, {forwards} fwd, "
                         f"{tokens / forwards if forwards else 0:.2f} tok/fwd")
        return " · ".join(parts)

    def _summaries(self) -> list[str]:
        """Per sequence: forwards per phase, tokens per kind of round, drafts accepted."""
        prefix = len(self.sequences) > 1
        return [(f"[{seq.index}] " if prefix else "") + " · ".join(text for text, _ in summary_parts(seq))
                for seq in self.sequences]


def render_frames(doc: TraceDocument, sequences: list[int] | None = None, *, width: int = 960,
                  font_size: int = 18, font_path: str | None = None) -> list:
    """One PIL image per round (the longest sequence sets the count; shorter ones hold their last frame)."""
    _require_pillow()
    chosen = [doc.sequences[i] for i in sequences] if sequences is not None else doc.sequences
    painter = _Painter(doc, chosen, Style(width, font_size), font_path)
    steps = max((len(f) for f in painter.frames), default=0)
    if steps == 0:
        raise ValueError("the trace has no rounds to draw")
    return [painter.draw(step) for step in range(steps)]


def save_gif(doc: TraceDocument, path: str | os.PathLike, sequences: list[int] | None = None, *,
             frame_ms: int = 700, last_frame_ms: int = 3000, width: int = 960, font_size: int = 18,
             font_path: str | None = None) -> Path:
    """Write the animated GIF (looping); returns its path."""
    path = Path(path)
    check_writable(path)
    images = render_frames(doc, sequences, width=width, font_size=font_size, font_path=font_path)
    durations = [frame_ms] * (len(images) - 1) + [last_frame_ms]
    palette = shared_palette(images)
    from PIL import Image

    frames_p = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    frames_p[0].save(path, format="GIF", save_all=True, append_images=frames_p[1:], duration=durations, loop=0,
                     disposal=1)
    return path


def shared_palette(images: list, colours: int = 128):
    """One palette for every frame, so unchanged regions keep their indices and the GIF stores only the
    changes (a 256-round trace: ~0.5 MB instead of ~10 MB). Solid swatches of the fixed colours make sure
    each survives the quantization, even when only a few pixels use it."""
    from PIL import Image, ImageDraw

    fixed = [BACKGROUND, INK, GREY_INK, PROMPT_INK, MASK_FILL, DRAFT_FILL, DRAFT_INK, DROPPED_LINE]
    fixed += [c for triple in COLOURS.values() for c in triple]
    samples = [images[0], images[len(images) // 2], images[-1]]
    width, height = images[0].size
    montage = Image.new("RGB", (width, height * len(samples) + 64), BACKGROUND)
    for i, image in enumerate(samples):
        montage.paste(image, (0, i * height))
    draw = ImageDraw.Draw(montage)
    for i, colour in enumerate(fixed):
        x = (i * 64) % width
        draw.rectangle((x, height * len(samples), x + 63, height * len(samples) + 63), fill=colour)
    return montage.quantize(colors=colours, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
