"""The embedded model's products by its GGUF blocks in fp32 (`--linear int4`, `csrc/block_products.cpp`), by width.

For each width (rows of a decoding forward), back to back: the decoder layers' block products as one forward calls
them (fused q/k/v and gate/up, lone o and down), the Q8_0 LM head, each with fp32 rows ("int4") and with rows rounded
to 8-bit blocks ("int4-q8", `_int8_rows_ms`), and, as the machine's memory-bound reference, an
fp32 product over a weight of the head's shape (F.linear reading 4 bytes a weight). Reported: milliseconds (fastest
of `--repeats`) and the bytes of blocks and scales each product reads per second. Ends with one JSON line.

`--then TREE` (an earlier checkout, e.g. a `git worktree`) builds that tree's `csrc/` as a second extension beside
this one's and times both kernels on the same blocks and rows, taking turns repeat by repeat, so a drift of the
machine touches both alike: each quantity gains a `then_` twin and the ratio this tree / that one.

    python benchmarks/block_products.py [--widths 1,2,4,8,16,64] [--repeats 5] [--then /tmp/then]
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
from harness import conditions, cpu_name

import refusion
from refusion.model.compact import compact_forward
from refusion.model.kernels.extension import CFLAGS, CSRC, OPENMP, SOURCES, source_tag
from refusion.model.kernels.int4 import GROUP, Int4Linear, block_product


def fastest(run, repeats: int) -> float:
    run()  # untimed: caches and threads warm
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def fastest_in_turns(runs: list, repeats: int) -> list[float]:
    """The fastest of `repeats` of each run, the runs taking turns (their order reversed every repeat)."""
    for run in runs:
        run()
    seconds = [[] for _ in runs]
    for repeat in range(repeats):
        order = range(len(runs)) if repeat % 2 == 0 else reversed(range(len(runs)))
        for i in order:
            start = time.perf_counter()
            runs[i]()
            seconds[i].append(time.perf_counter() - start)
    return [min(s) for s in seconds]


def earlier_csrc(tree: Path) -> Path:
    """The extension's folder in an earlier checkout of this repository (where it is in this one)."""
    return tree / "src" / CSRC.relative_to(Path(refusion.__file__).parents[1])


def earlier_extension(tree: Path):
    """The extension of an earlier checkout's `csrc/`, built (once per source, in torch's extension directory) as a
    module of another name, so it loads beside this tree's."""
    from torch.utils import cpp_extension

    csrc = earlier_csrc(tree)
    name = "refusion_native_then"
    directory = Path(cpp_extension._get_build_directory(name, verbose=False)) / source_tag(csrc)
    directory.mkdir(parents=True, exist_ok=True)
    return cpp_extension.load(name, [str(csrc / path.name) for path in SOURCES], extra_cflags=list(CFLAGS),
                              extra_ldflags=list(OPENMP), build_directory=str(directory), verbose=False)


def time_width(width: int, products: list, layer_bytes: int, head, head_bytes: int, dense: torch.Tensor,
               repeats: int, then=None) -> dict:
    """One width's row: the layers' products, the head, and the fp32 reference, each the fastest of `repeats`
    (with `then`, an earlier extension's `block_linear` timed in turns with this tree's)."""
    inputs = [torch.randn(width, dm.shape[1] * GROUP) for _, dm in products]  # dm: [N, K / GROUP, 2]
    x = torch.randn(width, head.in_features)
    head_q, head_dm, tail = head._buffers["int4_weight"], head._buffers["int4_scales"], head.tail()

    def layers(int8_rows: bool, linear):
        for (q, dm), rows in zip(products, inputs):
            linear(rows, q, dm, None, None, int8_rows)

    def head_product(int8_rows: bool, linear):
        linear(x, head_q, head_dm, tail, None, int8_rows)

    now = lambda x, q, dm, tail, bias, int8_rows: block_product(x, q, dm, bias, tail, int8_rows)  # noqa: E731
    linears = [now] if then is None else [now, then.block_linear]
    row = {"width": width}
    for name, product in (("layers", layers), ("head", head_product)):
        for suffix, int8_rows in (("_ms", False), ("_int8_rows_ms", True)):
            runs = [functools.partial(product, int8_rows, linear) for linear in linears]
            seconds = fastest_in_turns(runs, repeats)
            row[name + suffix] = round(seconds[0] * 1e3, 2)
            if then is not None:
                row["then_" + name + suffix] = round(seconds[1] * 1e3, 2)
                row["ratio_" + name + suffix.removesuffix("_ms")] = round(seconds[0] / seconds[1], 3)
            if suffix == "_ms":
                row[name + "_gb_s"] = round((layer_bytes if name == "layers" else head_bytes) / seconds[0] / 1e9, 1)
    dense_s = fastest(lambda: x @ dense.t(), repeats)
    row.update({"fp32_head_ms": round(dense_s * 1e3, 2), "fp32_head_gb_s": round(dense.numel() * 4 / dense_s / 1e9, 1)})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--then", type=Path, help="an earlier checkout whose kernels take turns with this tree's")
    args = parser.parse_args()
    if args.then and not all((earlier_csrc(args.then) / path.name).is_file() for path in SOURCES):
        parser.error(f"--then {args.then}: not a checkout of refusion (no {earlier_csrc(args.then)} with its sources)")
    torch.set_grad_enabled(False)
    then = earlier_extension(args.then) if args.then else None
    model, _ = refusion.load(linear="int4", dtype="float32")
    head = model.lm_head
    products, fused = [], set()  # (blocks, scales) of each product a forward calls; the layers fused into them
    for layer in compact_forward(model).fused:
        for product in layer.values():
            product.refresh()  # the stacked blocks built
            products.append((product.weight, product.scales))
            fused.update(id(m) for m in product.bases)
    products += [(m._buffers["int4_weight"], m._buffers["int4_scales"]) for m in model.modules()
                 if isinstance(m, Int4Linear) and m is not head and id(m) not in fused]
    layer_bytes = sum(q.numel() * q.element_size() + dm.numel() * dm.element_size() for q, dm in products)
    head_q, head_dm = head._buffers["int4_weight"], head._buffers["int4_scales"]
    head_bytes = head_q.numel() * head_q.element_size() + head_dm.numel() * head_dm.element_size()
    dense = torch.randn(head.out_features, head.in_features)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        rows.append(time_width(width, products, layer_bytes, head, head_bytes, dense, args.repeats, then))
        print(rows[-1], flush=True)
    print(json.dumps({"benchmark": "block_products", "cpu": cpu_name(), **conditions(),
                      "then": str(args.then) if args.then else None, "layer_products": len(products),
                      "layer_mb": round(layer_bytes / 1e6, 1), "head_mb": round(head_bytes / 1e6, 1), "rows": rows}))


if __name__ == "__main__":
    main()
