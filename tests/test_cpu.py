"""CPU threads: the same count in every process on a machine, whatever other processes do (refusion/cpu.py)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

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
    cores = os.cpu_count() or 1
    expected = "None None" if cpu.usable_cores() == cores else f"{cpu.usable_cores()} {cpu.usable_cores()}"
    assert run(CHOICE, env) == expected
    assert run(CHOICE, env | {"OMP_NUM_THREADS": "2"}) == "None 2"  # the user's setting stands
    assert run("import torch; " + CHOICE, env) == "None None"  # torch already started: too late, left alone
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert cpu.usable_cores() == 1
