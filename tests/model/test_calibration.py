"""`model.calibration`: what needs a clock is timed once per machine and model, recorded, and reused by every later
process; `refusion calibrate` measures again; a damaged record is measured again, never a crash. And the same
`refusion generate` gives the same tokens and forwards in every process, idle or beside busy ones."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import warnings

import pytest
import torch

from refusion.cli import main
from refusion.decode import costs
from refusion.model import calibration
from refusion.model.kernels import narrow
from refusion.model.kernels.narrow import NarrowLinear
from refusion.model.setup import prepare, setup_of
from refusion.model.tiny import tiny_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A model cache (and calibration record) of this test's own."""
    monkeypatch.setenv("REFUSION_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def refuse(*args, **kwargs):
    raise AssertionError("a probe ran where the record should have been read")


def test_a_recorded_value_is_read_back_without_measuring(cache):
    assert calibration.recorded("probe", {"shape": [2, 3]}, lambda: {"faster": 1.5}) == {"faster": 1.5}
    assert calibration.recorded("probe", {"shape": [2, 3]}, refuse) == {"faster": 1.5}
    assert calibration.recorded("probe", {"shape": [3, 3]}, lambda: None) is None  # another key: measured
    assert calibration.recorded("probe", {"shape": [3, 3]}, refuse) is None  # "nothing to record" is recorded too
    record = json.loads(calibration.record_path().read_text())
    entry = next(e for e in record["entries"].values() if e["key"]["shape"] == [2, 3])
    assert entry["key"]["machine"] == calibration.machine_key()  # CPU, flags, torch, threads


def test_remeasuring_replaces_the_record(cache):
    calibration.recorded("probe", {}, lambda: 1)
    with calibration.remeasuring():
        assert calibration.recorded("probe", {}, lambda: 2) == 2
    assert calibration.recorded("probe", {}, refuse) == 2


def test_another_thread_count_is_another_record(cache, monkeypatch):
    calibration.recorded("probe", {}, lambda: 1)
    monkeypatch.setattr(calibration, "machine_key", lambda: {"threads": 99})
    assert calibration.recorded("probe", {}, lambda: 2) == 2


@pytest.mark.parametrize("damage", ["not json {", '{"format": 1, "entries": [1, 2]}', "[]"])
def test_a_damaged_record_warns_in_one_line_and_is_measured_again(cache, damage):
    calibration.record_path().parent.mkdir(parents=True)
    calibration.record_path().write_text(damage)
    with pytest.warns(calibration.CalibrationWarning, match="unreadable") as caught:
        assert calibration.recorded("probe", {}, lambda: 7) == 7
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: read back silently
        assert calibration.recorded("probe", {}, refuse) == 7


def test_no_cache_no_record(monkeypatch):
    monkeypatch.setenv("REFUSION_CACHE", "off")
    assert calibration.record_path() is None
    assert calibration.recorded("probe", {}, lambda: 3) == 3


def test_the_kernel_probes_run_once_per_machine_and_model(cache, monkeypatch):
    """An fp32 model on a CPU: the narrow probes are timed at the first prepare, then read from the record (a
    probe that would raise is never called), giving the same kernel and row padding."""
    monkeypatch.setattr(narrow, "PROBE_BYTES", 0)  # as if the tiny weights streamed from memory
    monkeypatch.setattr(narrow, "weight_major_speedup", lambda layers: 2.0)
    monkeypatch.setattr(narrow, "weight_major_row_times", lambda layers: [3.0, 2.0, 3.0, 2.0])
    monkeypatch.setattr(narrow, "packed_rows_from", lambda layers, padded: 0)
    first = prepare(tiny_model("llama", dtype=torch.float32))
    assert first.kernels.linear == "narrow" and "measured now" in first.kernels.reason
    for probe in ("weight_major_speedup", "weight_major_row_times", "packed_rows_from"):
        monkeypatch.setattr(narrow, probe, refuse)
    model = tiny_model("llama", dtype=torch.float32)
    again = prepare(model)
    assert again.kernels.linear == "narrow" and "recorded for this machine" in again.kernels.reason
    paddings = {m.padded_rows for m in model.modules() if isinstance(m, NarrowLinear)}
    assert paddings == {(0, 2, 2, 4, 4)}


def test_forward_costs_are_measured_once_and_read_back(cache, monkeypatch):
    model = tiny_model("llama")
    measured = costs.forward_costs_of(model, prepare(model))
    assert measured is not None and measured.widths == costs.PROBE_WIDTHS
    monkeypatch.setattr(costs, "measure", refuse)
    other = tiny_model("llama")  # another process's model of the same build
    assert costs.forward_costs_of(other, prepare(other)) == measured


def test_calibrate_measures_again_and_says_what_is_in_force(cache, tiny_model_dir, monkeypatch, capsys):
    calls = []
    measure = costs.measure
    monkeypatch.setattr(costs, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    args = ["calibrate", "--model", tiny_model_dir, "--dtype", "float32", "--device", "cpu"]
    assert main(args) == 0 and main(args) == 0
    assert len(calls) == 2  # every run measures, though the first recorded
    out = capsys.readouterr().out
    assert "float32, linear" in out and "forward costs 1:" in out and str(calibration.record_path()) in out
    record = json.loads(calibration.record_path().read_text())
    assert any(name.startswith("forward_costs-") for name in record["entries"])


def test_describe_and_the_stats_name_the_dtype_and_kernels(tiny_model_dir, capsys):
    import refusion

    model, _ = refusion.load(tiny_model_dir, dtype="float32", device="cpu")
    assert setup_of(model).describe().startswith("float32, linear ")
    assert main(["generate", "hi", "--model", tiny_model_dir, "--dtype", "float32", "--max-new-tokens", "4",
                 "--stats", "--no-chat"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"[{setup_of(model).describe()}]" and lines[-1].startswith("[refusion | tokens ")


def _busy_loop() -> None:
    while True:
        pass


def _generate(model: str, extra: tuple[str, ...] = ()) -> tuple[list, int]:
    """Token ids and forwards of one `refusion generate` in a fresh process."""
    command = [sys.executable, "-m", "refusion", "generate", "Why is the sky blue?", "--json", "--max-new-tokens",
               "24", *extra] + (["--model", model] if model else [])
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=900).stdout
    record = json.loads(out.strip().splitlines()[-1])
    return record["token_ids"], record["stats"]["forwards"]


def _runs_idle_and_busy(model: str, extra: tuple[str, ...] = (), runs: int = 2) -> list[tuple[list, int]]:
    results = [_generate(model, extra) for _ in range(runs)]
    busy = [multiprocessing.get_context("spawn").Process(target=_busy_loop, daemon=True) for _ in range(2)]
    for process in busy:
        process.start()
    try:
        results += [_generate(model, extra) for _ in range(runs)]
    finally:
        for process in busy:
            process.terminate()
            process.join()
    return results


def test_the_same_generate_answers_alike_in_every_process_idle_or_busy(tiny_model_dir):
    """Tokens and forward count of the exact mode (the default drafts are priced by the recorded costs) are the
    same in each process, beside two CPU-bound processes or not."""
    results = _runs_idle_and_busy(tiny_model_dir, ("--strategy", "speculative", "--draft-length", "4", "--no-chat"))
    assert all(result == results[0] for result in results), results


@pytest.mark.slow
def test_the_embedded_model_answers_alike_in_every_process_idle_or_busy():
    results = _runs_idle_and_busy("")
    assert all(result == results[0] for result in results), results
