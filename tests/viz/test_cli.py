"""`refusion generate --trace/--show` and `refusion trace` end to end on a tiny saved model."""

import json

import pytest

import refusion.cli


@pytest.fixture
def main():
    return refusion.cli.main


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


def test_generate_trace_then_render(main, model_dir, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    assert main(["generate", "hi", "2+2=", "--model", model_dir, "--max-new-tokens", "8", "--slot-size", "4",
                 "--block-size", "8", "--slot-threshold", "0.5", "--no-chat", "--trace", str(trace), "--show"]) == 0
    captured = capsys.readouterr()
    assert "[1] 2+2=" in captured.err and "tokens/forward" in captured.err  # the live view, on stderr
    data = json.loads(trace.read_text())
    assert data["format"] == "refusion-trace" and len(data["sequences"]) == 2
    rounds = [len(s["rounds"]) for s in data["sequences"]]

    html, gif = tmp_path / "out.html", tmp_path / "out.gif"
    assert main(["trace", str(trace), "--html", str(html), "--gif", str(gif), "--frame-ms", "50"]) == 0
    from PIL import Image
    with Image.open(gif) as image:
        assert image.n_frames == max(rounds)
    assert "trace-data" in html.read_text()
    assert main(["trace", str(trace), "--sequence", "1"]) == 0
    out = capsys.readouterr().out
    assert "2+2=" in out and "round" in out


def test_autoregressive_trace(main, model_dir, tmp_path):
    trace = tmp_path / "ar.json"
    assert main(["generate", "hi", "--model", model_dir, "--max-new-tokens", "5", "--strategy", "autoregressive",
                 "--no-chat", "--trace", str(trace)]) == 0
    seq = json.loads(trace.read_text())["sequences"][0]
    assert all(r["how"] == "autoregressive" and len(r["committed"][0]["tokens"]) == 1 for r in seq["rounds"])
    assert main(["trace", str(trace), "--gif", str(tmp_path / "ar.gif")]) == 0


def test_speculative_trace(main, model_dir, tmp_path, capsys):
    trace = tmp_path / "spec.json"
    assert main(["generate", "hi", "2+2=", "--model", model_dir, "--max-new-tokens", "8", "--strategy", "speculative",
                 "--draft-length", "3", "--no-chat", "--trace", str(trace), "--show"]) == 0
    err = capsys.readouterr().err  # the live view
    assert "speculative (exact)" in err and "forwards prefill 1" in err
    data = json.loads(trace.read_text())
    assert data["version"] == 2
    seq = data["sequences"][0]
    assert all(r["how"] == "speculative" for r in seq["rounds"]) and seq["rounds"][0]["phase_forwards"]["prefill"] == 1
    html, gif = tmp_path / "spec.html", tmp_path / "spec.gif"
    assert main(["trace", str(trace), "--html", str(html), "--gif", str(gif), "--frame-ms", "50"]) == 0
    assert "speculative (exact)" in html.read_text() and gif.stat().st_size > 0
    assert main(["trace", str(trace)]) == 0
    assert "forwards prefill 1" in capsys.readouterr().out


@pytest.mark.parametrize("content,argv,words", [
    ('{"format": "refusion-trace", "version": 1, "settings": {"slot_si', [], "is truncated"),
    ('{"format": "other"}', [], "not a refusion trace"),
    (None, [], "does not exist"),
    ("valid", ["--sequence", "5"], "--sequence 5 is out of range"),
    ("valid", ["--gif", "/nonexistent/dir/x.gif"], "does not exist"),
])
def test_bad_trace_files_exit_2_with_one_line(main, tmp_path, capsys, trace_doc, content, argv, words):
    from refusion.viz.schema import save_trace

    path = tmp_path / "t.json"
    if content == "valid":
        save_trace(trace_doc, path)
    elif content is not None:
        path.write_text(content)
    assert main(["trace", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and err.startswith("refusion trace: error:")


def test_trace_path_checked_before_the_model_loads(main, capsys):
    assert main(["generate", "hi", "--model", "/nonexistent/model", "--trace", "/nonexistent/dir/t.json"]) == 2
    assert "folder /nonexistent/dir does not exist" in capsys.readouterr().err


def test_trace_help(main, capsys):
    with pytest.raises(SystemExit) as e:
        main(["trace", "--help"])
    assert e.value.code == 0 and "--gif" in capsys.readouterr().out
