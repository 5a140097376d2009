"""Soak: mixed traffic above the batch size for a while, then nothing may be left behind.

CLIENTS threads send, each from its own seeded random stream, non-streamed and streamed requests (chat and
completions, every strategy, n of 1 or 2), requests they give up on (a stream closed after a few events, a
non-streamed request whose read times out) and invalid ones. At the end every valid request that was waited
for has been answered in full, the scheduler and its decoder hold no sequence and no cache row, and the
process RSS is within RSS_GROWTH_BOUND of what it was after the warm-up. The short run is in the default
suite; `pytest -m slow tests/serve/test_soak.py` runs for SOAK_SECONDS (docs/SERVING.md, Soak).
"""

from __future__ import annotations

import gc
import json
import os
import random
import threading
import time
from collections import Counter

import httpx
import pytest

from .conftest import MODEL, live_server

psutil = pytest.importorskip("psutil")

CLIENTS = 10
"""Concurrent clients: more than the server's batch (MAX_BATCH_SIZE) so that requests queue."""
MAX_BATCH_SIZE = 4
MAX_QUEUE = 32
"""Room for every client's request (with n <= 2): a valid request is never refused as queue_full."""
SHORT_SECONDS = 3.0
SOAK_SECONDS = float(os.environ.get("REFUSION_SOAK_SECONDS", "180"))
RSS_GROWTH_BOUND = 150 << 20
"""Bytes the process may grow between the end of the warm-up and the end of the soak (the KV cache buffer
and allocator pools reach their plateau during the warm-up; a leak of one request's tensors per request
would pass this within the first minutes)."""
STRATEGIES = ("refusion", "speculative", "autoregressive")
INVALID = [
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 99},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "refusion": {"slot_size": 3}},
    {"model": "nope", "messages": [{"role": "user", "content": "x"}]},
    {"model": MODEL, "prompt": [1, 2, 999]},
]


def valid_body(rng: random.Random) -> tuple[str, dict]:
    settings = {"strategy": rng.choice(STRATEGIES)}
    body = {"model": MODEL, "max_tokens": rng.randint(1, 24), "n": rng.choice((1, 1, 2)),
            "temperature": rng.choice((0.0, 0.8)), "seed": rng.randint(0, 1000), "refusion": settings}
    if rng.random() < 0.5:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": rng.choice("abcdef") * 3}]}
    return "/v1/completions", {**body, "prompt": rng.choice(["hello", "x", "what is 2+2?"])}


def one_request(url: str, rng: random.Random, tally: Counter, problems: list) -> None:
    kind = rng.choice(("whole", "whole", "stream", "stream", "cancel_stream", "cancel_whole", "invalid"))
    path, body = valid_body(rng)
    if kind == "whole":
        r = httpx.post(url + path, json=body, timeout=60)
        ok = r.status_code == 200 and len(r.json()["choices"]) == body["n"]
        ok = ok and r.json()["usage"]["completion_tokens"] <= body["max_tokens"] * body["n"]
    elif kind == "stream":
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        finished = [c for e in events[:-1] for c in json.loads(e[6:]).get("choices", []) if c.get("finish_reason")]
        ok = r.status_code == 200 and events[-1] == "data: [DONE]" and len(finished) == body["n"]
    elif kind == "cancel_stream":
        with httpx.stream("POST", url + path, json={**body, "stream": True, "max_tokens": 200}, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i >= rng.randint(0, 3):
                    break
        ok = r.status_code == 200
    elif kind == "cancel_whole":
        try:
            r = httpx.post(url + path, json={**body, "max_tokens": 200},
                           timeout=httpx.Timeout(60, read=rng.uniform(0.01, 0.2)))
            ok = r.status_code == 200  # it was quicker than the client's patience
        except httpx.ReadTimeout:
            ok = True
    else:
        bad = rng.choice(INVALID)
        r = httpx.post(url + ("/v1/completions" if "prompt" in bad else "/v1/chat/completions"), json=bad, timeout=60)
        ok = r.status_code in (400, 404) and r.json()["error"]["message"]
    tally[kind] += 1
    if not ok:
        problems.append((kind, path, body))


def run_clients(url: str, seconds: float, seed: int) -> tuple[Counter, list]:
    tally, problems, deadline = Counter(), [], time.monotonic() + seconds

    def client(index: int):
        rng = random.Random(seed * 1000 + index)
        while time.monotonic() < deadline:
            try:
                one_request(url, rng, tally, problems)
            except Exception as e:  # a hang (timeout), a dropped connection, a malformed answer
                problems.append(("exception", repr(e), None))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    assert not any(t.is_alive() for t in threads), "a client hung"
    return tally, problems


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def soak(tiny, seconds: float) -> dict:
    with live_server(tiny, max_batch_size=MAX_BATCH_SIZE, max_queue=MAX_QUEUE) as live:
        _, problems = run_clients(live.url, min(seconds / 4, 20.0), seed=0)  # warm-up: caches reach their size
        live.wait_idle(60)
        warm = rss()
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=lambda: [samples.append(round((rss() - warm) / 2**20, 1))
                                                   for _ in iter(lambda: stop.wait(max(seconds / 10, 1)), True)])
        sampler.start()
        tally, more = run_clients(live.url, seconds, seed=1)
        stop.set()
        sampler.join()
        problems += more
        status = live.wait_idle(60)
        grown = rss() - warm
        decoder = live.scheduler.decoder
        assert not problems, problems[:5]
        assert not live.scheduler.live and not live.scheduler.waiting, status
        assert decoder.live == {} and decoder.cache.row_of == {}, "the decoder still holds sequences"
        assert status["failed"] == 0 and status["rejected"] == 0, status
        assert grown < RSS_GROWTH_BOUND, f"RSS grew by {grown / 2**20:.0f} MiB"
        assert set(tally) == {"whole", "stream", "cancel_stream", "cancel_whole", "invalid"}, tally
        return {"requests": dict(tally), "rss_growth_mib": round(grown / 2**20, 1), "rss_growth_mib_during": samples,
                "scheduler": status}


@pytest.mark.timeout(300)  # a hang fails, it does not stall the suite
def test_soak_short(tiny):
    soak(tiny, SHORT_SECONDS)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_soak_long(tiny):
    print("soak:", soak(tiny, SOAK_SECONDS))
