"""`refusion serve --replicas N` on Ray Serve: two tiny-model replicas behind one endpoint on the CPU both serve,
answer as one server does (whole and streamed), and `/metrics` sums them; when one is killed, after its start or
while it loads its model, no request that had not started on it is lost and Ray replaces it; `run` refuses more
replicas than the cluster holds in one line; and no Ray process outlives the module (one cluster for all)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest

from refusion.config import DecodeConfig

from .conftest import MODEL, LiveServer, make_app

serve = pytest.importorskip("ray.serve")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow  # Ray and replicas loading models on a small machine: minutes

CONFIG = DecodeConfig(max_new_tokens=12, slot_size=4, block_size=8)
PROMPTS = ["hello", "what is 2+2?", "abc", "tell me", "one two three", "x"]
REPLACED_WITHIN = 300.0
"""Seconds Ray's controller may take to bring a replica back (a fresh process loading a model, on a busy machine)."""


STRAGGLER_GRACE = 30.0
"""Seconds Ray's processes get to exit after ray.shutdown() before the fixture kills them (none outlives the module)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class HoldLoad:
    """`LoadSpec.before_load`: while the file `hold` exists, a replica about to load its model writes its pid to
    `loading-PID` beside it and waits (at most a minute), so that the test can kill it in mid-load."""

    folder: str

    def __call__(self) -> None:
        hold = Path(self.folder, "hold")
        if not hold.exists():
            return
        Path(self.folder, f"loading-{os.getpid()}").write_text(str(os.getpid()))
        deadline = time.monotonic() + 60
        while hold.exists() and time.monotonic() < deadline:
            time.sleep(0.05)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster for the module; at the end every process it started (raylet, GCS, workers) is gone."""
    already = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. multiprocessing's resource tracker
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        started = [p for p in psutil.Process().children(recursive=True) if p.pid not in already]
        assert {"raylet", "gcs_server"} <= set(names(started))  # what is checked below is Ray's
        ray.shutdown()
        _, alive = psutil.wait_procs(started, timeout=STRAGGLER_GRACE)
        alive = [p for p in alive if _running(p)]  # an exited child not yet reaped (a zombie) is gone
        if alive:  # a worker still inside its task when its raylet went can take longer on a busy machine
            warnings.warn(f"Ray processes still running {STRAGGLER_GRACE:.0f} s after ray.shutdown(), killed: "
                          f"{command_lines(alive)}", stacklevel=1)
            for p in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
            _, alive = psutil.wait_procs(alive, timeout=10)
        left = [p for p in alive if _running(p)]
        assert not left, f"Ray processes survived SIGKILL: {names(left)}"


def command_lines(processes: list) -> list[str]:
    """The command lines of the processes still there (a Ray worker's says what it ran: `ray::ServeReplica...`)."""
    found = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(" ".join(p.cmdline())[:200])
    return found


def names(processes: list) -> list[str]:
    """The names of the processes still there."""
    found = []
    for p in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            found.append(p.name())
    return found


@pytest.fixture(scope="module")
def app_parts(tiny, tmp_path_factory, ray_cluster):
    from refusion.serve import replicas as module

    path = tmp_path_factory.mktemp("tiny")
    tiny[0].save_pretrained(path)
    tiny[1].save_pretrained(path)
    gate = tmp_path_factory.mktemp("hold")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # HoldLoad travels to the replicas by value
    spec = module.LoadSpec(str(path), dtype=str(next(tiny[0].parameters()).dtype).removeprefix("torch."),
                           before_load=HoldLoad(str(gate)))
    return module, spec, gate


@pytest.fixture(scope="module")
def replicas(app_parts):
    from refusion.serve.settings import ServeConfig

    module, spec, _ = app_parts
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        settings = ServeConfig(replicas=2, replica_cpus=1, replica_gpus=0, max_batch_size=4, max_queue=8)
        serve.run(module.deployment(spec, CONFIG, settings, MODEL), name="refusion", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


def complete(url: str, prompt: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, **kwargs}, timeout=60)


def engine_replicas() -> list[dict]:
    """The named actors of the engine replicas (not the metrics hub's)."""
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "SERVE_REPLICA" in a["name"] and "#refusion#" in a["name"]]


def metric(url: str, name: str) -> float:
    """The sum of a metric's series in the endpoint's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def wait_running(url: str, deadline: float) -> set[str]:
    """Wait until Ray reports two engine replicas running and both answer; their replica ids."""
    while True:
        status = serve.status().applications["refusion"].deployments["refusion"]
        if status.replica_states.get("RUNNING", 0) == 2:
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    answered = set()
    while len(answered) < 2 and time.monotonic() < deadline:
        answered.add(complete(url, "x").headers["x-refusion-replica"])
    assert len(answered) == 2, answered
    return answered


def test_two_replicas_both_serve_answer_as_one_server_and_metrics_sum_them(replicas, tiny):
    with LiveServer(make_app(tiny, config=CONFIG)) as one:
        expected = [complete(one.url, p).json()["choices"][0]["text"] for p in PROMPTS]
    before = metric(replicas, "refusion_requests_total")
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

    deadline = time.monotonic() + 30  # each replica sends its numbers every second: every request, either replica
    while metric(replicas, "refusion_requests_total") < before + len(answers) + 1:
        assert time.monotonic() < deadline, metric(replicas, "refusion_requests_total")
        time.sleep(0.5)
    assert metric(replicas, "refusion_requests_total") == before + len(answers) + 1
    assert metric(replicas, "refusion_replicas") == 2


def test_killing_a_replica_loses_no_request_that_had_not_started_on_it(replicas):
    running = engine_replicas()
    assert len(running) == 2
    before = {complete(replicas, "x").headers["x-refusion-replica"] for _ in range(8)}
    ray.kill(ray.get_actor(running[0]["name"], namespace=running[0]["namespace"]), no_restart=True)
    answers = [complete(replicas, p) for p in PROMPTS * 2]  # sent after the kill, one after another
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text[:200] for r in answers]
    after = wait_running(replicas, time.monotonic() + REPLACED_WITHIN)  # Ray's controller starts a replacement
    assert after != before  # two replicas again, one of them new


def test_a_replica_killed_while_it_loads_its_model_loses_no_request(replicas, app_parts):
    _, _, gate = app_parts
    running = engine_replicas()
    answers: list[httpx.Response | Exception] = []
    stop = threading.Event()

    def client():  # one request after another, all through the kill of the loading replica
        while not stop.is_set():
            try:
                answers.append(complete(replicas, PROMPTS[len(answers) % len(PROMPTS)]))
            except httpx.HTTPError as e:
                answers.append(e)

    thread = threading.Thread(target=client, daemon=True)
    (gate / "hold").write_text("")  # replacements now wait inside their load
    try:
        ray.kill(ray.get_actor(running[0]["name"], namespace=running[0]["namespace"]), no_restart=True)
        deadline = time.monotonic() + REPLACED_WITHIN
        while not list(gate.glob("loading-*")):  # the replacement is inside its load
            assert time.monotonic() < deadline, "no replacement began to load"
            time.sleep(0.1)
        thread.start()
        time.sleep(1.0)
        loading = int(next(gate.glob("loading-*")).read_text())
        os.kill(loading, signal.SIGKILL)  # killed in mid-load
        time.sleep(2.0)  # requests keep coming while Ray notices the loss
        (gate / "hold").unlink()  # the next replacement loads at once
        after = wait_running(replicas, time.monotonic() + REPLACED_WITHIN)
    finally:
        (gate / "hold").unlink(missing_ok=True)
        stop.set()
        if thread.is_alive():
            thread.join(60)
    assert str(loading) not in after
    statuses = [getattr(r, "status_code", repr(r)) for r in answers]
    assert statuses and statuses == [200] * len(answers), statuses


def test_run_refuses_more_replicas_than_the_cluster_holds_in_one_line(app_parts):
    from refusion.serve.settings import ServeConfig

    module, spec, _ = app_parts
    settings = ServeConfig(replicas=5, replica_cpus=1, replica_gpus=0, port=free_port())
    with pytest.raises(ValueError, match=r"^--replicas=5 x --replica-cpus=1 needs 5 CPU cores but the Ray cluster "
                                         r"has 4: lower --replicas or --replica-cpus$"):
        module.run(spec, CONFIG, settings, MODEL)
    assert ray.is_initialized()  # run leaves a Ray it did not start running


def _running(process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
