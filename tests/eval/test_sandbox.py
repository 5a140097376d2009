"""Generated code that loops, crashes, exits early, forks, floods or hoards fails its sample; the
evaluator survives and nothing is left running."""

import os
import time

import pytest

from refusion.eval.sandbox import SandboxLimits, isolation_python, run_program, run_programs

FAST = SandboxLimits(timeout=2.0, memory_mb=512, max_processes=8, max_output_bytes=1 << 16)


def _sandbox_leftovers() -> list[int]:
    """Live processes that belong to a sandbox (fresh uid or marker in their environment)."""
    found = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):
                    continue
            if os.stat(f"/proc/{pid}").st_uid >= 2_000_000_000:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if b"REFUSION_SANDBOX_MARKER=" in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


@pytest.fixture(autouse=True)
def no_leftovers():
    yield
    assert _sandbox_leftovers() == []


def test_passing_and_failing_programs():
    assert run_program("def f(x):\n    return x * 2\nassert f(3) == 6\n", FAST).status == "passed"
    failed = run_program("def f(x):\n    return x + 2\nassert f(3) == 6\n", FAST)
    assert failed.status == "failed" and "AssertionError" in failed.stderr
    assert run_program("def f(:\n", FAST).status == "failed"  # syntax error


def test_main_guard_demo_does_not_run():
    # a solution's `if __name__ == "__main__": main()` demo (reading stdin) must not break its tests
    code = "def f():\n    return 1\nif __name__ == '__main__':\n    input()\nassert f() == 1\n"
    assert run_program(code, FAST).passed


def test_infinite_loop_times_out():
    start = time.perf_counter()
    result = run_program("while True:\n    pass\n", FAST)
    assert result.status == "timeout" and not result.passed
    assert time.perf_counter() - start < FAST.timeout + 5


def test_sleeping_forever_times_out():
    assert run_program("import time\ntime.sleep(1000)\n", FAST).status == "timeout"


def test_os_exit_before_the_tests_is_a_failure():
    result = run_program("import os\nos._exit(0)\nassert False\n", FAST)
    assert result.status == "exited_early" and not result.passed
    assert run_program("import sys\nsys.exit(0)\n", FAST).status == "exited_early"


def test_crash_is_a_failure():
    result = run_program("import ctypes\nctypes.string_at(0)\n", FAST)
    assert result.status == "crashed" and result.returncode < 0


def test_huge_output_is_a_failure():
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) <= 8192


def test_memory_hog_is_a_failure():
    result = run_program("x = bytearray(4 * 1024 ** 3)\n", FAST)
    assert result.status == "failed" and "MemoryError" in result.stderr


def test_fork_bomb_is_a_failure():
    result = run_program("import os\nwhile True:\n    os.fork()\n", FAST)
    assert not result.passed
    bomb = run_program("import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', ''])\n", FAST)
    assert not bomb.passed


@pytest.mark.skipif(isolation_python() is None, reason="needs root and an interpreter a fresh uid can run")
def test_unguarded_fork_bomb_hits_the_process_limit():
    limits = SandboxLimits(timeout=2.0, memory_mb=512, max_processes=8, guard=False)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert run_program(code, limits).status == "timeout"


@pytest.mark.skipif(isolation_python() is None, reason="needs root and an interpreter a fresh uid can run")
def test_escaped_daemon_is_killed():
    limits = SandboxLimits(timeout=2.0, guard=False)
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
            "print('parent done')\n")
    assert run_program(code, limits).passed  # the autouse fixture checks the sleeping child is gone


def test_private_directory_is_removed_and_not_shared():
    code = "import os\nopen('mine.txt', 'w').write('x')\nprint(os.getcwd())\n"
    first, second = run_program(code, FAST), run_program(code, FAST)
    assert first.passed and second.passed
    assert first.stdout.strip() != second.stdout.strip()
    assert not os.path.exists(first.stdout.strip())


def test_run_programs_keeps_order_and_isolates_failures():
    programs = ["assert True", "while True: pass", "assert 1 == 2", "import os; os._exit(3)", "print('ok')"]
    statuses = [r.status for r in run_programs(programs, FAST, workers=2)]
    assert statuses == ["passed", "timeout", "failed", "failed", "passed"]


def test_invalid_limits():
    with pytest.raises(ValueError, match="timeout"):
        SandboxLimits(timeout=0)
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=1)
