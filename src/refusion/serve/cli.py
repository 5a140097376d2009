"""`refusion serve`: the OpenAI-compatible server (FastAPI + uvicorn, one decoding thread)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from refusion.arguments import (
    add_dataclass_arguments,
    add_decode_arguments,
    add_model_arguments,
    check_device,
    decode_config_from_args,
    load_from_args,
)
from refusion.cpu import choose_cpu_threads, passing_thread
from refusion.serve.settings import LOG_LEVELS, ServeConfig, api_key_from


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model behind an OpenAI-compatible API (streaming, dynamic batching)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and /health. The decoding flags "
                    "are the defaults of every request; a request overrides them with max_tokens, temperature, "
                    "seed and the extension object \"refusion\": {slot_size, block_size, ...}.")
    add_model_arguments(p)
    add_dataclass_arguments(p, ServeConfig, default=None, special={
        "log_level": {"choices": LOG_LEVELS},
        "api_key": {"metavar": "KEY"},
        "cors_origin": {"action": "append", "metavar": "ORIGIN"},
        "request_timeout": {"type": float, "metavar": "SECONDS"},
        "prefix_cache_mb": {"type": int, "metavar": "MIB"},
        "shutdown_grace": {"type": float, "metavar": "SECONDS"},
        "replica_cpus": {"type": float, "metavar": "CORES"},
        "replica_gpus": {"type": float, "metavar": "GPUS"},
        "replica_stall_timeout": {"type": float, "metavar": "SECONDS"},
    })
    add_decode_arguments(p)
    p.set_defaults(func=run)


def serve_config_from_args(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags given (the others at the field's default; the API key from the environment
    when no flag gives it)."""
    values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServeConfig)}
    values = {name: value for name, value in values.items() if value is not None}
    values["cors_origin"] = tuple(values.get("cors_origin", ()))
    values["api_key"] = api_key_from(values.get("api_key"))
    return ServeConfig(**values)


def served_name(model: str | None) -> str:
    if model is None:
        return "refusion"
    return os.path.basename(os.path.normpath(model)) or model


def run(args: argparse.Namespace) -> int:
    settings = serve_config_from_args(args)  # validated before anything loads
    # --threads before anything loads or is looked up (the calibration record is keyed by the count); None: every
    # core the process may use (`refusion.cpu`), which served fastest on a quiet machine (docs/SERVING.md)
    choose_cpu_threads(settings.threads)
    import uvicorn

    from refusion.serve.app import create_app
    from refusion.serve.shutdown import FLUSH_SECONDS, GracefulServer

    cfg = decode_config_from_args(args)  # validated before the model loads
    check_device(args.device)
    show_server_log(settings.log_level)
    if settings.replicas > 1 or settings.max_replicas is not None:
        from refusion.serve import replicas

        spec = replicas.LoadSpec(args.model, args.dtype, args.device, args.linear, args.attention, args.compile)
        return replicas.run(spec, cfg, settings, settings.served_model_name or served_name(args.model))
    # loaded (warmed, calibrated) on a thread that ends: the scheduler thread is then the one that computes
    model, tokenizer = passing_thread(load_from_args, args).result()
    app = create_app(model, tokenizer, config=cfg, model_name=settings.served_model_name or served_name(args.model),
                     max_batch_size=settings.max_batch_size, max_queue=settings.max_queue, api_key=settings.api_key,
                     cors_origins=settings.cors_origin, request_timeout=settings.request_timeout,
                     prefix_cache_mb=settings.prefix_cache_mb)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                            timeout_graceful_shutdown=FLUSH_SECONDS)
    server = GracefulServer(config, app.state.server.scheduler, grace=settings.shutdown_grace)
    server.run()
    return 0 if server.started else 1


def show_server_log(level: str) -> None:
    """The server's own log lines (start-up, shutdown, faults) on stderr, formatted as uvicorn's."""
    import logging

    from uvicorn.logging import DefaultFormatter

    log = logging.getLogger("refusion.serve")
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        log.addHandler(handler)
    log.setLevel(level.upper())


def main(argv: list[str] | None = None) -> int:
    """`python -m refusion.serve.cli [flags]`: the same as `refusion serve [flags]`."""
    import sys

    parser = argparse.ArgumentParser(prog="refusion")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"refusion serve: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # fastapi, uvicorn, prometheus-client: the serve extra
        from refusion.cli import missing_extra

        if missing_extra(e) is None:
            raise
        print(f"refusion serve: error: {missing_extra(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
