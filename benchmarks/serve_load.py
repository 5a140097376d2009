"""Load benchmark of `refusion serve`: N concurrent streaming clients; throughput, TTFT, latency percentiles.

One server process (started here, on 127.0.0.1 and a free port) serves every variant, so AR and ReFusion
are compared on the same server, model and prompts: the strategy is chosen per request with the extension
object `"refusion": {"strategy": ...}`. Every request streams (SSE) with `ignore_eos`, so each produces
exactly `--max-tokens` tokens whatever the weights. For each concurrency level, each variant runs after one
warm-up request, variants interleaved, `--rounds` times; the best round (highest throughput) is reported
with the median throughput over rounds. Ends with one JSON line.

    PYTHONPATH=src python benchmarks/serve_load.py [--model tiny|PATH|smollm2] [--clients 1,4,8]
        [--requests-per-client 2] [--max-tokens 32] [--strategies autoregressive,refusion]

`--model tiny` (default) saves the random tiny test model to a temporary directory: mechanics only (its
ReFusion drafts are random, so its tokens per forward say nothing about a trained model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
from harness import exit_on_sigterm

PROMPTS = ["What is 2 + 2?", "Write a haiku about the sea.", "Name three prime numbers.",
           "Explain recursion in one sentence.", "What is the capital of France?", "Count from one to ten.",
           "Give me a synonym of happy.", "Why is the sky blue?"]
MAX_SECONDS = 900
"""Hard limit of the whole benchmark (the server is stopped after it)."""


# ------------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_path(model: str, workdir: str) -> str:
    if model != "tiny":
        return model
    from refusion.model.tiny import tiny_model, tiny_tokenizer
    path = os.path.join(workdir, "tiny")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def start_server(path: str, port: int, args) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "refusion.serve.cli", "--model", path, "--port", str(port),
           "--max-batch-size", str(args.max_batch_size), "--max-queue", "256", "--log-level", "warning",
           "--served-model-name", "bench", "--strategy", args.server_strategy, "--dtype", args.dtype,
           "--slot-size", str(args.slot_size), "--block-size", str(args.block_size)]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["src", os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the server did not become healthy in 300 s")


# ------------------------------------------------------------------------------------------ clients
async def one_request(client: httpx.AsyncClient, url: str, prompt: str, strategy: str, max_tokens: int) -> dict:
    """Stream one chat completion; time to first text, latency, tokens, tokens per forward."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True},
            "refusion": {"strategy": strategy, "ignore_eos": True}}
    start = time.perf_counter()
    first = None
    tokens, stats = 0, {}
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk["choices"]:
                if first is None and choice["delta"].get("content"):
                    first = time.perf_counter() - start
                stats = choice.get("refusion", stats)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return {"ttft": first if first is not None else latency, "latency": latency, "tokens": tokens,
            "forwards": stats.get("forwards", 0)}


async def run_load(base: str, strategy: str, clients: int, per_client: int, max_tokens: int) -> dict:
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(MAX_SECONDS), limits=limits) as client:

        async def worker(c: int) -> list[dict]:
            return [await one_request(client, url, PROMPTS[(c * per_client + r) % len(PROMPTS)], strategy,
                                      max_tokens) for r in range(per_client)]

        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(worker(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"strategy": strategy, "clients": clients, "requests": len(results), "seconds": wall,
            "tokens": tokens, "tokens_per_second": tokens / wall, "requests_per_second": len(results) / wall,
            "tokens_per_forward": tokens / max(sum(r["forwards"] for r in results), 1),
            "ttft": percentiles([r["ttft"] for r in results]),
            "latency": percentiles([r["latency"] for r in results])}


def percentiles(values: list[float]) -> dict:
    values = sorted(values)

    def pct(p: float) -> float:
        return values[min(len(values) - 1, round(p / 100 * (len(values) - 1)))]

    return {"p50": pct(50), "p90": pct(90), "p99": pct(99), "max": values[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny (random test model), a model path, or smollm2")
    parser.add_argument("--clients", default="1,4,8", help="comma-separated concurrency levels")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--strategies", default="autoregressive,refusion")
    parser.add_argument("--server-strategy", default=None,
                        help="the server's default strategy (default: the first of --strategies)")
    parser.add_argument("--slot-size", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="the server's torch threads (default: its own)")
    args = parser.parse_args()
    exit_on_sigterm()
    strategies = args.strategies.split(",")
    args.server_strategy = args.server_strategy or strategies[0]
    levels = [int(c) for c in args.clients.split(",")]

    deadline = time.monotonic() + MAX_SECONDS
    with tempfile.TemporaryDirectory() as workdir:
        port = free_port()
        server = start_server(model_path(args.model, workdir), port, args)
        base = f"http://127.0.0.1:{port}"
        try:
            for strategy in strategies:  # warm-up
                asyncio.run(run_load(base, strategy, 1, 1, min(args.max_tokens, 8)))
            results = []
            for clients in levels:
                rounds = {s: [] for s in strategies}
                for _ in range(args.rounds):
                    for strategy in strategies:
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"benchmark exceeded {MAX_SECONDS} s")
                        rounds[strategy].append(asyncio.run(run_load(base, strategy, clients,
                                                                     args.requests_per_client, args.max_tokens)))
                for strategy in strategies:
                    best = max(rounds[strategy], key=lambda r: r["tokens_per_second"])
                    best["median_tokens_per_second"] = statistics.median(r["tokens_per_second"]
                                                                         for r in rounds[strategy])
                    results.append(best)
                    print(f"{strategy:>15} clients={clients:<3} {best['tokens_per_second']:8.1f} tok/s  "
                          f"TPF {best['tokens_per_forward']:.2f}  TTFT p50 {best['ttft']['p50'] * 1000:7.0f} ms  "
                          f"p90 {best['ttft']['p90'] * 1000:7.0f} ms  latency p50 {best['latency']['p50']:.2f} s  "
                          f"p90 {best['latency']['p90']:.2f} s  p99 {best['latency']['p99']:.2f} s",
                          file=sys.stderr)
            health = httpx.get(f"{base}/health", timeout=5).json()
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
    print(json.dumps({"benchmark": "serve_load", "model": args.model, "max_tokens": args.max_tokens,
                      "requests_per_client": args.requests_per_client, "slot_size": args.slot_size,
                      "block_size": args.block_size, "max_batch_size": args.max_batch_size, "dtype": args.dtype,
                      "rounds": args.rounds, "threads": args.threads, "results": results, "server": health,
                      "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                  "python": platform.python_version()}}))


if __name__ == "__main__":
    main()
