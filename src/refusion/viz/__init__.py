"""Seeing the decoding: the trace file format and its renderers (terminal, HTML page, animated GIF).

`schema` (trace file, no heavy imports), `replay` (frames: the canvas after each round), `terminal`
(rich live view and summaries), `html` (self-contained page), `gif` (Pillow), `cli` (`refusion trace`).
"""

from refusion.viz.schema import FORMAT, VERSION, TraceDocument, build_trace, load_trace, save_trace

__all__ = ["FORMAT", "VERSION", "TraceDocument", "build_trace", "load_trace", "save_trace"]
