"""Dynamic batching under pressure: a full queue, clients that leave, a client that does not read."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .conftest import MODEL, LiveServer, live_server, make_app

openai = pytest.importorskip("openai")

LONG = {"max_tokens": 600, "extra_body": {"refusion": {"strategy": "autoregressive", "ignore_eos": True}}}
"""A request that keeps a batch row busy for a while (AR, EOS ignored)."""


def body(content="x", **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kwargs}


def long_body(**kwargs) -> dict:
    return body(max_tokens=LONG["max_tokens"], refusion=LONG["extra_body"]["refusion"], **kwargs)


def wait_until_cancelled(live: LiveServer) -> None:
    """While the scheduler is paused: wait until the server has noticed that the live requests' clients left (it
    checks every DISCONNECT_POLL_SECONDS), so that no decode can finish first once it resumes."""
    deadline = time.monotonic() + 10
    while not all(job.cancelled for job in live.scheduler.live) and time.monotonic() < deadline:
        time.sleep(0.01)


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
        live.scheduler.pause()  # however fast the decode, the request is still live when its client goes
        stream.close()  # the client goes away mid-stream
        wait_until_cancelled(live)
        live.scheduler.resume()
        status = live.wait_idle()
        assert status["cancelled"] == 1 and status["completed"] == 0
        # the only batch row is free again: a new request is served at once
        assert client.chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4


def test_disconnect_of_a_non_streamed_request_frees_the_row(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        timed_out = []

        def post():
            try:
                httpx.post(f"{live.url}/v1/chat/completions", json=long_body(), timeout=httpx.Timeout(30, read=0.3))
            except httpx.ReadTimeout:
                timed_out.append(True)
        client = threading.Thread(target=post)
        client.start()
        deadline = time.monotonic() + 10
        while live.scheduler.status()["live"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        live.scheduler.pause()  # the request holds its row, decoding nothing, until its client has gone
        client.join()
        wait_until_cancelled(live)
        live.scheduler.resume()
        status = live.wait_idle()
        assert timed_out and status["cancelled"] == 1 and status["completed"] == 0, str(status)


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
        def boom(**kwargs):
            raise RuntimeError("simulated device error")

        live.scheduler.decoder.step = boom  # the scheduler replaces the decoder after a failure
        with pytest.raises(openai.InternalServerError, match="simulated device error"):
            live.client().chat.completions.create(**body(max_tokens=4))
        assert live.client().chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4
        assert live.scheduler.status()["failed"] == 1


def test_64_concurrent_clients_against_a_queue_of_8(tiny):
    with live_server(tiny, max_batch_size=4, max_queue=8) as live:
        live.scheduler.pause()  # nothing is admitted: exactly max_queue requests fit, the rest are refused
        responses, lock = [], threading.Lock()

        def ask():
            r = httpx.post(f"{live.url}/v1/chat/completions", json=body(max_tokens=4), timeout=60)
            with lock:
                responses.append(r)

        threads = [threading.Thread(target=ask) for _ in range(64)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(responses) < 56 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(responses) == 56 and live.scheduler.status()["waiting"] == 8
        for r in responses:
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            error = r.json()["error"]
            assert error["code"] == "queue_full" and error["type"] == "server_error" and "busy" in error["message"]
        live.scheduler.resume()
        for t in threads:
            t.join(60)
        ok = [r for r in responses if r.status_code == 200]
        assert len(responses) == 64 and len(ok) == 8
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in ok)
        status = live.wait_idle()
        assert status["rejected"] == 56 and status["completed"] == 8 and status["failed"] == 0
        assert httpx.get(f"{live.url}/health").json()["status"] == "ok"  # no crash: still serving
        assert live.client().chat.completions.create(**body(max_tokens=4)).usage.completion_tokens == 4


class _AsgiSpec:
    """The app as an ASGI server of another spec version sees it (2.4: no disconnect listener in Starlette's
    StreamingResponse, and uvicorn drops writes to a closed connection silently)."""

    def __init__(self, app, spec_version: str):
        self.app, self.state, self.spec_version = app, app.state, spec_version

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": self.spec_version}}
        await self.app(scope, receive, send)


def _send_and_hang_up(port: int, path: str, payload: dict) -> None:
    """A client that sends its request and disconnects before reading anything."""
    raw = json.dumps(payload).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_before_its_first_chunk_is_cancelled(tiny, spec_version, stream, path):
    with LiveServer(_AsgiSpec(make_app(tiny, max_batch_size=1), spec_version)) as live:
        step = live.scheduler.decoder.step

        def slow_step(**kwargs):  # 600 steps would take > 12 s: only a cancellation ends it sooner
            time.sleep(0.02)
            return step(**kwargs)

        live.scheduler.decoder.step = slow_step
        payload = long_body(stream=stream)
        if path == "/v1/completions":
            payload["prompt"] = payload.pop("messages")[0]["content"]
        _send_and_hang_up(live.port, path, payload)
        deadline = time.monotonic() + 10
        while live.scheduler.status()["cancelled"] + live.scheduler.status()["completed"] == 0:
            assert time.monotonic() < deadline, f"still decoding for a client that left: {live.scheduler.status()}"
            time.sleep(0.02)
        status = live.wait_idle()
        assert status["cancelled"] == 1 and status["completed"] == 0 and status["steps"] < 200
