"""The parts of `refusion serve --replicas N` that need no Ray: the merged `/metrics` (serve/replica_metrics.py:
two replicas' registries summed, shares averaged, a gone replica's counters kept and its gauges dropped), each
replica's default resources, the capacity check before deploying, and how Ray starts."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from refusion.serve.metrics import ServerMetrics  # noqa: E402
from refusion.serve.replica_metrics import MetricsMerge, snapshot  # noqa: E402
from refusion.serve.replicas import check_capacity, ray_init_options, replica_resources  # noqa: E402
from refusion.serve.settings import ServeConfig  # noqa: E402


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


def test_default_cores_leave_room_for_every_replica_up_to_max_replicas():
    assert replica_resources(ServeConfig(replicas=2), cores=8, cuda_gpus=0) == (4.0, 0.0)
    scaling = ServeConfig(replicas=1, max_replicas=4)
    cpus, gpus = replica_resources(scaling, cores=8, cuda_gpus=0)
    assert (cpus, gpus) == (2.0, 0.0)
    assert check_capacity(scaling, cpus, gpus, {"CPU": 8.0}) == []  # all 4 fit on this machine
    cpus, _ = replica_resources(ServeConfig(replicas=1, max_replicas=3), cores=2, cuda_gpus=0)
    assert cpus == 0.66 and 3 * cpus <= 2  # floored so that they fit
    assert replica_resources(ServeConfig(replicas=2, replica_cpus=1.5, replica_gpus=0.5), cores=8) == (1.5, 0.5)
    assert replica_resources(ServeConfig(replicas=2), cores=8, cuda_gpus=2)[1] == 1.0  # a GPU each under CUDA


def test_more_replicas_than_the_cluster_holds_is_one_line_naming_the_numbers():
    with pytest.raises(ValueError) as e:
        check_capacity(ServeConfig(replicas=3), 1.0, 1.0, {"CPU": 16.0, "GPU": 2.0})
    assert str(e.value) == ("--replicas=3 x --replica-gpus=1 needs 3 GPUs but the Ray cluster has 2: lower "
                            "--replicas or --replica-gpus (a fraction shares one: --replica-gpus 0.5)")
    with pytest.raises(ValueError, match=r"^--replicas=4 x --replica-cpus=2 needs 8 CPU cores but the Ray cluster "
                                         r"has 6: lower --replicas or --replica-cpus$"):
        check_capacity(ServeConfig(replicas=4), 2.0, 0.0, {"CPU": 6.0})
    assert check_capacity(ServeConfig(replicas=2, max_replicas=4), 2.0, 0.0, {"CPU": 6.0}) == [
        "--max-replicas=4 x --replica-cpus=2 needs 8 CPU cores but the Ray cluster has 6: Ray Serve scales up "
        "to 3 replicas unless the cluster grows"]


def test_ray_starts_without_its_dashboard_unless_asked_and_then_on_localhost():
    assert ray_init_options(ServeConfig())["include_dashboard"] is False
    asked = ray_init_options(ServeConfig(ray_dashboard=True))
    assert asked["include_dashboard"] is True and asked["dashboard_host"] == "127.0.0.1"
