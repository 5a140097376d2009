"""`refusion trace`: render a saved decoding trace (terminal summary, HTML page, animated GIF)."""

from __future__ import annotations

import argparse


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="render a decoding trace (terminal, HTML, GIF)",
        description="Render a trace saved by `refusion generate --trace FILE`. Without --html/--gif it prints "
                    "the final canvas, the rounds and the stats of each sequence.")
    p.add_argument("file", metavar="TRACE", help="trace file (JSON) written by `refusion generate --trace`")
    p.add_argument("--html", metavar="OUT", default=None, help="write a self-contained HTML page to step through")
    p.add_argument("--gif", metavar="OUT", default=None, help="write an animated GIF, one frame per round")
    p.add_argument("--sequence", metavar="I", type=int, action="append", default=None,
                   help="only sequence I of a batched trace (repeat for several; default: all)")
    p.add_argument("--play", action="store_true", help="replay the rounds live in the terminal")
    p.add_argument("--delay", type=float, default=0.4, help="seconds between rounds for --play (default 0.4)")
    p.add_argument("--frame-ms", type=int, default=700, help="GIF: milliseconds per round (default 700)")
    p.add_argument("--width", type=int, default=960, help="GIF: image width in pixels (default 960)")
    p.add_argument("--font-size", type=int, default=18, help="GIF: text size (default 18)")
    p.add_argument("--font", default=None, help="GIF: path of a TrueType font (default: a monospace one found)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from refusion.viz.schema import check_writable, load_trace

    for name in ("html", "gif"):
        if getattr(args, name):
            check_writable(getattr(args, name))
    if args.frame_ms < 10 or args.width < 200 or args.font_size < 6:
        raise ValueError("--frame-ms must be >= 10, --width >= 200 and --font-size >= 6")
    doc = load_trace(args.file)
    sequences = args.sequence
    if sequences is not None:
        bad = [i for i in sequences if not 0 <= i < len(doc.sequences)]
        if bad:
            raise ValueError(f"--sequence {bad[0]} is out of range: the trace holds {len(doc.sequences)} "
                             f"sequence(s), 0..{len(doc.sequences) - 1}")
    if args.html:
        from refusion.viz.html import save_html
        print(f"wrote {save_html(doc, args.html, sequences)}")
    if args.gif:
        from refusion.viz.gif import save_gif
        path = save_gif(doc, args.gif, sequences, frame_ms=args.frame_ms, width=args.width,
                        font_size=args.font_size, font_path=args.font)
        print(f"wrote {path}")
    if args.play:
        from refusion.viz.terminal import play_trace
        play_trace(doc, delay=args.delay, sequences=sequences)
    elif not (args.html or args.gif):
        from refusion.viz.terminal import print_trace
        print_trace(doc, sequences=sequences)
    return 0
