"""`refusion serve`: the OpenAI-compatible server (FastAPI + uvicorn, one decoding thread)."""

from __future__ import annotations

import argparse
import os

from refusion.arguments import (
    add_decode_arguments,
    add_model_arguments,
    decode_config_from_args,
    load_from_args,
)

SHUTDOWN_GRACE_SECONDS = 20.0
"""Default of --shutdown-grace: after SIGTERM, accepted requests have this long to finish. With the flush time
of serve/shutdown.py (5 s) it stays under the 30 s that Kubernetes and most supervisors wait before SIGKILL."""


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model behind an OpenAI-compatible API (streaming, dynamic batching)",
        description="Serve /v1/chat/completions, /v1/completions, /v1/models and /health. The decoding flags "
                    "are the defaults of every request; a request overrides them with max_tokens, temperature, "
                    "seed and the extension object \"refusion\": {slot_size, block_size, ...}.")
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--max-batch-size", type=int, default=8,
                   help="most sequences decoded together in one batched forward (default 8)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="most requests waiting for a batch row; more are answered 503 (default 64)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients pass as `model` (default: the --model name, or 'refusion')")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on CPU: one core fewer than the machine has, leaving one to "
                        "the HTTP event loop; oversubscribed cores slow every forward down many times)")
    p.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_SECONDS, metavar="SECONDS",
                   help="on SIGTERM / Ctrl+C: new requests get 503 and the accepted ones have this long to finish "
                        f"before they are ended with an error; then the process exits 0 (default {SHUTDOWN_GRACE_SECONDS:g})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_decode_arguments(p)
    p.set_defaults(func=run)


def served_name(model: str | None) -> str:
    if model is None:
        return "refusion"
    return os.path.basename(os.path.normpath(model)) or model


def set_cpu_threads(model, threads: int | None) -> None:
    """Leave a core to the event loop: torch's spinning worker threads otherwise compete with it."""
    import torch

    if threads is None:
        if next(model.parameters()).device.type != "cpu":
            return
        threads = max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1))
    torch.set_num_threads(threads)


def run(args: argparse.Namespace) -> int:
    if args.max_batch_size < 1:
        raise ValueError(f"--max-batch-size={args.max_batch_size} is invalid: must be >= 1")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue={args.max_queue} is invalid: must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads={args.threads} is invalid: must be >= 1")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port} is invalid: must be in [0, 65535]")
    if not args.shutdown_grace >= 0:
        raise ValueError(f"--shutdown-grace={args.shutdown_grace} is invalid: must be >= 0 seconds")
    import uvicorn

    from refusion.serve.app import create_app
    from refusion.serve.shutdown import FLUSH_SECONDS, GracefulServer

    cfg = decode_config_from_args(args)  # validated before the model loads
    model, tokenizer = load_from_args(args)
    set_cpu_threads(model, args.threads)
    app = create_app(model, tokenizer, config=cfg, model_name=args.served_model_name or served_name(args.model),
                     max_batch_size=args.max_batch_size, max_queue=args.max_queue)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=FLUSH_SECONDS)
    server = GracefulServer(config, app.state.server.scheduler, grace=args.shutdown_grace)
    server.run()
    return 0 if server.started else 1


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
