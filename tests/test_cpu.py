"""CPU threads on a busy machine: a decode runs on the cores other processes leave free (refusion/cpu.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from refusion import cpu


def test_decode_threads_leave_the_busy_cores_alone(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    assert cpu.decode_threads(busy=0.0) == 4
    assert cpu.decode_threads(busy=1.4) == 3  # one other CPU-bound process
    assert cpu.decode_threads(busy=3.9) == 1  # never fewer than one
    assert cpu.decode_threads(busy=0.4) == 4  # a mostly idle machine keeps every core


def test_busy_cores_reads_the_machine():
    assert 0.0 <= cpu.busy_cores(0.02) <= (os.cpu_count() or 1)


def run(code: str, env: dict) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


def test_the_choice_is_made_before_torch_and_never_over_the_user_s():
    code = ("import os; from refusion import cpu; cpu.busy_cores = lambda seconds=0.1: 1.0; "
            "print(cpu.choose_cpu_threads(), os.environ.get('OMP_NUM_THREADS'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = os.cpu_count() or 1
    expected = f"{cores - 1} {cores - 1}" if cores > 1 else "None None"
    assert run(code, env) == expected
    assert run(code, env | {"OMP_NUM_THREADS": "2"}) == "None 2"  # the user's setting stands
    assert run("import torch; " + code, env) == "None None"  # torch already started: too late, left alone
