"""Isolated faults (one sequence's program raises: it alone fails) and the clean shutdown (drain), in process.
The same shutdown through a real SIGTERM to `refusion serve` is in test_cli.py."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .conftest import MODEL, live_server

openai = pytest.importorskip("openai")

POISON_TOKENS = 7
"""Requests asking for this many tokens get a program that raises on its second step."""


class _FailingProgram:
    """Wraps a decoding program: the n-th `send` raises, as a bug inside one sequence's step would."""

    def __init__(self, program, fail_at: int = 2):
        self.program, self.fail_at, self.sends = program, fail_at, 0

    def send(self, logits):
        self.sends += 1
        if self.sends >= self.fail_at:
            raise RuntimeError("injected fault in one sequence")
        return self.program.send(logits)

    def close(self):
        self.program.close()


def _poison(scheduler) -> None:
    admit = scheduler._admit

    def admit_and_poison(job):
        admit(job)
        if job.seq is not None and job.config.max_new_tokens == POISON_TOKENS:
            running = scheduler.decoder.live[job.seq.id]
            running.program = _FailingProgram(running.program)

    scheduler._admit = admit_and_poison


def body(max_tokens: int, **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "refusion": {"strategy": "autoregressive"}, **kwargs}


def post_all(url: str, bodies: list[dict]) -> list[httpx.Response]:
    """Send every body at once (each from its own thread); the responses in order."""
    responses: list = [None] * len(bodies)

    def send(i):
        responses[i] = httpx.post(f"{url}/v1/chat/completions", json=bodies[i], timeout=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return responses


def slow_down(decoder, seconds: float) -> None:
    """Make every step of `decoder` take `seconds` longer (a slower model), so that requests stay in flight."""
    step = decoder.step

    def slow_step(**kwargs):
        time.sleep(seconds)
        return step(**kwargs)

    decoder.step = slow_step


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _stream_lines(url: str, payload: dict, into: list[str]) -> None:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**payload, "stream": True}, timeout=60) as r:
        into.extend(line for line in r.iter_lines() if line.startswith("data: "))


def test_a_fault_in_one_sequence_fails_only_its_request(tiny):
    with live_server(tiny, max_batch_size=4) as live:
        expected = post_all(live.url, [body(16)])[0].json()["choices"][0]["message"]["content"]
        _poison(live.scheduler)
        live.scheduler.pause()  # queue all four, then admit them together: one batch
        results, streamed = [], []
        whole = threading.Thread(target=lambda: results.extend(
            post_all(live.url, [body(16), body(POISON_TOKENS), body(16)])))
        stream = threading.Thread(target=_stream_lines, args=(live.url, body(POISON_TOKENS), streamed))
        whole.start()
        stream.start()
        wait_for(lambda: live.scheduler.status()["waiting"] == 4)
        live.scheduler.resume()
        whole.join(60)
        stream.join(60)

        ok, poisoned, ok_too = results
        assert ok.status_code == 200 and ok_too.status_code == 200
        assert ok.json()["choices"][0]["message"]["content"] == expected  # batch-mates are unaffected
        assert poisoned.status_code == 500
        error = poisoned.json()["error"]
        assert error["code"] == "decoding_failed" and "injected fault in one sequence" in error["message"]
        assert any('"decoding_failed"' in line and "injected fault" in line for line in streamed)
        assert streamed[-1] == "data: [DONE]"
        status = live.wait_idle()
        assert status["failed"] == 2 and status["completed"] == 3  # the first request + two batch-mates
        assert live.scheduler.decoder.live == {} and live.scheduler.decoder.cache.row_of == {}
        assert post_all(live.url, [body(4)])[0].json()["usage"]["completion_tokens"] == 4  # still serving


def test_shutdown_lets_accepted_requests_finish_and_refuses_new_ones(tiny):
    with live_server(tiny, max_batch_size=1, grace=30) as live:
        slow_down(live.scheduler.decoder, 0.01)
        long = body(60, refusion={"strategy": "autoregressive", "ignore_eos": True})
        results = {}
        running = threading.Thread(target=lambda: results.update(running=post_all(live.url, [long])[0]))
        queued = threading.Thread(target=lambda: results.update(queued=post_all(live.url, [long])[0]))
        running.start()
        wait_for(lambda: live.scheduler.status()["live"] == 1)
        queued.start()
        wait_for(lambda: live.scheduler.status()["waiting"] == 1)

        live.server.begin_shutdown()  # what SIGTERM does
        refused = httpx.post(f"{live.url}/v1/chat/completions", json=body(4), timeout=10)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        assert "shutting down" in refused.json()["error"]["message"]
        health = httpx.get(f"{live.url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        running.join(60)
        queued.join(60)
        for name in ("running", "queued"):  # both were accepted before the signal: both are answered in full
            assert results[name].status_code == 200 and results[name].json()["usage"]["completion_tokens"] == 60
        live.thread.join(30)
        assert not live.thread.is_alive()  # the server stopped by itself once drained
        assert not live.scheduler.busy


def test_shutdown_ends_what_outlives_the_grace_period_with_an_error(tiny):
    with live_server(tiny, max_batch_size=2, grace=0.3) as live:
        slow_down(live.scheduler.decoder, 0.02)  # 600 tokens take > 12 s: longer than the grace period
        long = body(600, refusion={"strategy": "autoregressive", "ignore_eos": True})
        results, streamed = {}, []
        whole = threading.Thread(target=lambda: results.update(whole=post_all(live.url, [long])[0]))
        streaming = threading.Thread(target=_stream_lines, args=(live.url, long, streamed))
        whole.start()
        streaming.start()
        wait_for(lambda: live.scheduler.status()["live"] == 2)
        started = time.monotonic()
        live.server.begin_shutdown()
        whole.join(30)
        streaming.join(30)
        assert time.monotonic() - started < 10
        error = results["whole"].json()["error"]
        assert results["whole"].status_code == 503 and error["code"] == "shutting_down"
        assert "grace period" in error["message"]
        assert any('"shutting_down"' in line for line in streamed) and streamed[-1] == "data: [DONE]"
        live.thread.join(30)
        assert not live.thread.is_alive() and not live.scheduler.busy
        assert live.scheduler.status()["aborted"] == 2
