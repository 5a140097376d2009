"""refusion's plan and infill against the authors' own script (`generate.py` of the public ML-GSAI/ReFusion
repository), on the same random Qwen3 weights and prompts, on the CPU.

The authors' code needs the transformers it was released with (4.52), refusion needs 5.x, so the script runs in a
second interpreter of its own (`--authors-python`, a venv with torch and transformers==4.52.4) as a worker that
reads one prompt at a time from a pipe; refusion decodes in this process. The two take turns prompt by prompt and
repeat by repeat (never at the same time), each warmed up first, both on the same threads and weights (fp32;
the final norm sharpened so that the thresholds are crossed both ways, as `decode_engine.py` does). Nothing of the
authors' is copied into this repository: point `--authors` at a checkout.

Two refusion rows: the engine decoding the model as transformers builds it (`prepared: false`: what the engine
adds beyond the model's own forwards) and after `refusion.prepare` (its kernels and compact forward). Tokens are
compared with the script's; they are identical by contract unless EOS falls inside a parallel completion, where
the script's known bug drops slots (docs/DECODING.md; the random model rarely ends).

    python -m venv /tmp/authors-venv && /tmp/authors-venv/bin/pip install torch==2.13.0 transformers==4.52.4 \\
        pandas tqdm numpy accelerate==1.8.1
    python benchmarks/against_authors.py --authors CHECKOUT --authors-python /tmp/authors-venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

QWEN3 = dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
             num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=2,
             use_sliding_window=False, sliding_window=None)
"""The random model both sides decode: a ~60M Qwen3 (as the issue's measurement used)."""
MASK_ID = QWEN3["vocab_size"] - 1
PAPER = dict(slot_size=4, block_size=16, slot_threshold=0.6, token_threshold=0.3)
"""The paper's demo setting (k, b, tau_slot, tau_token); the script's `serial_num_blocks` is gen_length / b."""


def worker(authors: str, weights: str, threads: int) -> None:
    """The authors' side: load their Qwen3 with the weights, then answer one JSON line per prompt (on a copy of
    stdout of its own: whatever the script prints goes to stderr)."""
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout = sys.stderr
    torch.set_num_threads(threads)
    sys.path.insert(0, authors)
    from generate import generate_refusion  # the authors' script
    from qwen3.configuration_qwen3 import Qwen3Config
    from qwen3.modeling_qwen3_refusion import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3, mask_token_id=MASK_ID)).eval()
    model.load_state_dict(torch.load(weights), strict=False)
    model.tie_weights()
    tokenizer = type("Tokenizer", (), {"eos_token_id": QWEN3["eos_token_id"]})()
    for line in sys.stdin:
        request = json.loads(line)
        prompt = torch.tensor([request["prompt"]])
        start = time.perf_counter()
        out, _ = generate_refusion(model, tokenizer, prompt, gen_length=request["gen_length"], temperature=0.0,
                                   mask_id=MASK_ID, slot_size=PAPER["slot_size"],
                                   serial_num_blocks=request["gen_length"] // PAPER["block_size"],
                                   slot_threshold=PAPER["slot_threshold"], token_threshold=PAPER["token_threshold"])
        seconds = time.perf_counter() - start
        print(json.dumps({"tokens": out[0, prompt.shape[1]:].tolist(), "seconds": seconds}), file=replies, flush=True)


def build_model(seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(**QWEN3)
    config.mask_token_id = MASK_ID
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.norm.weight.mul_(30.0)
    return model


def until_eos(tokens: list[int]) -> list[int]:
    """The response up to and including the first EOS; the rest (the script's unfilled masks) dropped."""
    eos = QWEN3["eos_token_id"]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else [t for t in tokens if t != MASK_ID]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--authors", required=True, help="a checkout of ML-GSAI/ReFusion (its generate.py, qwen3/)")
    parser.add_argument("--authors-python", help="an interpreter with transformers==4.52.4 (required)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--gen-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--weights", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.authors, args.weights, args.threads)
    if not args.authors_python:
        raise SystemExit("against_authors: error: --authors-python is required (a venv with transformers==4.52.4)")
    if not (Path(args.authors) / "generate.py").is_file():
        raise SystemExit(f"against_authors: error: {args.authors} has no generate.py (a checkout of ML-GSAI/ReFusion)")
    if args.gen_length % PAPER["block_size"]:
        raise SystemExit(f"against_authors: error: --gen-length must be a multiple of {PAPER['block_size']}")

    from harness import cpu_name  # here, not at the top: the worker runs in the authors' interpreter

    import refusion

    torch.set_num_threads(args.threads)
    model = build_model()
    prepared = build_model()
    refusion.prepare(prepared)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, MASK_ID - 1, (int(n),), generator=generator).tolist()
               for n in torch.randint(24, 64, (args.prompts,), generator=generator)]
    cfg = refusion.DecodeConfig(max_new_tokens=args.gen_length, **PAPER)

    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "weights.pt")
        torch.save(model.state_dict(), weights)
        authors = subprocess.Popen([args.authors_python, __file__, "--worker", "--authors", args.authors,
                                    "--weights", weights, "--threads", str(args.threads)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def run_authors(prompt: list[int], gen_length: int) -> dict:
            authors.stdin.write(json.dumps({"prompt": prompt, "gen_length": gen_length}) + "\n")
            authors.stdin.flush()
            line = authors.stdout.readline()
            if not line:
                raise SystemExit("against_authors: error: the authors' worker stopped (its error is above)")
            return json.loads(line)

        def run_refusion(m, prompt: list[int], gen_length: int) -> dict:
            out = refusion.generate(m, [prompt], cfg.replace(max_new_tokens=gen_length))
            return {"tokens": out.sequences[0], "seconds": out.stats.batch.seconds,
                    "forwards": out.stats.batch.forwards}

        sides = {"authors": lambda p, n: run_authors(p, n), "refusion": lambda p, n: run_refusion(model, p, n),
                 "refusion_prepared": lambda p, n: run_refusion(prepared, p, n)}
        for run in sides.values():  # warm-up: kernels choose their code, the worker loads
            run(prompts[0], PAPER["block_size"])
        seconds = {name: [0.0] * len(prompts) for name in sides}
        answers = {name: [None] * len(prompts) for name in sides}
        forwards = {name: 0 for name in sides if name != "authors"}
        for _ in range(args.repeats):
            for i, prompt in enumerate(prompts):  # prompt by prompt, the sides in turns
                for name, run in sides.items():
                    time.sleep(0.3)  # the other side's threads stop spinning
                    result = run(prompt, args.gen_length)
                    best = seconds[name][i]
                    seconds[name][i] = result["seconds"] if best == 0.0 else min(best, result["seconds"])
                    answers[name][i] = until_eos(result["tokens"])
                    if name in forwards and _ == 0:
                        forwards[name] += result["forwards"]
        authors.stdin.close()
        authors.wait()

    tokens = {name: sum(len(a) for a in answers[name]) for name in sides}
    total = {name: sum(s) for name, s in seconds.items()}
    summary = {
        "benchmark": "against_authors", "model": "random Qwen3, ~60M", "dtype": "float32", "prompts": len(prompts),
        "gen_length": args.gen_length, "settings": PAPER, "threads": args.threads, "torch": torch.__version__,
        "machine": platform.machine(), "cpu": cpu_name(), "repeats": args.repeats,
        "tokens": tokens, "seconds": total, "refusion_forwards": forwards,
        "tokens_per_second": {name: tokens[name] / total[name] for name in sides},
        "identical_to_authors": {name: sum(a == b for a, b in zip(answers[name], answers["authors"]))
                                 for name in sides if name != "authors"},
        "speedup_over_authors": {name: (tokens[name] / total[name]) / (tokens["authors"] / total["authors"])
                                 for name in sides if name != "authors"},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    print(json.dumps(summary))



if __name__ == "__main__":
    main()
