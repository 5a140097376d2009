"""The embedded model's products by its GGUF blocks in fp32 (`--linear int4`, `csrc/block_products.cpp`), by width.

For each width (rows of a decoding forward), back to back: the decoder layers' block products as one forward calls
them (fused q/k/v and gate/up, lone o and down), the Q8_0 LM head, each with fp32 rows ("int4") and with rows rounded
to 8-bit blocks ("int4-q8", `_int8_rows_ms`), and, as the machine's memory-bound reference, an
fp32 product over a weight of the head's shape (F.linear reading 4 bytes a weight). Reported: milliseconds (fastest
of `--repeats`) and the bytes of blocks and scales each product reads per second. Ends with one JSON line.

    python benchmarks/block_products.py [--widths 1,2,4,8,16,64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from harness import conditions, cpu_name

import refusion
from refusion.model.compact import compact_forward
from refusion.model.kernels.int4 import GROUP, Int4Linear, block_product


def fastest(run, repeats: int) -> float:
    run()  # untimed: caches and threads warm
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return min(seconds)


def time_width(width: int, products: list, layer_bytes: int, head, head_bytes: int, dense: torch.Tensor,
               repeats: int) -> dict:
    """One width's row: the layers' products, the head, and the fp32 reference, each the fastest of `repeats`."""
    inputs = [torch.randn(width, dm.shape[1] * GROUP) for _, dm in products]  # dm: [N, K / GROUP, 2]
    x = torch.randn(width, head.in_features)

    def layers(int8_rows: bool):
        for (q, dm), rows in zip(products, inputs):
            block_product(rows, q, dm, None, int8_rows=int8_rows)

    def head_product(int8_rows: bool):
        block_product(x, head._buffers["int4_weight"], head._buffers["int4_scales"], None, head.tail(), int8_rows)

    layer_s = fastest(lambda: layers(False), repeats)
    layer_q8_s = fastest(lambda: layers(True), repeats)
    head_s = fastest(lambda: head_product(False), repeats)
    head_q8_s = fastest(lambda: head_product(True), repeats)
    dense_s = fastest(lambda: x @ dense.t(), repeats)
    return {"width": width, "layers_ms": round(layer_s * 1e3, 2), "layers_gb_s": round(layer_bytes / layer_s / 1e9, 1),
            "layers_int8_rows_ms": round(layer_q8_s * 1e3, 2), "head_ms": round(head_s * 1e3, 2),
            "head_gb_s": round(head_bytes / head_s / 1e9, 1), "head_int8_rows_ms": round(head_q8_s * 1e3, 2),
            "fp32_head_ms": round(dense_s * 1e3, 2), "fp32_head_gb_s": round(dense.numel() * 4 / dense_s / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="1,2,4,8,16,64")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
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
        rows.append(time_width(width, products, layer_bytes, head, head_bytes, dense, args.repeats))
        print(rows[-1], flush=True)
    print(json.dumps({"benchmark": "block_products", "cpu": cpu_name(), **conditions(), "layer_products": len(products),
                      "layer_mb": round(layer_bytes / 1e6, 1), "head_mb": round(head_bytes / 1e6, 1), "rows": rows}))


if __name__ == "__main__":
    main()
