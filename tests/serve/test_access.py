"""Access and cancellation: the API key (401 without it, never logged), CORS only when asked, and a client that
leaves or a request that outlives --request-timeout stops decoding and frees its batch row."""

from __future__ import annotations

import argparse
import logging
import threading
import time

import httpx
import pytest

from .conftest import MODEL, live_server

openai = pytest.importorskip("openai")

KEY = "sk-test-3f9a1c"
LONG = {"strategy": "autoregressive", "ignore_eos": True}


def chat(max_tokens: int = 4, **kwargs) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, **kwargs}


def slow_down(scheduler, seconds: float) -> None:
    step = scheduler.decoder.step

    def slow_step(**kwargs):
        time.sleep(seconds)
        return step(**kwargs)

    scheduler.decoder.step = slow_step


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_api_key_is_required_on_v1_and_never_logged(tiny, caplog):
    caplog.set_level(logging.DEBUG)
    with live_server(tiny, api_key=KEY) as live:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": f"Bearer {KEY}x"}):
            r = httpx.post(f"{live.url}/v1/chat/completions", json=chat(), headers=headers, timeout=10)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            error = r.json()["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert KEY not in r.text
        assert httpx.get(f"{live.url}/v1/models", timeout=10).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            live.client().chat.completions.create(**chat())
        keyed = openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, max_retries=0, timeout=30)
        assert keyed.chat.completions.create(**chat()).usage.completion_tokens == 4
        assert keyed.models.list().data[0].id == MODEL
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200  # probes and scrapers carry no key
        assert httpx.get(f"{live.url}/metrics", timeout=10).status_code == 200
        assert live.scheduler.status()["completed"] == 1  # nothing refused reached the scheduler
    assert caplog.records and not any(KEY in record.getMessage() for record in caplog.records)


def test_the_key_comes_from_the_flag_or_the_environment_and_is_not_shown(monkeypatch):
    from refusion.serve import cli
    from refusion.serve.access import ApiKeyGuard

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    monkeypatch.delenv("REFUSION_API_KEY", raising=False)
    assert cli.serve_config_from_args(parser.parse_args(["serve"])).api_key is None
    monkeypatch.setenv("REFUSION_API_KEY", "from-env")
    settings = cli.serve_config_from_args(parser.parse_args(["serve"]))
    assert settings.api_key == "from-env" and "from-env" not in repr(settings)
    assert cli.serve_config_from_args(parser.parse_args(["serve", "--api-key", KEY])).api_key == KEY
    with pytest.raises(ValueError, match="api-key") as e:
        cli.run(parser.parse_args(["serve", "--api-key", " padded "]))
    assert "padded" not in str(e.value)
    guard = ApiKeyGuard(None, KEY)
    assert guard.allows(KEY) and not guard.allows(None) and not guard.allows("") and not guard.allows(KEY[:-1])


def test_cors_is_off_unless_an_origin_is_given(tiny):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with live_server(tiny) as live:
        r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "https://app.example"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        r = httpx.options(f"{live.url}/v1/chat/completions", headers=preflight, timeout=10)
        assert "access-control-allow-origin" not in r.headers
    with live_server(tiny, cors_origins=("https://app.example",), api_key=KEY) as live:
        r = httpx.options(f"{live.url}/v1/chat/completions", headers=preflight, timeout=10)  # no key: a preflight
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.get(f"{live.url}/v1/models", headers={"Origin": "https://app.example",
                                                         "Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.options(f"{live.url}/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"},
                          timeout=10)
        assert "access-control-allow-origin" not in r.headers


def test_a_disconnect_mid_stream_admits_the_queued_request(tiny):
    with live_server(tiny, max_batch_size=1, max_queue=4) as live:
        slow_down(live.scheduler, 0.01)
        results = {}
        with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=chat(600, stream=True, refusion=LONG),
                          timeout=30) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if '"content"' in line and '""' not in line)  # decoding
            queued = threading.Thread(target=lambda: results.update(r=httpx.post(
                f"{live.url}/v1/chat/completions", json=chat(8), timeout=30)))
            queued.start()
            wait_for(lambda: live.scheduler.status()["waiting"] == 1)  # the only row is taken
            assert live.scheduler.status()["live"] == 1
        # the client left: its sequence stops and the queued request takes the row
        queued.join(30)
        assert results["r"].status_code == 200 and results["r"].json()["usage"]["completion_tokens"] == 8
        status = live.wait_idle()
        assert status["cancelled"] == 1 and status["completed"] == 1 and status["steps"] < 300


def test_a_request_past_its_timeout_stops_decoding_and_frees_its_row(tiny):
    with live_server(tiny, max_batch_size=2, request_timeout=0.6) as live:
        slow_down(live.scheduler, 0.02)  # 600 tokens would take > 12 s
        started = time.monotonic()
        whole = httpx.post(f"{live.url}/v1/chat/completions", json=chat(600, refusion=LONG), timeout=30)
        assert time.monotonic() - started < 5
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "request_timeout"
        with httpx.stream("POST", f"{live.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 600, "stream": True,
                                "refusion": LONG}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"request_timeout"' in events[-2] and events[-1] == "data: [DONE]"
        status = live.wait_idle(5)
        assert status["cancelled"] == 2 and status["completed"] == 0
        assert live.scheduler.decoder.live == {} and live.scheduler.decoder.cache.row_of == {}
        assert httpx.post(f"{live.url}/v1/chat/completions", json=chat(4), timeout=30).status_code == 200
        metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
        assert 'refusion_requests_total{status="504",strategy="autoregressive"} 2.0' in metrics
