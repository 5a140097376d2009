"""Compiled forwards against eager ones on a real model, in one run: what `compile=True` costs and buys here.

Loads a model (default: the embedded one, as `refusion.load()` prepares it on this machine), then for each mode (AR
and the model's preset) decodes every prompt once compiled to compile the graphs it needs (timed: what a first
request pays), then decodes every prompt eager and compiled back to back. Reports per mode: the compile pass's
seconds and graphs, tokens/s eager and compiled, graphs compiled while timing, and how many compiled answers equal
the eager ones. Prompts: the first `--per-group` of each untouched group of `benchmarks/linear_kernels.py`
(GSM8K test 401+, ARC-Challenge test 301+, MBPP 311+, held-out open-ended and copy-heavy requests). Ends with one
JSON line.

    python benchmarks/compiled.py [--per-group 1] [--max-new-tokens 128] [--model M] [--modes ar,preset]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from refusion.config import layered_config
from refusion.decode.loop import generate
from refusion.model.compiled import compile_model
from refusion.model.embedded import default_decode_settings
from refusion.model.loading import encode_prompts, load
from refusion.model.setup import setup_of


def prompt_groups(per_group: int) -> dict[str, list[str]]:
    """linear_kernels.py's untouched prompt groups (one home for them)."""
    spec = importlib.util.spec_from_file_location("linear_kernels", Path(__file__).with_name("linear_kernels.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.prompt_groups(per_group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-group", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--modes", default="ar,preset")
    args = parser.parse_args()

    model, tokenizer = load(args.model)
    eager = setup_of(model)
    compiled = eager.replace(compiled=compile_model(model))
    preset = layered_config(default_decode_settings(), explicit={"max_new_tokens": args.max_new_tokens})
    configs = {"ar": preset.for_strategy("autoregressive"), "preset": preset}
    prompts = [encode_prompts(tokenizer, text) for texts in prompt_groups(args.per_group).values() for text in texts]
    results = {}
    for mode in args.modes.split(","):
        cfg = configs[mode]
        counters["stats"].clear()
        start = time.perf_counter()
        for ids in prompts:
            generate(model, ids, cfg, setup=compiled)
        compile_seconds, graphs = time.perf_counter() - start, counters["stats"]["unique_graphs"]
        totals = {"eager": [0, 0.0], "compiled": [0, 0.0]}
        identical = 0
        for ids in prompts:  # back to back, prompt by prompt
            outputs = {}
            for name, setup in (("eager", eager), ("compiled", compiled)):
                out = generate(model, ids, cfg, setup=setup)
                totals[name][0] += out.stats.batch.tokens
                totals[name][1] += out.stats.batch.seconds
                outputs[name] = out.sequences[0]
            identical += outputs["eager"] == outputs["compiled"]
        speed = {name: tokens / seconds for name, (tokens, seconds) in totals.items()}
        results[mode] = {"compile_pass_seconds": round(compile_seconds, 1), "graphs": graphs,
                         "graphs_compiled_while_timing": counters["stats"]["unique_graphs"] - graphs,
                         "eager_tokens_per_second": round(speed["eager"], 2),
                         "compiled_tokens_per_second": round(speed["compiled"], 2),
                         "compiled_over_eager": round(speed["compiled"] / speed["eager"], 3),
                         "identical": f"{identical}/{len(prompts)}"}
        print(mode, json.dumps(results[mode]), flush=True)
    print(json.dumps({"benchmark": "compiled", "model": args.model or "embedded", "setup": eager.describe(),
                      "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
                      "threads": torch.get_num_threads(), "machine": platform.machine(), "results": results,
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S")}))


if __name__ == "__main__":
    main()
