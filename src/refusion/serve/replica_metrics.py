"""One `/metrics` for every replica of `refusion serve --replicas N` (docs/SERVING.md, Replicas on Ray Serve).

Each replica sends a `snapshot` of its Prometheus registry to one `MetricsHub` (a Ray Serve deployment of its
own) every `PUSH_SECONDS`, and once more when it stops; a scrape of `/metrics`, whichever replica Ray's proxy
sends it to, answers the hub's `MetricsMerge`: every series summed over the replicas, except

- gauges named `*_ratio` / `*_perc` (the KV-cache shares), averaged over the live replicas, since every replica
  holds the same capacity;
- the `*_created` timestamps, the earliest;
- plus `refusion_replicas`: how many replicas reported within `STALE_SECONDS`.

A replica that stops reporting for `STALE_SECONDS` (killed, scaled down) leaves the gauges, while its last
counters and histograms stay in the sums, so that totals never go down while the hub lives (what
`rate()` needs); a replica that reports again is counted live again, once.
"""

from __future__ import annotations

import threading
import time

PUSH_SECONDS = 1.0
"""How often each replica sends its snapshot to the hub."""
STALE_SECONDS = 15.0
"""A replica silent this long is gone: its gauges leave the sums (its counters stay)."""
AVERAGED_SUFFIXES = ("_ratio", "_perc")
"""Gauges with these name endings are shares of one replica's capacity: averaged, not summed."""
REPLICAS_METRIC = "refusion_replicas"

Sample = tuple[str, tuple[tuple[str, str], ...], float]
"""(sample name, sorted labels, value)."""
Family = tuple[str, str, str, list[Sample]]
"""(metric name, type, help, samples): one metric of a registry."""


def snapshot(registry) -> list[Family]:
    """A registry's metrics as plain data (what crosses from a replica to the hub)."""
    return [(m.name, m.type, m.documentation, [(s.name, tuple(sorted(s.labels.items())), s.value)
                                               for s in m.samples])
            for m in registry.collect()]


class MetricsMerge:
    """The latest snapshot of every replica, merged into one exposition (rules: the module docstring)."""

    def __init__(self, stale_seconds: float = STALE_SECONDS):
        self.stale_seconds = stale_seconds
        self.reports: dict[str, tuple[float, list[Family]]] = {}
        """Replica id -> (when it last reported, monotonic; its snapshot); gone replicas stay for their counters."""
        self.lock = threading.Lock()

    def report(self, replica: str, families: list[Family], now: float | None = None) -> None:
        with self.lock:
            self.reports[replica] = (time.monotonic() if now is None else now, families)

    def live(self, now: float | None = None) -> list[str]:
        """The replicas that reported within `stale_seconds`."""
        now = time.monotonic() if now is None else now
        with self.lock:
            return [r for r, (at, _) in self.reports.items() if now - at <= self.stale_seconds]

    def families(self, now: float | None = None) -> list:
        """The merged metrics, as prometheus_client `Metric`s (what `generate_latest` writes)."""
        from prometheus_client.metrics_core import Metric

        live = set(self.live(now))
        with self.lock:
            reports = [(replica in live, families) for replica, (_, families) in self.reports.items()]
        merged: dict[str, tuple[str, str, dict]] = {}
        for is_live, families in reports:
            for name, kind, help_text, samples in families:
                if kind == "gauge" and not is_live:
                    continue
                values = merged.setdefault(name, (kind, help_text, {}))[2]
                for sample, labels, value in samples:
                    values.setdefault((sample, labels), []).append(value)
        metrics = []
        for name, (kind, help_text, values) in merged.items():
            metric = Metric(name, help_text, kind)
            for (sample, labels), seen in values.items():
                metric.add_sample(sample, dict(labels), _combine(kind, sample, seen))
            metrics.append(metric)
        replicas = Metric(REPLICAS_METRIC, "Replicas whose metrics are in these sums (reported within "
                          f"{self.stale_seconds:g} s)", "gauge")
        replicas.add_sample(REPLICAS_METRIC, {}, float(len(live)))
        return [*metrics, replicas]

    def collect(self):
        """prometheus_client's registry protocol: `generate_latest(merge)` writes the merged exposition."""
        return self.families()


def _combine(kind: str, sample: str, values: list[float]) -> float:
    if sample.endswith("_created"):
        return min(values)
    if kind == "gauge" and sample.endswith(AVERAGED_SUFFIXES):
        return sum(values) / len(values)
    return sum(values)


class MetricsHub:
    """The Ray Serve deployment the replicas report to (one replica, no cores reserved)."""

    def __init__(self):
        self.merge = MetricsMerge()

    def report(self, replica: str, families: list[Family]) -> None:
        self.merge.report(replica, families)

    def exposition(self) -> bytes:
        from prometheus_client.exposition import generate_latest

        return generate_latest(self.merge)
