"""`GET /metrics`: every metric is exposed before any traffic, and traffic moves the ones it should."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import MODEL, live_server

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

METRICS = {  # family name (as the parser reports it, without _total) -> type
    "refusion_requests": "counter",
    "refusion_queue_depth": "gauge",
    "refusion_batch_size": "gauge",
    "refusion_time_to_first_token_seconds": "histogram",
    "refusion_time_per_output_token_seconds": "histogram",
    "refusion_e2e_request_latency_seconds": "histogram",
    "refusion_prompt_tokens": "counter",
    "refusion_generation_tokens": "counter",
    "refusion_forwards": "counter",
    "refusion_drafted_tokens": "counter",
    "refusion_accepted_tokens": "counter",
    "refusion_tokens_per_forward": "histogram",
    "refusion_kv_cache_usage_ratio": "gauge",
    "refusion_prefix_cache_queries": "counter",
    "refusion_prefix_cache_hits": "counter",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}
ROUTING = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
           "vllm:gpu_cache_usage_perc")
"""The gauges llm-d's endpoint picker reads (vLLM's names, labelled model_name)."""


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """family -> {(sample name, sorted labels): value}, checking the content type and the families' types."""
    response = httpx.get(f"{url}/metrics", timeout=10)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert {name: families[name].type for name in METRICS if name in families} == METRICS, sorted(families)
    return {name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}
            for name, f in families.items()}


def value(metrics, family: str, sample: str | None = None, **labels) -> float:
    return metrics[family].get((sample or family, tuple(sorted(labels.items()))), 0.0)


def chat_body(**kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **kwargs}


def test_metrics_are_exposed_and_move_with_traffic(tiny):
    with live_server(tiny) as live:
        before = scrape(live.url)
        assert value(before, "refusion_forwards", "refusion_forwards_total", phase="plan") == 0
        client = live.client()
        client.chat.completions.create(**chat_body(max_tokens=8))  # refusion
        list(client.chat.completions.create(**chat_body(max_tokens=8), stream=True))  # refusion, streamed
        client.chat.completions.create(**chat_body(max_tokens=12), extra_body={"refusion": {"strategy": "speculative"}})
        client.completions.create(model=MODEL, prompt="abc", max_tokens=6, n=2,
                                  extra_body={"refusion": {"strategy": "autoregressive"}})
        bad = httpx.post(f"{live.url}/v1/chat/completions", json={"model": MODEL}, timeout=10)
        assert bad.status_code == 400
        live.wait_idle()
        after = scrape(live.url)

    requests = "refusion_requests_total"
    assert value(after, "refusion_requests", requests, status="200", strategy="refusion") == 2
    assert value(after, "refusion_requests", requests, status="200", strategy="speculative") == 1
    assert value(after, "refusion_requests", requests, status="200", strategy="autoregressive") == 1
    assert value(after, "refusion_requests", requests, status="400", strategy="unknown") == 1
    e2e = "refusion_e2e_request_latency_seconds"
    assert value(after, e2e, f"{e2e}_count") == 4  # the 400 was never queued
    # sequences: 2 refusion + 1 speculative + 2 AR choices
    ttft = "refusion_time_to_first_token_seconds"
    assert value(after, ttft, f"{ttft}_count") == 5 and value(after, ttft, f"{ttft}_sum") > 0
    tpot = "refusion_time_per_output_token_seconds"
    assert value(after, tpot, f"{tpot}_count") >= 4
    tpf = "refusion_tokens_per_forward"
    assert value(after, tpf, f"{tpf}_count") == 5
    assert value(after, "refusion_prompt_tokens", "refusion_prompt_tokens_total") > 0
    assert value(after, "refusion_generation_tokens", "refusion_generation_tokens_total") >= 8 + 8 + 1 + 2
    forwards = {phase: value(after, "refusion_forwards", "refusion_forwards_total", phase=phase)
                for phase in ("plan", "decode", "prefill", "verify")}
    assert forwards["plan"] > 0 and forwards["decode"] > 0 and forwards["prefill"] > 0, forwards
    assert value(after, "refusion_drafted_tokens", "refusion_drafted_tokens_total") > 0
    drafted = value(after, "refusion_drafted_tokens", "refusion_drafted_tokens_total")
    assert 0 <= value(after, "refusion_accepted_tokens", "refusion_accepted_tokens_total") <= drafted
    assert value(after, "refusion_queue_depth") == 0 and value(after, "refusion_batch_size") == 0


def test_queue_depth_and_batch_size_gauges(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        live.scheduler.pause()  # nothing is admitted: both requests wait
        threads = [threading.Thread(target=httpx.post, args=(f"{live.url}/v1/chat/completions",),
                                    kwargs={"json": chat_body(max_tokens=4), "timeout": 30}) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while live.scheduler.status()["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        during = scrape(live.url)
        assert value(during, "refusion_queue_depth") == 2 and value(during, "refusion_batch_size") == 0
        live.scheduler.resume()
        for t in threads:
            t.join(30)
        after = scrape(live.url)
        assert value(after, "refusion_queue_depth") == 0
        assert value(after, "refusion_requests", "refusion_requests_total", status="200", strategy="refusion") == 2


def test_each_app_counts_apart(tiny):
    """Two apps in one process have their own registries (the global one is untouched)."""
    from prometheus_client import REGISTRY

    with live_server(tiny) as one, live_server(tiny) as two:
        one.client().chat.completions.create(**chat_body(max_tokens=4))
        assert value(scrape(one.url), "refusion_requests", "refusion_requests_total", status="200",
                     strategy="refusion") == 1
        assert value(scrape(two.url), "refusion_requests", "refusion_requests_total", status="200",
                     strategy="refusion") == 0
    assert REGISTRY.get_sample_value("refusion_requests_total", {"status": "200", "strategy": "refusion"}) is None


def test_the_routing_gauges_move_under_load(tiny):
    with live_server(tiny, max_batch_size=2, max_queue=4) as live:
        idle = scrape(live.url)
        assert [value(idle, name, model_name=MODEL) for name in ROUTING] == [0, 0, 0, 0]
        step = live.scheduler.decoder.step

        def slow_step(**kwargs):
            time.sleep(0.01)
            return step(**kwargs)

        live.scheduler.decoder.step = slow_step
        long = chat_body(max_tokens=120, refusion={"strategy": "autoregressive", "ignore_eos": True})
        threads = [threading.Thread(target=httpx.post, args=(f"{live.url}/v1/chat/completions",),
                                    kwargs={"json": long, "timeout": 60}) for _ in range(3)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while live.scheduler.status()["live"] + live.scheduler.status()["waiting"] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        readings = []
        for tokens in (2, 30):  # two moments of the same batch: the cache holds more at the second
            while min(job.tokens for job in list(live.scheduler.live)) < tokens:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            live.scheduler.pause()  # freeze the batch between two steps, read, go on
            time.sleep(0.1)
            during = scrape(live.url)
            held = live.scheduler.held_tokens()
            live.scheduler.resume()
            usage = held / (2 * tiny[0].config.max_position_embeddings)
            assert value(during, "vllm:num_requests_waiting", model_name=MODEL) == 1
            assert value(during, "vllm:num_requests_running", model_name=MODEL) == 2
            assert value(during, "vllm:kv_cache_usage_perc", model_name=MODEL) == pytest.approx(usage)
            assert value(during, "vllm:gpu_cache_usage_perc", model_name=MODEL) == pytest.approx(usage)
            assert value(during, "refusion_kv_cache_usage_ratio") == pytest.approx(usage)
            readings.append(usage)
        assert 0 < readings[0] < readings[1] < 1
        for t in threads:
            t.join(60)
        live.wait_idle()
        after = scrape(live.url)
        assert [value(after, name, model_name=MODEL) for name in ROUTING] == [0, 0, 0, 0]
