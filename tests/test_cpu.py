"""CPU threads: the same count in every process on a machine, whatever other processes do (refusion/cpu.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from refusion import cpu


def run(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def _busy_loop() -> None:
    while True:
        pass


CHOICE = "import os; from refusion import cpu; print(cpu.choose_cpu_threads(), os.environ.get('OMP_NUM_THREADS'))"


def test_the_thread_count_does_not_follow_how_busy_the_machine_is():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    idle = run(CHOICE, env)
    busy = [multiprocessing.get_context("spawn").Process(target=_busy_loop, daemon=True) for _ in range(2)]
    for process in busy:
        process.start()
    try:
        assert run(CHOICE, env) == idle
    finally:
        for process in busy:
            process.terminate()
            process.join()


def test_the_choice_follows_the_affinity_is_made_before_torch_and_never_over_the_user_s(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores, usable = os.cpu_count() or 1, cpu.usable_cores()
    threads, omp = run(CHOICE, env).split()
    if usable < cores:  # affinity or quota: set before torch starts
        assert (threads, omp) == (str(usable), str(usable))
    else:  # torch's own default stands
        assert omp == "None" and int(threads) >= 1
    assert run(CHOICE, env | {"OMP_NUM_THREADS": "3"}) == "3 3"  # the user's setting stands
    asked = CHOICE.replace("choose_cpu_threads()", "choose_cpu_threads(3)")
    assert run(asked, env | {"OMP_NUM_THREADS": "2"}) == "3 3"  # a count asked for (--threads) wins
    assert run("import torch; " + asked, env) == "3 None"  # torch already started: set through torch alone
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu.usable_cores() == 1
    with pytest.raises(ValueError, match="threads=0"):
        cpu.choose_cpu_threads(0)


def fake_cgroup(root: Path, files: dict[str, str], path: str = "/") -> Path:
    """A cgroup tree under `root` holding `files` (relative path -> text), and a /proc/self/cgroup naming `path`."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    proc = root.parent / "proc-self-cgroup"
    proc.write_text(f"0::{path}\n")
    return proc


@pytest.mark.parametrize(("files", "path", "cores"), [
    ({"cpu.max": "800000 100000\n"}, "/", 8),  # cgroup v2
    ({"cpu.max": "max 100000\n"}, "/", None),
    ({"cpu.max": "150000 100000\n"}, "/", 2),  # rounded up
    ({"cpu.max": "max 100000\n", "app/cpu.max": "300000 100000\n", "app/web/cpu.max": "max 100000\n"},
     "/app/web", 3),  # the smallest along the process's cgroup path
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "/", 2),  # cgroup v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "/", None),
    ({}, "/", None),
])
def test_a_container_s_cpu_quota_caps_the_cores(tmp_path, files, path, cores):
    root = tmp_path / "cgroup"
    root.mkdir()
    proc = fake_cgroup(root, files, path)
    assert cpu.cpu_quota(root, proc) == cores


def test_the_thread_count_honours_the_quota_as_well_as_the_affinity(tmp_path, monkeypatch):
    """16 cores in the affinity, a quota of 3 cores: 3 threads (torch's own count set, the env left alone once
    torch has started)."""
    import torch

    root = tmp_path / "cgroup"
    root.mkdir()
    fake_cgroup(root, {"cpu.max": "300000 100000\n"})
    monkeypatch.setattr(cpu, "CGROUP_ROOT", root)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu.usable_cores() == 3
    saved = torch.get_num_threads()
    try:
        assert cpu.choose_cpu_threads() == 3 == torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def test_a_passing_thread_runs_elsewhere_and_hands_back_its_result_or_its_error():
    import threading

    ran_on = cpu.passing_thread(lambda x, y=0: (threading.current_thread().name, x + y), 2, y=3).result(10)
    assert ran_on == ("refusion-passing", 5)
    with pytest.raises(KeyError, match="missing"):
        cpu.passing_thread(lambda: {}["missing"]).result(10)
