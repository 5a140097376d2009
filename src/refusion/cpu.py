"""CPU threads for a decode on a machine that may be busy.

torch's OpenMP threads spin while they wait for each other: when another process holds one of the cores they
need, every parallel region waits for a thread that is not running, and a decode slows several times over
(docs/BENCHMARKS.md, Current results: *Busy machine*). A command that decodes on the CPU therefore looks, once
at start-up, at how many cores other processes keep busy and runs on the others (`decode_threads`); an
`OMP_NUM_THREADS` the user set is left alone. Linux only (/proc/stat); elsewhere every core is used, as before.
"""

from __future__ import annotations

import os
import time

SAMPLE_SECONDS = 0.1
"""How long the start-up look at the other processes' CPU use lasts."""


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) jiffies of all cores since boot, or None where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def busy_cores(seconds: float = SAMPLE_SECONDS) -> float:
    """How many cores' worth of CPU the machine spent over `seconds` (this process sleeps meanwhile, so it is the
    other processes' use); 0.0 where it cannot be read."""
    before = _cpu_times()
    time.sleep(seconds)
    after = _cpu_times()
    if before is None or after is None or after[1] <= before[1]:
        return 0.0
    idle, total = after[0] - before[0], after[1] - before[1]
    return (1 - idle / total) * (os.cpu_count() or 1)


def decode_threads(busy: float | None = None) -> int:
    """Threads for a decode: every core that other processes leave free (at least one)."""
    cores = os.cpu_count() or 1
    busy = busy_cores() if busy is None else busy
    return max(1, min(cores, cores - round(busy)))


def choose_cpu_threads() -> int | None:
    """Set OMP_NUM_THREADS for this process to `decode_threads()` before torch starts, unless the user set it or
    torch already runs; returns the count set, or None."""
    import sys

    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return None
    threads = decode_threads()
    if threads < (os.cpu_count() or 1):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        return threads
    return None
