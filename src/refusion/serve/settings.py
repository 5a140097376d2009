"""`ServeConfig`: the settings of `refusion serve` other than the model and decoding flags. One source: the
command's flags are generated from these fields (`serve/cli.py`), each flag's help is the field's docstring."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

API_KEY_ENV = "REFUSION_API_KEY"
"""The environment variable read when --api-key is not given (keeps the key out of `ps` and shell history)."""
SHUTDOWN_GRACE_SECONDS = 20.0
"""Default of --shutdown-grace: after SIGTERM, accepted requests have this long to finish. With the flush time
of serve/shutdown.py (5 s) it stays under the 30 s that Kubernetes and most supervisors wait before SIGKILL."""
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
PREFIX_CACHE_MB = 2048
"""Default of --prefix-cache-mb: about 93,000 prompt tokens of the embedded model in bf16 (30 layers x 2 x 3 KV heads x
64 dims: 22.5 KiB of entries each), 46,000 in fp32: 16 chats of 8 turns at 128 tokens an answer fill ~25,000 (a
budget under that evicts each chat's prefix before its next turn). llama-server keeps up to 8 GiB of prompts
(`--cache-ram`)."""


@dataclass(frozen=True)
class ServeConfig:
    """How the server listens, batches, admits and stops (docs/SERVING.md)."""

    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on."""
    max_batch_size: int = 8
    """Most sequences decoded together in one batched forward."""
    max_queue: int = 64
    """Most requests waiting for a batch row; more are answered 503."""
    served_model_name: str | None = None
    """The model id clients pass as `model` (default: the --model name, or 'refusion')."""
    threads: int | None = None
    """Torch CPU threads (default: every core the process may run on). On a machine shared with CPU-bound work, the
    cores left free: oversubscribed cores slow every forward down many times."""
    shutdown_grace: float = SHUTDOWN_GRACE_SECONDS
    """Seconds: on SIGTERM / Ctrl+C new requests get 503 and the accepted ones have this long to finish before
    they are ended with an error; then the process exits 0."""
    log_level: str = "info"
    """Log level of the server and of uvicorn."""
    api_key: str | None = field(default=None, repr=False)
    """Clients must send `Authorization: Bearer KEY` to /v1/* (else 401); default: the REFUSION_API_KEY
    environment variable, else no key. /health and /metrics stay open."""
    cors_origin: tuple[str, ...] = ()
    """Browser origins allowed to call the API across origins (repeat the flag; '*' for any); default none: CORS
    is off."""
    request_timeout: float | None = None
    """Seconds a generation request may take from arrival (queue included); past it its decoding stops, its
    batch row is freed and it ends with a 504 `request_timeout` (default: no limit)."""
    prefix_cache_mb: int = PREFIX_CACHE_MB
    """MiB of prompt prefixes' KV entries kept across requests, least recently used evicted first: a prompt that
    starts as an earlier one did (a chat's earlier turns, a shared system prompt) prefills only the rest. 0 turns
    it off; it is off anyway where reusing entries could change an answer (docs/SERVING.md, "Prefix caching")."""

    replicas: int = 1
    """Engine replicas behind one endpoint: more than 1 runs them on Ray Serve (pip install 'refusion[replicas]';
    serve/replicas.py), each a whole server with its own model, batch and cores (or GPU)."""
    max_replicas: int | None = None
    """With --replicas N: let Ray Serve autoscale between N and this many replicas, aiming at --max-batch-size
    requests in flight per replica (default: exactly N)."""
    replica_cpus: float | None = None
    """CPU cores each replica reserves in Ray (its torch threads: this rounded down, at least 1); default: the
    machine's cores / --max-replicas (else / --replicas), so that every replica up to --max-replicas fits on this
    machine."""
    replica_gpus: float | None = None
    """GPUs each replica reserves; default: 1 where CUDA is available, else 0 (0.5: two replicas share a GPU)."""
    replica_stall_timeout: float = 120.0
    """With --replicas: seconds a replica's decoder may go without finishing a step while it has work before Ray's
    health check calls it unhealthy and replaces it (a wedged forward)."""
    ray_dashboard: bool = False
    """With --replicas: start the local Ray cluster with its dashboard, bound to 127.0.0.1 (it has no
    authentication); default off."""

    def __post_init__(self):
        _require(self.max_batch_size >= 1, "max_batch_size", self.max_batch_size, "must be >= 1")
        _require(self.max_queue >= 0, "max_queue", self.max_queue, "must be >= 0")
        _require(self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1")
        _require(0 <= self.port < 65536, "port", self.port, "must be in [0, 65535]")
        _require(self.shutdown_grace >= 0, "shutdown_grace", self.shutdown_grace, "must be >= 0 seconds")
        _require(self.log_level in LOG_LEVELS, "log_level", self.log_level, f"must be one of {', '.join(LOG_LEVELS)}")
        _require(self.api_key is None or (self.api_key.strip() == self.api_key != ""), "api_key", "<hidden>",
                 "must be non-empty, without surrounding spaces")
        _require(all(o.strip() for o in self.cors_origin), "cors_origin", self.cors_origin, "origins must be non-empty")
        _require(self.request_timeout is None or self.request_timeout > 0, "request_timeout", self.request_timeout,
                 "must be > 0 seconds")
        _require(self.prefix_cache_mb >= 0, "prefix_cache_mb", self.prefix_cache_mb, "must be >= 0 (0: off)")
        _require(self.replicas >= 1, "replicas", self.replicas, "must be >= 1")
        _require(self.max_replicas is None or self.max_replicas >= self.replicas, "max_replicas", self.max_replicas,
                 f"must be >= --replicas={self.replicas}")
        _require(self.replica_cpus is None or self.replica_cpus > 0, "replica_cpus", self.replica_cpus, "must be > 0")
        _require(self.replica_gpus is None or self.replica_gpus >= 0, "replica_gpus", self.replica_gpus, "must be >= 0")
        _require(self.replica_stall_timeout > 0, "replica_stall_timeout", self.replica_stall_timeout,
                 "must be > 0 seconds")


def api_key_from(flag: str | None) -> str | None:
    """The key of --api-key, else of the environment (an empty variable is no key)."""
    return flag if flag is not None else (os.environ.get(API_KEY_ENV) or None)


def _require(ok: bool, name: str, value, allowed: str) -> None:
    """A bad setting, named as its flag (`--max-batch-size=0 is invalid: must be >= 1`)."""
    if not ok:
        raise ValueError(f"--{name.replace('_', '-')}={value} is invalid: {allowed}")
