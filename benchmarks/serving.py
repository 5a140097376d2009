"""Serving benchmark in the manner of vLLM's `benchmark_serving`: concurrent streaming clients against an
OpenAI-compatible endpoint, natural-length answers to held-out prompts; output tokens/s, TTFT, inter-token latency.

Three servers on the same cores, one at a time: `refusion serve` on the embedded model, asked per request for its
preset (the exact mode) and for AR decoding (`"refusion": {"strategy": "autoregressive"}`, the same server), and
llama.cpp's `llama-server` on the base model's own GGUF file (`--llama-server BIN`; weights repacked as it does by
default, `-np` slots as many as refusion's batch rows; `--llama-no-repack` where repacking dies). At each concurrency (`--clients`, default 1, 4,
16, 64), every client sends requests from a shared queue of prompts until `--requests` (default: max(2 x clients,
12)) are answered; at each level the refusion variants and then llama-server take their turns (the refusion server
stays up, idle, while llama-server runs), so that the machine's drift between levels hits every server alike;
`--rounds N` repeats those turns N times at each level and keeps each server's fastest round (every round's tokens/s
beside it), which tells a server's own gap from the drift between two windows.
Every server (each llama-server start, each refusion variant) is first warmed on `--warm-up` (12) requests at one
client over the last prompts: a refusion server's first pass over new prompts ran ~8 % slower than its later ones.
Answers end at EOS or `--max-tokens`. Every level resends the same prompts, which a prompt cache answers from memory
after their first pass, so by default neither server keeps one: the refusion server runs with `--prefix-cache-mb 0`
and every request to llama-server says `"cache_prompt": false` (its slots otherwise reuse the KV of the prompt they
last held: a resent prompt, or the chat template's system turn, is not prefilled again). Each request then prefills
its whole prompt on both, as a new user's would. `--prompt-caches` keeps both servers' caches as they come (refusion
serve's default prefix cache, llama-server's `cache_prompt`), and then each refusion variant takes each turn on a
fresh server, warmed up first, as each llama-server turn is (one server's cache would carry a variant's prompts into
the next one's turn). Every level reports the prompt tokens each server read from its cache
(`usage.prompt_tokens_details.cached_tokens`, which both report). The prefix cache has its own workloads below.

Prompts (`held_out_prompts`): GSM8K test from example 601, ARC-Challenge test from 401 and MBPP test ids from 411
in `refusion eval`'s formats, with near-twins of the draft table's data (`refusion.eval.twins`) left out, and
`FRESH_REQUESTS`, open-ended requests written for this benchmark: none was used to choose a setting or to train.

    python benchmarks/serving.py [--clients 1,4,16,64] [--llama-server PATH/llama-server] [--max-tokens 128]
                                 [--prompt-caches]

Two prefix-cache workloads (`--workload`), each against two servers in turn, with the prefix cache
(`--prefix-cache-mb`, the default) and without it (0), on the same model (`--model`: the embedded one by default,
`tiny` for the random test model, mechanics only):

* `chat`: `--conversations` (16) chats of `--turns` (8) turns, all at once; each turn resends the whole
  conversation (the user's messages are the held-out prompts, the answers the server's own). Reports time to first
  token per turn (p50, p90 over the conversations) and the prefix cache's hits.
* `system-prompt`: `--requests` (default 32) held-out questions behind one shared system prompt of about
  `--system-tokens` (1,000) tokens, `--concurrency` (4) clients. Reports TTFT p50 with and without the cache.

    python benchmarks/serving.py --workload chat [--conversations 16] [--turns 8] [--max-tokens 128]
    python benchmarks/serving.py --workload system-prompt [--system-tokens 1000] [--requests 32]

`--cached-only` runs the server with the cache alone (its TTFT by turn, no ratio).

With `--then TREE` (a checkout of an earlier commit: `git worktree add TREE COMMIT`), a prefix-cache workload runs
against this tree's server and TREE's, both with the cache, taking turns `--rounds` times (default 2): TTFT by turn of each,
the earlier over this one (each turn's fastest p50), and each tree's last turn over its first.

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from harness import cpu_name, exit_on_sigterm
from serve_load import MAX_SECONDS, free_port, model_path, percentiles

FRESH_REQUESTS = (
    "Describe what a city sounds like at five in the morning.",
    "Explain how a zipper works.",
    "Write a short letter thanking a neighbour for watering my plants.",
    "What should I bring on a day hike? Answer as a list.",
    "Summarise the rules of chess in one paragraph.",
    "Write a limerick about a forgetful wizard.",
    "Why do cats purr? Give a short answer.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Explain the difference between weather and climate.",
    "Write a two-sentence horror story set in a kitchen.",
    "How do noise-cancelling headphones work?",
    "Describe the taste of a lemon to someone who has never had one.",
)
"""Open-ended requests written for this benchmark (none in any training set, none used to choose a setting)."""
SERVED_NAME = "bench"
"""The model name the refusion server is started with (`--served-model-name`) and every request asks for."""
TASK_SLICES = (("gsm8k", 600), ("arc_challenge", 400), ("mbpp", 400))
"""(task, examples skipped): the parts of each test set no decision or training has touched (docs/BENCHMARKS.md)."""


def held_out_prompts(per_task: int) -> list[str]:
    """`per_task` prompts of each task slice (twins of the draft table's data left out) and FRESH_REQUESTS, interleaved."""
    from refusion.eval.tasks import load_examples
    from refusion.eval.twins import TwinIndex, read_queries, without_twins

    root = Path(__file__).resolve().parents[1]
    index = TwinIndex(read_queries(sorted(glob.glob(str(root / "recipes" / "data" / "*.jsonl.gz")))))
    groups = []
    for task, skip in TASK_SLICES:
        examples = load_examples(task)[skip: skip + 4 * per_task]
        kept, _ = without_twins(examples, lambda e: e.prompt, index)
        groups.append([e.prompt for e in kept[:per_task]])
    groups.append(list(FRESH_REQUESTS))
    return [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]  # round robin


# ------------------------------------------------------------------------------------------ servers
def wait_healthy(proc: subprocess.Popen, url: str, what: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"serving: error: {what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"serving: error: {what} did not become healthy in 300 s")


def start_refusion(port: int, slots: int, threads: int | None, extra: tuple[str, ...] = (),
                   tree: str | None = None) -> subprocess.Popen:
    """`refusion serve` on `port`; `extra`: more flags (--model, --prefix-cache-mb); `tree`: another checkout whose
    code serves (its `src` first on PYTHONPATH; None: this one's)."""
    cmd = ["refusion", "serve", "--port", str(port), "--max-batch-size", str(slots), "--max-queue", "512",
           "--log-level", "warning", "--served-model-name", SERVED_NAME, *extra]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = None if tree is None else {**os.environ, "PYTHONPATH": str(Path(tree).resolve() / "src")}
    proc = subprocess.Popen(cmd, env=env)
    wait_healthy(proc, f"http://127.0.0.1:{port}/health", "refusion serve")
    return proc


def start_llama(binary: str, port: int, slots: int, threads: int, context: int, spec: str,
                repack: bool = True) -> subprocess.Popen:
    from refusion.model.loading import smollm2_gguf_path

    cmd = [binary, "-m", str(smollm2_gguf_path()), "--port", str(port), "-t", str(threads), "-np", str(slots),
           "-c", str(context * slots), "--temp", "0", "--log-disable", "--spec-type", spec]
    if not repack:  # llama.cpp's weight repacking dies with SIGILL on some CPUs (an AMX Xeon here)
        cmd.append("--no-repack")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(proc, f"http://127.0.0.1:{port}/health", "llama-server")
    return proc


def warm_up(base: str, prompts: list[str], requests: int, max_tokens: int, extra: dict) -> None:
    """`requests` requests at one client over the last prompts of the list (the levels start from the first): a
    server's first pass over new prompts ran slower than its later ones (the refusion server's first pass of 12
    requests: 57.3 tokens/s, then 61.9 and 63.1, on E5), so every server is timed warm."""
    warm = prompts[-requests:] if requests else prompts[:1]
    asyncio.run(run_level(base, warm, 1, max(requests, 1), max_tokens if requests else 16, extra))


def warm_turn(args, base: str, name: str, extra: dict, prompts: list[str], clients: int, requests: int) -> dict:
    """A fresh server's turn at a level: warmed up on `--warm-up` requests, then the level (its line printed)."""
    warm_up(base, prompts, args.warm_up, args.max_tokens, extra)
    return show(name, asyncio.run(run_level(base, prompts, clients, requests, args.max_tokens, extra)))


def llama_level(args, name: str, spec: str, prompts: list[str], clients: int, requests: int) -> dict:
    """One level against a fresh llama-server (`spec`: its speculation), warmed up first; its prompt cache off
    unless `--prompt-caches`."""
    port = free_port()
    llama = start_llama(args.llama_server, port, args.slots, args.llama_threads, 2048, spec, not args.llama_no_repack)
    extra = {} if args.prompt_caches else {"cache_prompt": False}
    try:
        return warm_turn(args, f"http://127.0.0.1:{port}", name, extra, prompts, clients, requests)
    finally:
        llama.terminate()
        llama.wait()


def refusion_turn(args, weights: tuple[str, ...], name: str, extra: dict, prompts: list[str], clients: int,
                  requests: int) -> dict:
    """One variant's turn at a level on a fresh refusion server with its prefix cache (`--prompt-caches`), warmed up
    first: its cache holds the warm-up's prompts and the turn's own, as a fresh llama-server's slots do."""
    port = free_port()
    server = start_refusion(port, args.slots, args.threads, weights)
    try:
        return warm_turn(args, f"http://127.0.0.1:{port}", name, extra, prompts, clients, requests)
    finally:
        server.terminate()
        server.wait()


# ------------------------------------------------------------------------------------------ clients
async def one_request(client: httpx.AsyncClient, url: str, prompt: str | list[dict], max_tokens: int,
                      extra: dict) -> dict:
    """Stream one chat completion of a user message (or of a whole conversation's messages): time to the first
    text, each later text's arrival, tokens, prompt tokens (and those read from the server's prompt cache), and the
    answer's text."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    body = {"model": SERVED_NAME, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    start = time.perf_counter()
    arrivals, tokens, chunks, prompt_tokens, cached, text = [], 0, 0, 0, 0, []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            deltas = [c.get("delta", {}).get("content") for c in chunk.get("choices", [])]
            if any(deltas):
                arrivals.append(time.perf_counter() - start)
                chunks += 1
                text += [d for d in deltas if d]
            if chunk.get("usage"):
                tokens, prompt_tokens = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    latency = time.perf_counter() - start
    tokens = tokens or chunks
    ttft = arrivals[0] if arrivals else latency
    return {"ttft": ttft, "latency": latency, "tokens": tokens, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached, "text": "".join(text),
            "itl": (latency - ttft) / (tokens - 1) if tokens > 1 else 0.0}


async def run_level(base: str, prompts: list[str], clients: int, requests: int, max_tokens: int,
                    extra: dict) -> dict:
    url = f"{base}/v1/chat/completions"
    queue = list(range(requests))
    results: list[dict] = []
    # a connection per request: llama-server closes idle kept-alive connections, and a request sent on one fails
    limits = httpx.Limits(max_connections=clients + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(MAX_SECONDS), limits=limits) as client:

        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                results.append(await one_request(client, url, prompts[i % len(prompts)], max_tokens, extra))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "seconds": wall, "tokens": tokens,
            "output_tokens_per_second": tokens / wall, "mean_tokens": statistics.mean(r["tokens"] for r in results),
            "prompt_tokens": sum(r["prompt_tokens"] for r in results),
            "cached_prompt_tokens": sum(r["cached_tokens"] for r in results),
            "ttft": percentiles([r["ttft"] for r in results]), "itl": percentiles([r["itl"] for r in results])}


def show(name: str, r: dict) -> dict:
    """Print one level's line as it is measured; returns the level."""
    print(f"{name:15s} clients {r['clients']:3d}: {r['output_tokens_per_second']:7.1f} tokens/s, "
          f"TTFT p50 {r['ttft']['p50']:.2f} s, ITL p50 {1000 * r['itl']['p50']:.1f} ms, prompt tokens cached "
          f"{r['cached_prompt_tokens']} of {r['prompt_tokens']}", flush=True)
    return r


def against_library(base: str, prompts: list[str], requests: int, max_tokens: int, threads: int | None,
                    linear: str = "auto", dtype: str | None = None) -> dict:
    """The server's preset at one client against `refusion.generate` in this process (the preset, batch 1) on the
    same requests, taking turns request by request (the server idle while the library decodes, and the other way
    round), each warmed up first: tokens/s of each over its own requests' wall time."""
    import torch

    import refusion

    if threads is not None:
        torch.set_num_threads(threads)
    model, tokenizer = refusion.load(dtype=dtype, linear=linear)  # the server's weights
    refusion.generate(model, refusion.encode_prompts(tokenizer, prompts[:1]), max_new_tokens=16)  # warm-up
    server = {"tokens": 0, "seconds": 0.0}
    library = {"tokens": 0, "seconds": 0.0}
    for i in range(requests):
        prompt = prompts[i % len(prompts)]
        level = asyncio.run(run_level(base, [prompt], 1, 1, max_tokens, {}))
        server["tokens"] += level["tokens"]
        server["seconds"] += level["seconds"]
        start = time.perf_counter()
        out = refusion.generate(model, refusion.encode_prompts(tokenizer, [prompt]), max_new_tokens=max_tokens)
        library["seconds"] += time.perf_counter() - start
        library["tokens"] += out.stats.batch.tokens
    for side in (server, library):
        side["output_tokens_per_second"] = side["tokens"] / side["seconds"]
    return {"requests": requests, "server": server, "library": library, "threads": torch.get_num_threads(),
            "server_over_library": server["output_tokens_per_second"] / library["output_tokens_per_second"]}


# ------------------------------------------------------------------------------------------ prefix-cache workloads
SYSTEM_RULES = (
    "Answer the question that follows as a careful, friendly assistant.",
    "Prefer short sentences and plain words; explain any technical term the first time it appears.",
    "When a question has a numeric answer, show the steps that lead to it, then state the result on its own line.",
    "When you are not sure, say so, and say what would settle the question.",
    "Never invent references, quotations, prices or dates.",
    "Use lists only when the answer has several parallel parts.",
    "Keep code in fenced blocks and name the language.",
    "If the question is ambiguous, answer the most likely reading and mention the other one in a sentence.",
)
"""The shared system prompt's rules, numbered and repeated up to its length (`system_prompt`)."""


def system_prompt(tokens: int) -> str:
    """A system prompt of about `tokens` tokens (~4 characters each; the servers report the exact count)."""
    lines, i = [], 0
    while sum(map(len, lines)) < 4 * tokens:
        lines.append(f"Rule {i + 1}. {SYSTEM_RULES[i % len(SYSTEM_RULES)]}\n")
        i += 1
    return "".join(lines)


async def conversation(client: httpx.AsyncClient, url: str, questions: list[str], max_tokens: int) -> list[dict]:
    """One chat, turn after turn, each turn resending the whole conversation: each turn's request."""
    messages, turns = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        result = await one_request(client, url, list(messages), max_tokens, {})
        messages.append({"role": "assistant", "content": result["text"]})
        turns.append(result)
    return turns


async def run_chats(base: str, prompts: list[str], conversations: int, turns: int, max_tokens: int) -> dict:
    """`conversations` chats at once (conversation c asks prompts c, c + 1, ...): TTFT by turn."""
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=conversations + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(MAX_SECONDS), limits=limits) as client:
        start = time.perf_counter()
        chats = await asyncio.gather(*(conversation(client, url, [prompts[(c + t) % len(prompts)]
                                                                  for t in range(turns)], max_tokens)
                                       for c in range(conversations)))
        wall = time.perf_counter() - start
    by_turn = [[chat[t] for chat in chats] for t in range(turns)]
    return {"conversations": conversations, "turns": turns, "seconds": wall,
            "ttft_by_turn": [percentiles([r["ttft"] for r in rs]) for rs in by_turn],
            "prompt_tokens_by_turn": [statistics.mean(r["prompt_tokens"] for r in rs) for rs in by_turn]}


async def run_system_prompt(base: str, system: str, questions: list[str], concurrency: int,
                            max_tokens: int) -> dict:
    """Every question behind the same system prompt, `concurrency` clients: TTFT percentiles."""
    url = f"{base}/v1/chat/completions"
    queue, results = list(questions), []
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(MAX_SECONDS), limits=limits) as client:

        async def worker() -> None:
            while queue:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": queue.pop(0)}]
                results.append(await one_request(client, url, messages, max_tokens, {}))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"requests": len(results), "concurrency": concurrency,
            "prompt_tokens": statistics.mean(r["prompt_tokens"] for r in results),
            "ttft": percentiles([r["ttft"] for r in results])}


def prefix_counters(base: str) -> dict[str, float]:
    """The server's prefix-cache counters (queries and hits, in prompt tokens) from /metrics."""
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {name: float(line.split()[-1]) for line in lines for name in ("queries", "hits")
            if line.startswith(f"refusion_prefix_cache_{name}_total ")}


def prefix_workload(args, prompts: list[str]) -> dict:
    """The workload against a server with the prefix cache and one without, in turn (`--then`: this tree's server
    and an earlier tree's, both with the cache, taking turns `--rounds` times): each one's results (a list of them,
    one per round, with `--then`)."""
    results = {}
    servers = ([("now", args.prefix_cache_mb, None), ("then", args.prefix_cache_mb, args.then)] * (args.rounds or 2)
               if args.then else [("prefix_cache", args.prefix_cache_mb, None),
                                  *([] if args.cached_only else [("no_prefix_cache", 0, None)])])
    with tempfile.TemporaryDirectory() as workdir:
        model = ("--model", model_path(args.model, workdir)) if args.model else ()
        for name, megabytes, tree in servers:
            port = free_port()
            server = start_refusion(port, args.slots, args.threads,
                                    (*model, "--prefix-cache-mb", str(megabytes)), tree)
            base = f"http://127.0.0.1:{port}"
            try:
                asyncio.run(run_level(base, prompts, 1, 1, 16, {}))  # warm-up (another prompt: nothing shared)
                if args.workload == "chat":
                    result = asyncio.run(run_chats(base, prompts, args.conversations, args.turns, args.max_tokens))
                else:
                    questions = [prompts[i % len(prompts)] for i in range(args.requests or 32)]
                    result = asyncio.run(run_system_prompt(base, system_prompt(args.system_tokens), questions,
                                                           args.concurrency, args.max_tokens))
                result = {**result, "counters": prefix_counters(base)}
                if args.then:
                    results.setdefault(name, []).append(result)
                else:
                    results[name] = result
            finally:
                server.terminate()
                server.wait()
            shown = result.get("ttft") or result["ttft_by_turn"][-1]
            print(f"{args.workload:13s} {name:16s}: TTFT p50 {shown['p50']:.3f} s"
                  + ("" if "ttft" in result else " (last turn)"), flush=True)
    return results


def then_ratios(workload: str, now: list[dict], then: list[dict]) -> dict:
    """TTFT p50 of the earlier tree over this one's (each turn's fastest over the rounds), and for the chat each
    tree's last turn over its first."""
    def best(runs: list[dict]) -> list[float]:
        per_run = [[t["p50"] for t in r["ttft_by_turn"]] if workload == "chat" else [r["ttft"]["p50"]] for r in runs]
        return [min(values) for values in zip(*per_run)]

    a, b = best(now), best(then)
    if workload != "chat":
        return {"ttft_p50_then_over_now": b[0] / a[0]}
    ratios = {f"ttft_p50_turn_{t + 1}_then_over_now": y / x for t, (x, y) in enumerate(zip(a, b))}
    return {**ratios, "now_last_turn_over_first": a[-1] / a[0], "then_last_turn_over_first": b[-1] / b[0]}


def prefix_report(args, prompts: list[str]) -> dict:
    """The JSON report of a prefix-cache workload, with the TTFT ratios (without the cache over with it; `--then`:
    the earlier tree's over this one's)."""
    results = prefix_workload(args, prompts)
    if args.then:
        ratios = then_ratios(args.workload, results["now"], results["then"])
    elif args.cached_only:
        ratios = {}
    elif args.workload == "chat":
        on, off = results["prefix_cache"], results["no_prefix_cache"]
        ratios = {f"ttft_p50_turn_{t + 1}_without_over_with": b["p50"] / a["p50"]
                  for t, (a, b) in enumerate(zip(on["ttft_by_turn"], off["ttft_by_turn"]))}
    else:
        ratios = {"ttft_p50_without_over_with": results["no_prefix_cache"]["ttft"]["p50"]
                  / results["prefix_cache"]["ttft"]["p50"]}
    return {"benchmark": "serving", "workload": args.workload, "model": args.model or "embedded", "then": args.then,
            "max_tokens": args.max_tokens, "slots": args.slots, "threads": args.threads, "linear": args.linear, "dtype": args.dtype,
            "prefix_cache_mb": args.prefix_cache_mb, "cpu": cpu_name(), "results": results, "ratios": ratios,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,4,16,64")
    parser.add_argument("--requests", type=int, default=None, help="per level (default max(2 x clients, 12))")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--per-task", type=int, default=12, help="held-out prompts of each task slice")
    parser.add_argument("--warm-up", type=int, default=12,
                        help="requests each server (and each refusion variant) answers at one client before it is "
                             "timed, over the last prompts (0: one 16-token request)")
    parser.add_argument("--slots", type=int, default=8, help="refusion's --max-batch-size and llama-server's -np")
    parser.add_argument("--threads", type=int, default=None, help="refusion serve --threads (default: its own)")
    parser.add_argument("--linear", default="auto",
                        help="refusion serve --linear (int4: the Q4_1 blocks llama-server multiplies by, the row to "
                             "compare with it; auto: the base model's own weights)")
    parser.add_argument("--dtype", default=None, help="refusion serve --dtype (default: the CPU's; int4 runs fp32 and bf16)")
    parser.add_argument("--library", action="store_true",
                        help="also the server at one client against the preset in this process, request by request")
    parser.add_argument("--llama-server", default=None, help="a llama-server binary (llama.cpp) to compare with")
    parser.add_argument("--llama-threads", type=int, default=os.cpu_count())
    parser.add_argument("--llama-no-repack", action="store_true", help="llama-server --no-repack")
    parser.add_argument("--llama-specs", default="none,ngram-simple",
                        help="llama-server --spec-type of each llama variant (none: plain decoding; ngram-simple: "
                             "its prompt lookup)")
    parser.add_argument("--prompt-caches", action="store_true",
                        help="levels: both servers keep their prompt caches (refusion's prefix cache, llama-server's "
                             "cache_prompt); default: neither, so every request prefills its whole prompt")
    parser.add_argument("--workload", choices=("levels", "chat", "system-prompt"), default="levels",
                        help="levels: the concurrency levels above; chat / system-prompt: a prefix-cache workload, "
                             "with the prefix cache and without it")
    parser.add_argument("--model", default=None, help="prefix-cache workloads: refusion serve --model (tiny: the "
                                                      "random test model; default: the embedded model)")
    parser.add_argument("--prefix-cache-mb", type=int, default=None,
                        help="the cached server's --prefix-cache-mb (default: refusion serve's)")
    parser.add_argument("--conversations", type=int, default=16, help="chat: conversations at once")
    parser.add_argument("--turns", type=int, default=8, help="chat: turns of each conversation")
    parser.add_argument("--system-tokens", type=int, default=1000, help="system-prompt: its length, about")
    parser.add_argument("--concurrency", type=int, default=4, help="system-prompt: clients at once")
    parser.add_argument("--cached-only", action="store_true",
                        help="prefix-cache workloads: the server with the prefix cache alone (no ratios)")
    parser.add_argument("--then", default=None,
                        help="prefix-cache workloads: another checkout (git worktree add TREE COMMIT) whose server "
                             "takes turns with this tree's, both with the prefix cache, instead of the uncached one")
    parser.add_argument("--rounds", type=int, default=None,
                        help="turns each server takes at each level (default 1), or each tree with --then (2)")
    args = parser.parse_args()
    if args.then is not None and not (Path(args.then) / "src" / "refusion").is_dir():
        parser.error(f"--then {args.then}: no src/refusion there (a checkout: git worktree add TREE COMMIT)")
    if args.cached_only and args.then is not None:
        parser.error("--cached-only and --then: --then already runs two servers with the cache")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    exit_on_sigterm()
    levels = [int(c) for c in args.clients.split(",")]
    prompts = held_out_prompts(args.per_task)
    if args.workload != "levels":
        from refusion.serve.settings import PREFIX_CACHE_MB

        args.prefix_cache_mb = args.prefix_cache_mb or PREFIX_CACHE_MB
        print(json.dumps(prefix_report(args, prompts)))
        return
    variants = {"preset": {}, "autoregressive": {"refusion": {"strategy": "autoregressive"}}}
    results: dict[str, list] = {name: [] for name in variants}
    llamas = [("llama_server" if spec == "none" else f"llama_server_{spec}", spec)
              for spec in (args.llama_specs.split(",") if args.llama_server else [])]
    results.update({name: [] for name, _ in llamas})

    port = free_port()
    weights = ("--linear", args.linear, *(("--dtype", args.dtype) if args.dtype else ()))
    # no prefix cache: the levels resend the same prompts, which a cache would answer from memory after their first
    # pass (--prompt-caches: each variant's turn on a fresh server with its cache, `refusion_turn`)
    server = start_refusion(port, args.slots, args.threads, (*weights, "--prefix-cache-mb", "0"))
    base = f"http://127.0.0.1:{port}"
    try:
        info = httpx.get(f"{base}/v1/models", timeout=10).json()
        for extra in variants.values() if not args.prompt_caches else ():
            warm_up(base, prompts, args.warm_up, args.max_tokens, extra)
        for clients in levels:  # every server's turn at a level, one after another (the refusion server idle)
            requests = args.requests or max(2 * clients, 12)
            rounds: dict[str, list[dict]] = {name: [] for name in results}
            for _ in range(args.rounds or 1):
                for name, extra in variants.items():
                    time.sleep(0.5)
                    if args.prompt_caches:
                        rounds[name].append(refusion_turn(args, weights, name, extra, prompts, clients, requests))
                    else:
                        rounds[name].append(show(name, asyncio.run(run_level(base, prompts, clients, requests,
                                                                             args.max_tokens, extra))))
                for name, spec in llamas:
                    rounds[name].append(llama_level(args, name, spec, prompts, clients, requests))
            for name, runs in rounds.items():  # each server's fastest round, the others beside it
                best = max(runs, key=lambda r: r["output_tokens_per_second"])
                results[name].append({**best, "rounds": [r["output_tokens_per_second"] for r in runs]})
        if args.library:
            results["library"] = against_library(base, prompts, args.requests or 12, args.max_tokens, args.threads,
                                                 args.linear, args.dtype)
            print(f"{'library':15s} clients   1: server {results['library']['server']['output_tokens_per_second']:.1f}"
                  f", library {results['library']['library']['output_tokens_per_second']:.1f} tokens/s", flush=True)
    finally:
        server.terminate()
        server.wait()
    ratios = {f"preset_over_ar_at_{r['clients']}": r["output_tokens_per_second"] / a["output_tokens_per_second"]
              for r, a in zip(results["preset"], results["autoregressive"])}
    if args.library:
        ratios["server_over_library_at_1"] = results["library"]["server_over_library"]
    print(json.dumps({"benchmark": "serving", "model": info.get("data", [{}])[0], "prompts": len(prompts),
                      "max_tokens": args.max_tokens, "slots": args.slots, "threads": args.threads, "linear": args.linear, "dtype": args.dtype,
                      "prompt_caches": args.prompt_caches, "cpu": cpu_name(), "results": results, "ratios": ratios,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))



if __name__ == "__main__":
    main()
