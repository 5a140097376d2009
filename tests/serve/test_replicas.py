"""`refusion serve --replicas N` on Ray Serve: two tiny-model replicas behind one endpoint on the CPU both serve,
answer as one server does (whole and streamed), and when one is killed no request that had not started on it is
lost; Ray replaces it."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import httpx
import pytest

from refusion.config import DecodeConfig

from .conftest import MODEL, LiveServer, make_app

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow  # Ray and two model-loading replicas: ~40 s

CONFIG = DecodeConfig(max_new_tokens=12, slot_size=4, block_size=8)
PROMPTS = ["hello", "what is 2+2?", "abc", "tell me", "one two three", "x"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas(tiny, tmp_path_factory):
    from refusion.serve import replicas as module
    from refusion.serve.settings import ServeConfig

    path = tmp_path_factory.mktemp("tiny")
    tiny[0].save_pretrained(path)
    tiny[1].save_pretrained(path)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        settings = ServeConfig(replicas=2, replica_cpus=1, replica_gpus=0, max_batch_size=4, max_queue=8)
        spec = module.LoadSpec(str(path), dtype=str(next(tiny[0].parameters()).dtype).removeprefix("torch."))
        serve.run(module.deployment(spec, CONFIG, settings, MODEL), name="refusion", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def complete(url: str, prompt: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, **kwargs}, timeout=60)


def test_two_replicas_both_serve_and_answer_as_one_server(replicas, tiny):
    with LiveServer(make_app(tiny, config=CONFIG)) as one:
        expected = [complete(one.url, p).json()["choices"][0]["text"] for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: complete(replicas, p), PROMPTS * 3))
    assert all(r.status_code == 200 for r in answers)
    assert [r.json()["choices"][0]["text"] for r in answers] == expected * 3
    assert len({r.headers["x-refusion-replica"] for r in answers}) == 2  # both replicas answered
    with httpx.stream("POST", f"{replicas}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": PROMPTS[1], "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 2  # streamed through Ray's proxy, chunk by chunk
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == expected[1]


def test_killing_a_replica_loses_no_request_that_had_not_started_on_it(replicas):
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if "SERVE_REPLICA" in a["name"]]
    assert len(names) == 2
    before = {complete(replicas, "x").headers["x-refusion-replica"] for _ in range(8)}
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]), no_restart=True)
    answers = [complete(replicas, p) for p in PROMPTS * 2]  # sent after the kill, one after another
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text[:200] for r in answers]
    deadline = time.monotonic() + 60  # Ray's controller starts a replacement
    while True:
        status = serve.status().applications["refusion"].deployments["refusion"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    after = set()
    while len(after) < 2 and time.monotonic() < deadline:
        after.add(complete(replicas, "x").headers["x-refusion-replica"])
    assert len(after) == 2 and after != before  # two replicas again, one of them new
