"""`model.calibration`: what needs a clock is timed once per machine and model, recorded, and reused by every later
process; `refusion calibrate` measures again; a damaged record is measured again, never a crash. And the same
`refusion generate` gives the same tokens and forwards in every process, idle or beside busy ones."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
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


def strict_int(value) -> int:
    if type(value) is not int:
        raise TypeError(f"{value!r} is not an int")
    return value


def edit_values(edit) -> None:
    """Replace every recorded value by `edit(kind, value)`, as a hand or a damaged disk would."""
    path = calibration.record_path()
    record = json.loads(path.read_text())
    for entry in record["entries"].values():
        entry["value"] = edit(entry["key"]["kind"], entry["value"])
    path.write_text(json.dumps(record))


def test_a_value_of_the_wrong_type_warns_in_one_line_and_is_measured_again(cache):
    calibration.recorded("probe", {}, lambda: 1, parse=strict_int)
    edit_values(lambda kind, value: [1, 2, 3])
    with pytest.warns(calibration.CalibrationWarning, match="invalid probe entry") as caught:
        assert calibration.recorded("probe", {}, lambda: 4, parse=strict_int) == 4
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rewritten: read back silently
        assert calibration.recorded("probe", {}, refuse, parse=strict_int) == 4


def test_an_entry_of_another_refusion_version_dispatch_or_native_build_is_not_used(cache, monkeypatch):
    import refusion

    calibration.recorded("probe", {}, lambda: 1)
    monkeypatch.setattr(refusion, "__version__", "99.0")
    assert calibration.recorded("probe", {}, lambda: 2) == 2
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN's code path capped: other kernels
    assert calibration.recorded("probe", {}, lambda: 3) == 3
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    assert calibration.recorded("probe", {}, lambda: 4) == 4
    assert calibration.recorded("probe", {}, refuse) == 4


def test_forward_costs_of_another_native_build_are_measured_again(cache, monkeypatch):
    from refusion.model.kernels import extension

    model = tiny_model("llama")
    calls = []
    measure = costs.measure
    monkeypatch.setattr(costs, "measure", lambda *a, **k: calls.append(1) or measure(*a, **k))
    setup = prepare(model)
    costs.recorded_costs(model, setup)
    costs.recorded_costs(model, setup)
    assert len(calls) == 1
    monkeypatch.setattr(extension, "native_tag", lambda: "another-build")
    costs.recorded_costs(model, setup)
    assert len(calls) == 2
    key = next(e["key"] for e in calibration.recorded_here() if e["kind"] == "forward_costs"
               and e["key"]["native"] == "another-build")
    assert key["accelerator"] == {} and key["device"] == "cpu"


def test_a_gpu_keys_its_measurements_by_its_name_cuda_and_driver(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"GPU {index}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(calibration, "driver_version", lambda: "570.1")
    assert calibration.device_key("cuda:1") == {"type": "cuda", "gpu": "GPU 1", "capability": [9, 0],
                                                "cuda": "12.8", "driver": "570.1"}
    assert calibration.device_key("cuda")["gpu"] == "GPU 0" and calibration.device_key("cpu") == {}


@pytest.fixture
def fake_packing(monkeypatch):
    """Packed products whose rows are exact up to 4 rows (rounded another way beyond): the probe finds [1, 4]."""
    import torch.nn.functional as F

    from refusion.model.kernels import row_exact

    def product(x, weight, bias):
        out = torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
        return out + 1 if x.shape[0] > 4 else out

    monkeypatch.setattr(row_exact, "reorder_weight", lambda weight: weight)
    monkeypatch.setattr(row_exact, "packed_product", product)
    row_exact.exact_rows.cache_clear()
    yield row_exact
    row_exact.exact_rows.cache_clear()


def test_a_poisoned_exact_rows_entry_is_measured_again_not_a_traceback(cache, fake_packing):
    assert fake_packing.exact_rows(96, 160) == fake_packing.ExactRows(1, 4)
    edit_values(lambda kind, value: [1, 2, 3])  # ExactRows(*[1, 2, 3]) was a TypeError
    fake_packing.exact_rows.cache_clear()
    with pytest.warns(calibration.CalibrationWarning, match="invalid exact_rows entry") as caught:
        assert fake_packing.exact_rows(96, 160) == fake_packing.ExactRows(1, 4)
    assert len(caught) == 1
    for bad in (["1", 4], [3, 4], [1, 99], [2, 1], {"low": 1}):  # wrong type, range or shape
        assert pytest.raises((TypeError, ValueError), fake_packing.parse_exact_rows, bad)


def test_an_edited_exact_rows_entry_fails_its_spot_check_and_is_measured_again(cache, fake_packing, monkeypatch):
    assert fake_packing.exact_rows(96, 160) == fake_packing.ExactRows(1, 4)
    edit_values(lambda kind, value: [1, 32])  # valid, but products of 32 rows are not exact here
    fake_packing.exact_rows.cache_clear()
    with pytest.warns(calibration.CalibrationWarning, match="does not hold on this machine") as caught:
        assert fake_packing.exact_rows(96, 160) == fake_packing.ExactRows(1, 4)
    assert len(caught) == 1 and "differs from the row alone" in str(caught[0].message)
    fake_packing.exact_rows.cache_clear()
    monkeypatch.setattr(fake_packing, "probe_exact_rows", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the re-measured entry passes its spot check
        assert fake_packing.exact_rows(96, 160) == fake_packing.ExactRows(1, 4)


MEASURE_ONCE = """
import os, sys, time
from pathlib import Path
from refusion.model import calibration
calibration.machine_key()  # torch imported before the start line
folder = Path(sys.argv[1])
(folder / f"ready-{os.getpid()}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
def measure():
    with open(folder / "measurements", "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.5)
    return os.getpid()
print(calibration.recorded("probe", {}, measure))
"""


def test_processes_starting_together_measure_once_and_share_it(cache, tmp_path):
    """Two processes look the same entry up at once: the first measures under the record's lock, the second waits
    for it and reads its value."""
    env = {**os.environ, "REFUSION_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = [subprocess.Popen([sys.executable, "-c", MEASURE_ONCE, str(tmp_path)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outputs = [p.communicate(timeout=300) for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert all(p.returncode == 0 for p in processes), outputs
    measured = (tmp_path / "measurements").read_text().split()
    assert len(measured) == 1
    assert [out.strip() for out, _ in outputs] == measured * 2


def test_calibrate_show_prints_the_record_for_this_machine_and_measures_nothing(cache, monkeypatch, capsys):
    calibration.recorded("probe", {"shape": [2, 3]}, lambda: {"faster": 1.5})
    monkeypatch.setattr(costs, "measure", refuse)
    monkeypatch.setattr("refusion.model.loading.load", refuse)
    assert main(["calibrate", "--show"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert str(calibration.record_path()) in out[0] and "1 entry for this machine" in out[0]
    assert out[1].strip() == 'probe [shape [2,3]]: {"faster": 1.5}'
    assert main(["calibrate", "--show", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["entries"] == [{"kind": "probe", "key": {"shape": [2, 3]}, "value": {"faster": 1.5}}]
    assert shown["machine"] == json.loads(json.dumps(calibration.machine_key()))


def test_a_poisoned_record_under_generate_warns_once_and_decodes(cache, tiny_model_dir, capsys, monkeypatch):
    """`refusion generate` on a record whose every value has the wrong type: one warning line, the entries
    measured again and rewritten, the answer as from a sound record."""
    from refusion.model.kernels import choice

    # the kernel decision fixed (timed on a busy machine, another kernel would key other forward costs)
    monkeypatch.setattr(choice, "measured_choice", lambda model: {"linear": "plain", "padded_rows": None,
                                                                  "packed_from": None})
    args = ["generate", "hi", "--model", tiny_model_dir, "--dtype", "float32", "--max-new-tokens", "6", "--no-chat",
            "--strategy", "speculative", "--json"]
    assert main(args) == 0
    sound = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    kinds = {e["kind"] for e in calibration.recorded_here()}
    assert {"linear_kernel", "forward_costs"} <= kinds
    edit_values(lambda kind, value: [1, 2, 3])
    assert main(args) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out.strip().splitlines()[-1])["token_ids"] == sound["token_ids"]
    warned = [line for line in captured.err.splitlines() if "warning:" in line]
    assert len(warned) == 1 and "invalid" in warned[0], captured.err
    assert all(e["value"] != [1, 2, 3] for e in calibration.recorded_here())  # measured again and rewritten


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
