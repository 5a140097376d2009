"""`refusion bench` sweeps and the `eval` / `bench` command lines, bad input included."""

import json

import pytest

import refusion.cli
from refusion.eval.runner import EvalSettings
from refusion.eval.sweep import format_sweep_table, grid, pareto_front, parse_sweeps, plot_pareto, run_sweep


def test_parse_and_grid():
    sweeps = parse_sweeps(["slot_threshold=0.5,0.9", "slot-size=4,8"])
    assert sweeps == {"slot_threshold": [0.5, 0.9], "slot_size": [4, 8]}
    assert grid(sweeps) == [{"slot_threshold": 0.5, "slot_size": 4}, {"slot_threshold": 0.5, "slot_size": 8},
                            {"slot_threshold": 0.9, "slot_size": 4}, {"slot_threshold": 0.9, "slot_size": 8}]


@pytest.mark.parametrize("spec, match", [("slot_size", "NAME=V1"), ("slot_size=", "NAME=V1"),
                                         ("foo=1,2", "cannot be swept"), ("slot_size=4,x", "not a valid int"),
                                         ("slot_threshold=high", "not a valid float")])
def test_bad_sweep_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_sweeps([spec])
    with pytest.raises(ValueError, match="twice"):
        parse_sweeps(["slot_size=4", "slot_size=8"])


def test_pareto_front():
    points = [(10, 0.5), (20, 0.4), (15, 0.3), (5, 0.6), (20, 0.4)]
    assert pareto_front(points) == [True, True, False, True, True]


def test_run_sweep_table_and_plot(data_dir, byte_tokenizer, tmp_path):
    from test_runner import scripted_generate
    settings = EvalSettings(["gsm8k"], limit=2, progress=False, warmup=False, data_dir=str(data_dir))
    doc = run_sweep(None, byte_tokenizer, "gsm8k", {"slot_size": [4, 8], "token_threshold": [0.2, 0.4]}, settings,
                    generate_fn=scripted_generate({}), log=lambda *a: None)
    assert len(doc["rows"]) == 4 and doc["baseline"]["strategy"] == "autoregressive"
    assert {r["config"]["slot_size"] for r in doc["rows"]} == {4, 8}
    assert all(r["config"]["block_size"] == 128 for r in doc["rows"])  # the gsm8k preset's b
    table = format_sweep_table(doc)
    assert table.count("\n") == 2 + 4 and "AR" in table
    png = plot_pareto(doc, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def cli():
    return refusion.cli.main


@pytest.mark.parametrize("argv, match", [
    (["eval", "--task", "gsm9k"], "unknown"),
    (["eval", "--task", "gsm8k", "--limit", "ten"], "--limit"),
    (["eval", "--task", "gsm8k", "--limit", "-1"], "--limit"),
    (["eval", "--task", "gsm8k", "--batch-size", "0"], "--batch-size"),
    (["eval", "--task", "gsm8k", "--strategy", "refusion,greedy"], "strategy"),
    (["eval", "--task", "gsm8k", "--data-dir", "/nonexistent"], "not found"),
    (["eval", "--task", "arc_challenge", "--slot-size", "16", "--block-size", "8"], "block_size"),
    (["bench", "--task", "gsm8k"], "no --sweep"),
    (["bench", "--task", "gsm8k", "--sweep", "slot_size=4;8"], "not a valid int"),
    (["bench", "--task", "arc_challenge", "--block-size", "8", "--sweep", "slot_size=4,16"], "slot_size=16"),
])
def test_bad_input_is_one_line(cli, capsys, argv, match, data_dir, monkeypatch):
    monkeypatch.setenv("REFUSION_DATA_DIR", str(data_dir))  # the data is found; the input is what is wrong
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err and err.startswith(f"refusion {argv[0]}: error:")


def test_eval_command(cli, capsys, tiny_dir, tmp_path, data_dir):
    out, samples = tmp_path / "r.json", tmp_path / "s.jsonl"
    code = cli(["eval", "--task", "gsm8k,math500", "--model", str(tiny_dir), "--limit", "2",
                "--max-new-tokens", "8", "--slot-size", "4", "--block-size", "8", "--no-progress",
                "--output", str(out), "--samples", str(samples), "--data-dir", str(data_dir)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"gsm8k", "math500"}
    for task in doc["results"].values():
        assert set(task) == {"refusion", "speculative", "autoregressive"}  # the default strategies
        assert {"accuracy", "n", "tokens_per_second", "tokens_per_forward", "mean_generated_length",
                "latency_seconds", "config"} <= set(task["refusion"])
    assert {"versions", "cpu", "platform"} <= set(doc["environment"]) and doc["settings"]["limit"] == 2
    assert len(samples.read_text().splitlines()) == 12  # 2 tasks x 2 problems x 3 strategies
    table = capsys.readouterr().out
    assert "math500" in table and "autoregressive" in table


def test_bench_command(cli, tiny_dir, tmp_path, data_dir):
    code = cli(["bench", "--task", "gsm8k", "--model", str(tiny_dir), "--limit", "1", "--max-new-tokens", "8",
                "--block-size", "8", "--sweep", "slot_size=4,8", "--sweep", "slot_threshold=0.5",
                "--no-progress", "--output-dir", str(tmp_path), "--data-dir", str(data_dir)])
    assert code == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert len(doc["rows"]) == 2 and doc["baseline"] is not None
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "slot_size" in (tmp_path / "sweep.md").read_text()


def test_help(cli, capsys):
    for command in ("eval", "bench"):
        with pytest.raises(SystemExit) as e:
            cli([command, "--help"])
        assert e.value.code == 0
    assert "--sweep" in capsys.readouterr().out


def test_bench_sweeps_decode_modes_and_accounts_for_forwards(cli, tiny_dir, tmp_path, data_dir):
    """strategy, fused_plan and draft_length are sweep axes; every row says where its forwards went."""
    code = cli(["bench", "--task", "gsm8k", "--model", str(tiny_dir), "--limit", "1", "--max-new-tokens", "8",
                "--slot-size", "4", "--block-size", "8", "--sweep", "strategy=refusion,speculative",
                "--sweep", "fused_plan=true,false", "--sweep", "draft_length=2,4", "--no-progress",
                "--output-dir", str(tmp_path), "--data-dir", str(data_dir)])
    assert code == 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    assert len(doc["rows"]) == 8
    for row in doc["rows"]:
        config, point = row["config"], row["point"]
        assert (config["strategy"], config["fused_plan"], config["draft_length"]) == (
            point["strategy"], point["fused_plan"], point["draft_length"])
        forwards = sum(row["phase_forwards"].values())
        assert forwards >= 1 and sum(row["committed_by"].values()) == round(row["mean_generated_length"] * row["n"])
        assert row["tokens_per_forward"] == pytest.approx(sum(row["committed_by"].values()) / forwards)
        if point["strategy"] == "speculative":
            assert set(row["committed_by"]) == {"speculative"} and "verify" in row["phase_forwards"]
            assert row["drafted"] > 0 and row["draft_acceptance"] == pytest.approx(row["accepted"] / row["drafted"])
        else:
            assert set(row["committed_by"]) <= {"fast_accept", "parallel_completion"} and row["drafted"] == 0
            assert row["draft_acceptance"] is None and "plan" in row["phase_forwards"]
    assert set(doc["baseline"]["committed_by"]) == {"autoregressive"}
    table = (tmp_path / "sweep.md").read_text()
    assert "forwards by phase" in table and "verify" in table and "spec " in table and "%)" in table
