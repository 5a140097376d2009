"""The merged `/metrics` of `refusion serve --replicas N` (serve/replica_metrics.py), without Ray: two replicas'
registries summed, shares averaged, a gone replica's counters kept and its gauges dropped."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from refusion.serve.metrics import ServerMetrics  # noqa: E402
from refusion.serve.replica_metrics import MetricsMerge, snapshot  # noqa: E402


def replica(requests: int, waiting: int, kv: float) -> ServerMetrics:
    metrics = ServerMetrics()
    metrics.watch(queue_depth=lambda: waiting, batch_size=lambda: 1, kv_cache_usage=lambda: kv, model_name="m")
    for _ in range(requests):
        metrics.requests.labels("200", "refusion").inc()
        metrics.request_latency.observe(0.2)
    return metrics


class At:
    """The merge as scraped at time `now` (a registry to `generate_latest`)."""

    def __init__(self, merge: MetricsMerge, now: float):
        self.merge, self.now = merge, now

    def collect(self):
        return self.merge.families(self.now)


def scrape(merge: MetricsMerge, now: float) -> dict:
    text = generate_latest(At(merge, now)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_replicas_are_summed_shares_averaged_and_a_gone_replica_keeps_its_counters():
    merge = MetricsMerge(stale_seconds=10)
    merge.report("a", snapshot(replica(requests=3, waiting=2, kv=0.25).registry), now=0)
    merge.report("b", snapshot(replica(requests=4, waiting=5, kv=0.75).registry), now=1)
    both = scrape(merge, now=5)
    assert both[("refusion_requests_total", (("status", "200"), ("strategy", "refusion")))] == 7
    assert both[("refusion_e2e_request_latency_seconds_count", ())] == 7
    assert both[("refusion_e2e_request_latency_seconds_bucket", (("le", "0.25"),))] == 7
    assert both[("refusion_queue_depth", ())] == 7 and both[("refusion_batch_size", ())] == 2
    assert both[("vllm:num_requests_waiting", (("model_name", "m"),))] == 7
    assert both[("refusion_kv_cache_usage_ratio", ())] == 0.5  # a share: the mean, not the sum
    assert both[("vllm:kv_cache_usage_perc", (("model_name", "m"),))] == 0.5
    assert both[("refusion_replicas", ())] == 2

    one = scrape(merge, now=10.5)  # "a" silent for 10.5 s: gone
    assert one[("refusion_replicas", ())] == 1
    assert one[("refusion_requests_total", (("status", "200"), ("strategy", "refusion")))] == 7  # never goes down
    assert one[("refusion_queue_depth", ())] == 5 and one[("refusion_kv_cache_usage_ratio", ())] == 0.75

    merge.report("b", snapshot(replica(requests=6, waiting=0, kv=0.0).registry), now=11)  # b's latest replaces it
    assert scrape(merge, now=11)[("refusion_requests_total", (("status", "200"), ("strategy", "refusion")))] == 9
