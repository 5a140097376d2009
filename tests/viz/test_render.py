"""Renderers on a hand-built trace: frames (replay), GIF, HTML page, terminal views."""

import io
import json
import re
from types import SimpleNamespace

from rich.console import Console

from refusion.viz.replay import frames


def states(frame) -> str:
    return "".join({"hidden": "h", "masked": "m", "dropped": "x", "fast_accept": "f",
                    "parallel_completion": "p", "speculative": "s", "autoregressive": "a"}[c.state]
                   for c in frame.cells)


def test_replay_frames(trace_doc, ar_doc):
    seq = trace_doc.sequences[0]
    got = frames(seq, trace_doc.settings)
    assert [states(f) for f in got] == ["ffffmmmmhhhhhhhh", "ffffpppphhhhhhhh", "ffffppppppppxxxx"]
    assert got[0].committed == {0, 1, 2, 3} and got[0].planned[4] == (4, "c", 0.93)
    assert [f.tokens for f in got] == [4, 8, 12] and got[-1].forwards == 11
    cat = got[1].cells[5]
    assert (cat.text, cat.round, cat.slot, cat.score, cat.draft) == ("a", 1, 4, 0.81, "o")
    ar = frames(ar_doc.sequences[0], ar_doc.settings)
    assert [states(f) for f in ar] == ["ahhhh", "aahhh", "aaahh", "aaaah", "aaaaa"]


def _has_colour(image, rgb) -> bool:
    return any(count for count, colour in image.getcolors(1 << 16) if colour == rgb)


def test_gif_one_frame_per_round(tmp_path, trace_doc, ar_doc):
    from PIL import Image

    from refusion.viz.gif import COLOURS, render_frames, save_gif

    images = render_frames(trace_doc)
    assert len(images) == 3  # the longest sequence has 3 rounds, the other holds its last frame
    fast, parallel = COLOURS["fast_accept"], COLOURS["parallel_completion"]
    assert _has_colour(images[0], fast[1]) and not _has_colour(images[0], parallel[0])
    assert _has_colour(images[2], fast[0]) and _has_colour(images[2], parallel[1])
    assert len(render_frames(trace_doc, [1])) == 2
    path = save_gif(ar_doc, tmp_path / "ar.gif", frame_ms=100)
    with Image.open(path) as gif:
        assert gif.n_frames == 5 and gif.info["loop"] == 0
        assert gif.size[0] == 960 and gif.size[1] > 100


def test_html_is_self_contained(tmp_path, trace_doc):
    from refusion.viz.html import save_html

    trace_doc.sequences[0].prompt = "</script><b>hi</b> & <!--"
    page = save_html(trace_doc, tmp_path / "t.html").read_text()
    assert page.count("</script>") == 2 and "<b>hi</b>" not in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page) and "@import" not in page
    raw = re.search(r'<script type="application/json" id="trace-data">(.*?)</script>', page, re.S).group(1)
    data = json.loads(raw)
    assert data["sequences"][0]["prompt"] == "</script><b>hi</b> & <!--"
    seq = data["sequences"][0]
    assert [f["states"] for f in seq["frames"]] == ["ffffmmmmhhhhhhhh", "ffffpppphhhhhhhh", "ffffppppppppxxxx"]
    assert seq["frames"][0]["planned"]["4"] == [4, "c", 0.93] and seq["cells"][4]["how"] == "parallel_completion"
    assert len(data["sequences"]) == 2 and len(data["sequences"][1]["frames"]) == 2


def test_terminal_summary_and_live_view(trace_doc):
    import refusion
    from refusion.decode.outputs import RoundTrace, SlotEvent
    from refusion.model.tiny import tiny_tokenizer
    from refusion.viz.terminal import LiveView, print_trace

    buffer = io.StringIO()
    print_trace(trace_doc, Console(file=buffer, width=160))
    text = buffer.getvalue()
    assert "the cat sat<|im_end|>" in text and "fast accept 1 rounds / 4 tokens" in text
    assert "@4:0.93" in text and text.count("tell me about cats") == 1

    tokenizer = tiny_tokenizer()
    buffer = io.StringIO()
    cfg = refusion.DecodeConfig(max_new_tokens=8, slot_size=4, block_size=8)
    seq = SimpleNamespace(id=0, prompt_length=3, cfg=cfg)
    enc = tokenizer.convert_tokens_to_ids
    with LiveView(tokenizer, ["hey"], console=Console(file=buffer, width=100)) as view:
        view(seq, RoundTrace(index=0, block=0, masked_slots=[3, 7],
                             planned=[SlotEvent(3, enc(list("abcd")), 0.9), SlotEvent(7, enc(list("wxyz")), 0.8)],
                             committed=[SlotEvent(3, enc(list("abcd")))], how="fast_accept", forwards=2))
        view(seq, RoundTrace(index=1, block=0, masked_slots=[7], planned=[SlotEvent(7, enc(list("efgh")), 0.7)],
                             committed=[SlotEvent(7, enc(list("efgh")))], how="parallel_completion", forwards=4,
                             finished=True))
        stats = refusion.SequenceStats(tokens=8, forwards=6, rounds=2, seconds=0.1, finish_reason="eos")
        view.finish(SimpleNamespace(stats=SimpleNamespace(per_sequence=[stats])))
    text = buffer.getvalue()
    assert "abcdefgh" in text and "tokens 8 · rounds 2 · forwards 6" in text and "hey" in text


def test_speculative_frames_and_round_lines(speculative_doc):
    from refusion.viz.replay import describe_round

    seq = speculative_doc.sequences[0]
    got = frames(seq, speculative_doc.settings)
    assert [states(f) for f in got] == ["sssmhhh", "ssssmmm", "sssssxx"]  # no blocks: the canvas grows as drafted
    assert got[0].planned[3] == (1, "x", None) and got[0].cells[1].draft == "b"  # an accepted draft
    assert [f.forwards for f in got] == [2, 3, 3]
    lines = [describe_round(seq, r, 3) for r in seq.rounds]
    assert lines[0] == ("round 1/3 · speculative (exact) · accepted 2/3 drafts · committed 3 tokens · "
                        "2 fwd (prefill 1 + verify 1)")
    assert lines[2].endswith("committed 1 token · 0 fwd · EOS")


def test_summary_says_where_the_forwards_go(trace_doc, speculative_doc):
    from refusion.viz.replay import describe_round, summary_parts
    from refusion.viz.terminal import print_trace

    seq = trace_doc.sequences[0]
    assert [text for text, _ in summary_parts(seq)] == [
        "forwards plan 2 + verify 3 + complete 6", "fused plans 1", "fast accept 1 rounds / 4 tokens",
        "parallel completion 2 rounds / 8 tokens"]
    assert describe_round(seq, seq.rounds[2]).endswith("5 fwd (plan fused + verify 1 + complete 4) · EOS")
    spec = [text for text, _ in summary_parts(speculative_doc.sequences[0])]
    assert spec == ["forwards prefill 1 + verify 2", "speculative (exact) 3 rounds / 5 tokens",
                    "drafts accepted 2/6 (33%)"]

    buffer = io.StringIO()
    print_trace(speculative_doc, Console(file=buffer, width=200))
    text = buffer.getvalue()
    assert "forwards prefill 1 + verify 2" in text and "drafts accepted 2/6 (33%)" in text
    assert "@1 accepted 2/3" in text and "strategy speculative · draft 3" in text

    from refusion.viz.html import page_data
    data = page_data(speculative_doc)
    assert data["sequences"][0]["summary"] == spec and data["labels"]["speculative"] == "speculative (exact)"
    assert [f["states"] for f in data["sequences"][0]["frames"]] == ["sssmhhh", "ssssmmm", "sssssxx"]


def test_speculative_gif(tmp_path, speculative_doc):
    from refusion.viz.gif import COLOURS, render_frames

    images = render_frames(speculative_doc)
    assert len(images) == 3
    assert _has_colour(images[0], COLOURS["speculative"][1]) and _has_colour(images[2], COLOURS["speculative"][0])
