"""CPU threads for a decode: the same count in every process on a machine, however busy it is.

The thread count is part of what a decode computes with: the kernel probes and the forward costs that price the
exact mode's drafts are recorded per thread count (`model.calibration`), and products by MKL's fp32 kernels may
round differently at another count. So it is a fact of the machine, never a look at how busy it is at start-up
(an earlier version ran on the cores other processes left free over 0.1 s, and two processes could then decode
with different counts, different costs and different forward counts): every core this process may run on (its
CPU affinity, and a container's CPU quota: cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`; torch's own default where
neither restricts it). An `OMP_NUM_THREADS` the user set is left alone; a count the caller asks for (`refusion serve
--threads`, a replica's reserved cores) overrides both.

Every entry point that loads a model calls `choose_cpu_threads` first, before torch loads anything or the
calibration record is looked up (its entries are keyed by the thread count).

One thread computes, the others' torch work passes: torch's OpenMP runtime (libgomp) keeps a pool of worker threads
for every thread that ever ran a parallel region, and once a process holds more of them than it has cores, every
worker sleeps after about 100 spins instead of about 300,000 between two regions. A forward of a small model is
hundreds of short regions, each of which then pays a futex wake-up: a server whose model loaded on its main thread
and which decoded on its scheduler thread ran 1.6-1.9x slower than the same decode in a one-thread process
(docs/SERVING.md, *One computing thread*). So a process that decodes on one long-lived thread does its other torch
work (loading, warming, calibrating) in `passing_thread`s, whose pools end with them.

On a machine shared with CPU-bound work, give the cores left free yourself (`OMP_NUM_THREADS`, or the server's
`--threads`): torch's OpenMP threads spin while they wait for each other, and one without a core slows every
parallel region several times over (docs/archive/RESULTS-LEDGER.md: *Busy machine*).
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import concurrent.futures

CGROUP_ROOT = Path("/sys/fs/cgroup")
"""Where the cgroup file systems are mounted (v2: one hierarchy; v1: a folder per controller)."""
PROC_CGROUP = Path("/proc/self/cgroup")
"""This process's cgroup paths, one line per hierarchy ("0::/path" for v2, "N:cpu,cpuacct:/path" for v1)."""


def choose_cpu_threads(requested: int | None = None) -> int:
    """Set torch's CPU thread count for this process and return it; call it before a model loads.

    `requested` (a flag such as `--threads`) wins; else an `OMP_NUM_THREADS` the user set; else `usable_cores()`
    where it is fewer than the machine's cores (else torch's own default). Before torch starts, the count also goes
    into OMP_NUM_THREADS (so OpenMP starts with it; a user's setting is kept unless `requested` overrides it). A
    `requested` count below 1 is a ValueError."""
    if requested is not None and (isinstance(requested, bool) or not isinstance(requested, int) or requested < 1):
        raise ValueError(f"threads={requested!r}: the CPU thread count must be an integer >= 1")
    threads = requested if requested is not None else default_threads()
    if threads is not None and "torch" not in sys.modules and (requested is not None
                                                               or "OMP_NUM_THREADS" not in os.environ):
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if "torch" not in sys.modules:  # torch starts with it; a command that never loads torch (a client) stays light
        return threads if threads is not None else (os.cpu_count() or 1)
    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def passing_thread(fn: Callable, *args, name: str = "refusion-passing", **kwargs) -> concurrent.futures.Future:
    """Run `fn(*args, **kwargs)` on a new thread that ends as it returns (and with it the OpenMP workers it started:
    see the module docstring); the future holds its result or its exception. Wait with `.result()`, or
    `await asyncio.wrap_future(...)` in an event loop."""
    import concurrent.futures  # here: the engine's light client imports this module
    import threading

    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # handed to the waiting caller, which raises it
            future.set_exception(e)
        else:
            future.set_result(result)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def default_threads() -> int | None:
    """The count without a request: the user's OMP_NUM_THREADS, else `usable_cores()` where it is fewer than the
    machine's cores; None: torch's default (every core) stands."""
    user = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) >= 1:
        return int(user)
    if user:  # a value OpenMP will read its own way: left to torch
        return None
    threads = usable_cores()
    return threads if threads < (os.cpu_count() or 1) else None


def usable_cores(cgroup_root: Path | None = None) -> int:
    """The cores this process may run on: its CPU affinity (where the OS says; else every core), capped by the CPU
    quota of its cgroup (`cpu_quota`, under `cgroup_root`, default CGROUP_ROOT)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = cpu_quota(cgroup_root or CGROUP_ROOT)
    return min(cores, quota) if quota is not None else cores


def cpu_quota(root: Path | None = None, proc_cgroup: Path | None = None) -> int | None:
    """Cores the CPU quota of this process's cgroup allows, rounded up (quota 150000 per period 100000: 2); the
    smallest along its cgroup's path up to `root`; None where no quota is set (or nothing can be read)."""
    folders = _cgroup_folders(root or CGROUP_ROOT, proc_cgroup or PROC_CGROUP)
    quotas = [q for folder in folders for q in (_v2_quota(folder), _v1_quota(folder))
              if q is not None]
    return min(quotas) if quotas else None


def _cgroup_folders(root: Path, proc_cgroup: Path) -> list[Path]:
    """The folders that may hold this process's CPU quota: `root` (v2, or a container's own view), v1's cpu
    controller folders, and each along this process's cgroup paths (/proc/self/cgroup) below them."""
    tops = [root, root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"]
    folders = list(tops)
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or not (parts[0] == "0" or "cpu" in parts[1].split(",")):
            continue
        relative = Path(parts[2].strip().lstrip("/"))
        for top in tops:
            for depth in range(1, len(relative.parts) + 1):
                folders.append(top.joinpath(*relative.parts[:depth]))
    return list(dict.fromkeys(folders))


def _v2_quota(folder: Path) -> int | None:
    """cgroup v2 `cpu.max`: "QUOTA PERIOD" or "max PERIOD" (no limit)."""
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return _cores(int(quota), int(period)) if quota != "max" else None
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> int | None:
    """cgroup v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us` (a quota of -1: no limit)."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text().strip())
        period = int((folder / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return _cores(quota, period)


def _cores(quota: int, period: int) -> int | None:
    return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
