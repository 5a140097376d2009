"""N engine replicas behind one OpenAI endpoint, on Ray Serve (`refusion serve --replicas N`; pip install
'refusion[replicas]').

Each replica is a whole `refusion serve` app (`create_app`: its own model, scheduler, batch, metrics, API key and
CORS) inside a Ray Serve deployment; Ray's HTTP proxy listens on --host/--port and routes each request to a replica
with room (at most --max-batch-size + --max-queue in flight each), streams pass through it. A replica reserves
--replica-cpus cores (its torch threads) or --replica-gpus GPUs; Ray's controller checks each replica's health
(`check_health`: its decoding thread is running) and replaces one that dies while the others serve. With
--max-replicas, Ray autoscales between --replicas and --max-replicas, aiming at --max-batch-size requests in flight
per replica. Every answer carries the header `X-Refusion-Replica` (the replica's process id).

`deployment(...)` builds the Ray Serve application, for `serve.run` or a Ray Serve config file.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading

from refusion.config import DecodeConfig
from refusion.serve.settings import ServeConfig

log = logging.getLogger("refusion.serve")

REPLICA_HEADER = "x-refusion-replica"
HEALTH_CHECK_SECONDS = 5.0
"""How often Ray's controller asks each replica whether its decoding thread is alive."""


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

    def load(self):
        from refusion.model.loading import load

        return load(self.model, dtype=self.dtype, device=self.device, attn_implementation=self.attention,
                    linear=self.linear, compile=self.compile)


class EngineReplica:
    """One replica: loads the model in its own process, then serves the refusion app (`__serve_build_asgi_app__`)."""

    def __init__(self, spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str,
                 threads: int):
        from refusion.cpu import choose_cpu_threads

        self.spec, self.decode, self.settings, self.model_name = spec, decode, settings, model_name
        choose_cpu_threads(threads)  # the cores this replica reserved, before its model loads
        self.model, self.tokenizer = spec.load()
        self.refusion_app = None

    def __serve_build_asgi_app__(self):
        from refusion.serve.app import create_app

        s = self.settings
        self.refusion_app = create_app(self.model, self.tokenizer, config=self.decode, model_name=self.model_name,
                              max_batch_size=s.max_batch_size, max_queue=s.max_queue, api_key=s.api_key,
                              cors_origins=s.cors_origin, request_timeout=s.request_timeout)
        return ReplicaHeader(self.refusion_app, str(os.getpid()))

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose decoding thread stopped is replaced."""
        if self.refusion_app is not None and not self.refusion_app.state.server.scheduler.running:
            raise RuntimeError("the decoding thread of this replica is not running")


class ReplicaHeader:
    """ASGI middleware: every response names the replica that answered (`X-Refusion-Replica: pid`)."""

    def __init__(self, app, replica: str):
        self.app, self.replica, self.state = app, replica.encode(), app.state

    async def __call__(self, scope, receive, send):
        async def named(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica)]}
            await send(message)
        await self.app(scope, receive, named if scope["type"] == "http" else send)


def replica_resources(settings: ServeConfig) -> tuple[float, float]:
    """(CPU cores, GPUs) each replica reserves: the flags, else the cores this process may use (its affinity and
    CPU quota: `refusion.cpu.usable_cores`) shared out and one GPU each where CUDA is available."""
    import torch

    from refusion.cpu import usable_cores

    gpus = settings.replica_gpus if settings.replica_gpus is not None else float(torch.cuda.is_available())
    cpus = settings.replica_cpus if settings.replica_cpus is not None else \
        max(1.0, float(usable_cores() // settings.replicas))
    return cpus, gpus


def deployment(spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str):
    """The Ray Serve application: `settings.replicas` engine replicas (autoscaled up to `settings.max_replicas`)."""
    from ray import serve

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
    ingress = serve.deployment(name="refusion")(serve.ingress()(EngineReplica))
    return ingress.options(**options).bind(spec, decode, settings, model_name, threads)


def run(spec: LoadSpec, decode: DecodeConfig, settings: ServeConfig, model_name: str) -> int:
    """`refusion serve --replicas N`: start Ray (a local cluster, or the one RAY_ADDRESS names), serve until SIGTERM
    or Ctrl+C, then shut the replicas down (each drains for up to --shutdown-grace seconds)."""
    try:
        import ray
        from ray import serve
    except ModuleNotFoundError:
        raise ValueError("--replicas needs Ray Serve: pip install 'refusion[replicas]'") from None
    ray.init(ignore_reinit_error=True, log_to_driver=settings.log_level == "debug")
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(deployment(spec, decode, settings, model_name), name="refusion", route_prefix="/")
    log.info("serving %s on http://%s:%d with %d replica(s) on Ray Serve", model_name, settings.host, settings.port,
             settings.replicas)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
    return 0
