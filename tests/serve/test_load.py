"""Dynamic batching under pressure: a full queue, clients that leave, a client that does not read."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import MODEL, live_server

openai = pytest.importorskip("openai")

LONG = {"max_tokens": 600, "extra_body": {"refusion": {"strategy": "autoregressive", "ignore_eos": True}}}
"""A request that keeps a batch row busy for a while (AR, EOS ignored)."""


def body(content="x", **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kwargs}


def long_body(**kwargs) -> dict:
    return body(max_tokens=LONG["max_tokens"], refusion=LONG["extra_body"]["refusion"], **kwargs)


def test_full_queue_answers_503_then_recovers(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=1) as live:
        live.scheduler.pause()  # hold everything in the queue, so that it fills deterministically
        results = {}
        waiting = threading.Thread(target=lambda: results.update(
            first=httpx.post(f"{live.url}/v1/chat/completions", json=body(max_tokens=4), timeout=30)))
        waiting.start()
        deadline = time.monotonic() + 10
        while live.scheduler.status()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as e:
            live.client().chat.completions.create(**body(max_tokens=4))
        assert e.value.status_code == 503 and "busy" in e.value.message
        assert e.value.response.headers["Retry-After"] == "1"
        assert e.value.body["code"] == "queue_full"
        assert live.scheduler.status()["rejected"] == 1
        live.scheduler.resume()
        waiting.join(30)
        assert results["first"].status_code == 200
        assert live.client().chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4


def test_disconnect_mid_stream_frees_the_row(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        client = live.client()
        stream = client.chat.completions.create(**body(), stream=True, **LONG)
        received = ""
        for chunk in stream:
            received += chunk.choices[0].delta.content or ""
            if len(received) >= 3:
                break
        stream.close()  # the client goes away mid-stream
        status = live.wait_idle()
        assert status["cancelled"] == 1 and status["completed"] == 0
        # the only batch row is free again: a new request is served at once
        assert client.chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4


def test_disconnect_of_a_non_streamed_request_frees_the_row(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/chat/completions", json=long_body(), timeout=httpx.Timeout(30, read=0.3))
        status = live.wait_idle()
        assert status["cancelled"] == 1 and status["completed"] == 0


def test_disconnect_while_queued_drops_the_job(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        live.scheduler.pause()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{live.url}/v1/chat/completions", json=body(max_tokens=4),
                       timeout=httpx.Timeout(30, read=0.3))
        deadline = time.monotonic() + 10
        while live.scheduler.status()["waiting"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert live.scheduler.status()["cancelled"] == 1 and live.scheduler.status()["waiting"] == 0
        live.scheduler.resume()
        assert live.client().chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4


def test_a_reader_that_stalls_does_not_block_others(tiny):
    with live_server(tiny, max_batch_size=2, max_queue=4) as live:
        client = live.client()
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=long_body(stream=True),
                          timeout=30) as slow:
            assert slow.status_code == 200
            start = time.monotonic()
            fast = client.chat.completions.create(**body("hello", max_tokens=8))
            assert fast.usage.completion_tokens >= 1 and time.monotonic() - start < 20
            assert live.wait_idle()["completed"] == 2  # the unread stream was decoded to the end all the same
            events = [line for line in slow.iter_lines() if line.startswith("data: ")]  # now read it all
        assert events[-1] == "data: [DONE]" and len(events) > 10


def test_a_failed_step_fails_its_requests_and_the_server_goes_on(tiny):
    with live_server(tiny) as live:
        def boom():
            raise RuntimeError("simulated device error")

        live.scheduler.decoder.step = boom  # the scheduler replaces the decoder after a failure
        with pytest.raises(openai.InternalServerError, match="simulated device error"):
            live.client().chat.completions.create(**body(max_tokens=4))
        assert live.client().chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4
        assert live.scheduler.status()["failed"] == 1
