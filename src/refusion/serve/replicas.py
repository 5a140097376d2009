"""N engine replicas behind one OpenAI endpoint, on Ray Serve (`refusion serve --replicas N`; pip install
'refusion[replicas]').

Each replica is a whole `refusion serve` app (`create_app`: its own model, scheduler, batch, API key and CORS)
inside a Ray Serve deployment; Ray's HTTP proxy listens on --host/--port and routes each request to a replica
with room (at most --max-batch-size + --max-queue in flight each), streams pass through it. A replica reserves
--replica-cpus cores (default: this machine's cores / --max-replicas, else / --replicas, so that autoscaling has
room) or --replica-gpus GPUs; `run` checks the Ray cluster holds --replicas of them before it deploys. Ray's
controller checks each replica's health (`check_health`: its decoding thread runs and is not stalled past
--replica-stall-timeout) and replaces a failing one while the others serve. With --max-replicas, Ray autoscales
between --replicas and --max-replicas, aiming at --max-batch-size requests in flight per replica. Every answer
carries the header `X-Refusion-Replica` (the replica's process id); `/metrics` answers the sums over every replica
(serve/replica_metrics.py). The local Ray cluster starts without its dashboard unless --ray-dashboard asks for it
(then on 127.0.0.1 only).

`deployment(...)` builds the Ray Serve application, for `serve.run` or a Ray Serve config file.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
from collections.abc import Callable

from refusion.config import DecodeConfig
from refusion.serve.settings import ServeConfig

log = logging.getLogger("refusion.serve")

REPLICA_HEADER = "x-refusion-replica"
HEALTH_CHECK_SECONDS = 5.0
"""How often Ray's controller asks each replica whether its decoder is alive and making progress."""
DASHBOARD_HOST = "127.0.0.1"
"""Where Ray's dashboard listens when --ray-dashboard starts it: it has no authentication."""
LAST_PUSH_SECONDS = 2.0
"""How long a stopping replica waits for its last metrics to reach the hub."""
METRICS_DEPLOYMENT = "refusion-metrics"
"""The deployment that merges the replicas' metrics (serve/replica_metrics.py)."""


@dataclasses.dataclass(frozen=True)
class LoadSpec:
    """How each replica loads its model: the model flags of `refusion serve`."""

    model: str | None = None
    """Path, hub id or name (None: the embedded model)."""
    dtype: str | None = None
    device: str | None = None
    linear: str = "auto"
    attention: str | None = None
    compile: bool = False
    before_load: Callable[[], None] | None = None
    """Called in the replica's process just before it loads the model (None: nothing). A test hook: the tests
    hold a replica inside its load to kill it there. Must pickle (Ray ships it to the replica)."""

    def load(self):
        from refusion.model.loading import load

        if self.before_load is not None:
            self.before_load()
        return load(self.model, dtype=self.dtype, device=self.device, attn_implementation=self.attention,
                    linear=self.linear, compile=self.compile)


class EngineReplica:
    """One replica: loads the model in its own process, then serves the refusion app (`__serve_build_asgi_app__`)
    and sends its metrics to the hub (`hub`: a handle to the `MetricsHub` deployment, or None)."""

    def __init__(self, spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str,
                 threads: int, hub=None):
        from refusion.cpu import choose_cpu_threads, passing_thread

        self.spec, self.decode, self.settings, self.model_name, self.hub = spec, decode, settings, model_name, hub
        choose_cpu_threads(threads)  # the cores this replica reserved, before its model loads
        self.model, self.tokenizer = passing_thread(spec.load).result()  # the scheduler thread alone computes
        self.refusion_app = None
        self.stopping = threading.Event()
        self.pusher: threading.Thread | None = None

    def __serve_build_asgi_app__(self):
        from refusion.serve.app import create_app

        s = self.settings
        self.refusion_app = create_app(self.model, self.tokenizer, config=self.decode, model_name=self.model_name,
                                       max_batch_size=s.max_batch_size, max_queue=s.max_queue, api_key=s.api_key,
                                       cors_origins=s.cors_origin, request_timeout=s.request_timeout,
                                       prefix_cache_mb=s.prefix_cache_mb)
        if self.hub is not None:
            self.pusher = threading.Thread(target=self.push_metrics, name="refusion-metrics-push", daemon=True)
            self.pusher.start()
        return ReplicaApp(self.refusion_app, str(os.getpid()), self.hub, self.metrics_snapshot)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose decoding thread stopped, or has work and finished no step for
        --replica-stall-timeout seconds (a wedged forward), is replaced."""
        if self.refusion_app is None:
            return
        scheduler = self.refusion_app.state.server.scheduler
        if not scheduler.running:
            raise RuntimeError("the decoding thread of this replica is not running")
        stalled = scheduler.stalled_for()
        if stalled > self.settings.replica_stall_timeout:
            raise RuntimeError(f"the decoder of this replica finished no step for {stalled:.0f} s with work waiting "
                               f"(--replica-stall-timeout={self.settings.replica_stall_timeout:g})")

    def replica_id(self) -> str:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id

    def metrics_snapshot(self) -> tuple[str, list]:
        """(this replica's id, its metrics as plain data) for the hub."""
        from refusion.serve.replica_metrics import snapshot

        return self.replica_id(), snapshot(self.refusion_app.state.server.metrics.registry)

    def push_metrics(self) -> None:
        """The metrics thread: a snapshot to the hub every PUSH_SECONDS, and a last one when the replica stops."""
        from refusion.serve.replica_metrics import PUSH_SECONDS

        while True:
            stopping = self.stopping.wait(PUSH_SECONDS)
            try:
                self.hub.report.remote(*self.metrics_snapshot()).result(timeout_s=10)
            except Exception as e:  # the hub restarting: the next push catches up
                log.debug("could not send this replica's metrics: %s", e)
            if stopping:
                return

    def __del__(self):
        """Ray Serve stops the replica: the metrics thread sends the last numbers (waited for briefly: the
        process may end first)."""
        self.stopping.set()
        if self.pusher is not None:
            self.pusher.join(LAST_PUSH_SECONDS)


class ReplicaApp:
    """ASGI middleware around one replica's app: every response names the replica that answered
    (`X-Refusion-Replica: pid`), and `GET /metrics` answers the hub's sums over every replica."""

    def __init__(self, app, replica: str, hub=None, snapshot: Callable[[], tuple[str, list]] | None = None):
        self.app, self.replica, self.state = app, replica.encode(), app.state
        self.hub, self.snapshot = hub, snapshot

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]}
            await send(message)
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif self.hub is not None and scope["path"] == "/metrics" and scope["method"] == "GET":
            await self.merged_metrics(named)
        else:
            await self.app(scope, receive, named)

    async def merged_metrics(self, send) -> None:
        """The hub's exposition, this replica's newest numbers included; 503 while the hub cannot answer."""
        from refusion.serve.metrics import CONTENT_TYPE

        try:
            await self.hub.report.remote(*self.snapshot())
            status, body, kind = 200, await self.hub.exposition.remote(), CONTENT_TYPE
        except Exception as e:
            status, body, kind = 503, f"the replicas' metrics are unavailable: {type(e).__name__}\n".encode(), \
                "text/plain; charset=utf-8"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", kind.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def replica_resources(settings: ServeConfig, cores: int | None = None, cuda_gpus: int | None = None) \
        -> tuple[float, float]:
    """(CPU cores, GPUs) each replica reserves: the flags, else `cores` (default: this machine's usable cores)
    shared out among --max-replicas (else --replicas), floored to 0.01 so that they all fit, and one GPU each
    where `cuda_gpus` (default: torch's count) is not 0."""
    if cores is None:
        from refusion.cpu import usable_cores

        cores = usable_cores()
    if cuda_gpus is None and settings.replica_gpus is None:
        import torch

        cuda_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = settings.replica_gpus if settings.replica_gpus is not None else float(cuda_gpus > 0)
    most = settings.max_replicas or settings.replicas
    cpus = settings.replica_cpus if settings.replica_cpus is not None else \
        max(math.floor(cores / most * 100) / 100, 0.01)
    return cpus, gpus


def check_capacity(settings: ServeConfig, cpus: float, gpus: float, cluster: dict[str, float]) -> list[str]:
    """Raise a one-line ValueError when the Ray cluster (`ray.cluster_resources()`) cannot hold --replicas
    replicas of (cpus, gpus) each, where Ray would wait forever without a word; return warnings for
    --max-replicas beyond it (autoscaling stops there unless the cluster grows)."""
    warnings = []
    for resource, each, flag, unit in (("CPU", cpus, "--replica-cpus", "CPU cores"), ("GPU", gpus, "--replica-gpus",
                                                                                       "GPUs")):
        have = cluster.get(resource, 0.0)
        if each <= 0:
            continue
        hint = " (a fraction shares one: --replica-gpus 0.5)" if resource == "GPU" else ""
        if settings.replicas * each > have + 1e-9:
            raise ValueError(f"--replicas={settings.replicas} x {flag}={each:g} needs {settings.replicas * each:g} "
                             f"{unit} but the Ray cluster has {have:g}: lower --replicas or {flag}{hint}")
        if settings.max_replicas is not None and settings.max_replicas * each > have + 1e-9:
            warnings.append(f"--max-replicas={settings.max_replicas} x {flag}={each:g} needs "
                            f"{settings.max_replicas * each:g} {unit} but the Ray cluster has {have:g}: Ray Serve "
                            f"scales up to {int(have / each + 1e-9)} replicas unless the cluster grows")
    return warnings


def ray_init_options(settings: ServeConfig) -> dict:
    """`ray.init` keywords for `refusion serve --replicas`: the dashboard only with --ray-dashboard, and then on
    127.0.0.1 (Ray ignores both when it joins a running cluster: that cluster's own settings stand)."""
    return {"include_dashboard": settings.ray_dashboard, "dashboard_host": DASHBOARD_HOST,
            "log_to_driver": settings.log_level == "debug"}


def deployment(spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str):
    """The Ray Serve application: `settings.replicas` engine replicas (autoscaled up to `settings.max_replicas`)
    and the hub that merges their metrics."""
    from ray import serve

    from refusion.serve.replica_metrics import MetricsHub

    cpus, gpus = replica_resources(settings)
    options = {"ray_actor_options": {"num_cpus": cpus, "num_gpus": gpus},
               "max_ongoing_requests": settings.max_batch_size + settings.max_queue,
               "health_check_period_s": HEALTH_CHECK_SECONDS, "graceful_shutdown_timeout_s": settings.shutdown_grace}
    if settings.max_replicas is not None:
        options["autoscaling_config"] = {"min_replicas": settings.replicas, "max_replicas": settings.max_replicas,
                                         "target_ongoing_requests": settings.max_batch_size}
    else:
        options["num_replicas"] = settings.replicas
    threads = settings.threads or max(1, int(cpus))
    hub = serve.deployment(name=METRICS_DEPLOYMENT, num_replicas=1, ray_actor_options={"num_cpus": 0})(MetricsHub)
    ingress = serve.deployment(name="refusion")(serve.ingress()(EngineReplica))
    return ingress.options(**options).bind(spec, decode, settings, model_name, threads, hub.bind())


def run(spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str) -> int:
    """`refusion serve --replicas N`: start Ray (a local cluster, or join the one RAY_ADDRESS names; an already
    initialised Ray is used as it is), check it can hold the replicas, serve until SIGTERM or Ctrl+C, then shut
    the replicas down (each drains for up to --shutdown-grace seconds) and the Ray this started."""
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError:
        raise ValueError("--replicas needs Ray Serve: pip install 'refusion[replicas]'") from None
    started = not ray.is_initialized()
    if started:
        ray.init(**ray_init_options(settings))
    try:
        cpus, gpus = replica_resources(settings)
        for warning in check_capacity(settings, cpus, gpus, ray.cluster_resources()):
            log.warning(warning)
        serve.start(http_options={"host": settings.host, "port": settings.port})
        try:
            serve.run(deployment(spec, decode, settings, model_name), name="refusion", route_prefix="/")
            log.info("serving %s on http://%s:%d with %d replica(s) of %g CPU core(s), %g GPU(s) on Ray Serve",
                     model_name, settings.host, settings.port, settings.replicas, cpus, gpus)
            stop = threading.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: stop.set())
            stop.wait()
        finally:
            serve.shutdown()
    finally:
        if started:
            ray.shutdown()
    return 0
