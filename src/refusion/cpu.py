"""CPU threads for a decode: the same count in every process on a machine, however busy it is.

The thread count is part of what a decode computes with: the kernel probes and the forward costs that price the
exact mode's drafts are recorded per thread count (`model.calibration`), and products by MKL's fp32 kernels may
round differently at another count. So it is a fact of the machine, never a look at how busy it is at start-up
(an earlier version ran on the cores other processes left free over 0.1 s, and two processes could then decode
with different counts, different costs and different forward counts): every core this process may run on (its
CPU affinity; torch's own default where that is every core). An `OMP_NUM_THREADS` the user set is left alone.

On a machine shared with CPU-bound work, give the cores left free yourself (`OMP_NUM_THREADS`, or the server's
`--threads`): torch's OpenMP threads spin while they wait for each other, and one without a core slows every
parallel region several times over (docs/archive/RESULTS-LEDGER.md: *Busy machine*).
"""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS says; else every core)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_cpu_threads() -> int | None:
    """Before torch starts, and unless the user set OMP_NUM_THREADS: set it to `usable_cores()` where the process
    may use fewer cores than the machine has (elsewhere torch's default, also a fact of the machine, stands).
    Returns the count set, or None."""
    import sys

    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return None
    threads = usable_cores()
    if threads < (os.cpu_count() or 1):
        os.environ["OMP_NUM_THREADS"] = str(threads)
        return threads
    return None
