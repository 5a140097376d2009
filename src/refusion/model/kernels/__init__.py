"""The kernels of a model's forward: what its linear layers multiply by, and the native layer loop that calls them.

One registry (`registry.LINEAR_KERNELS`) names every linear kernel with its class, what it runs on and whether it
computes each row of a forward as it would be alone; nothing else maps a layer's class to a kernel.

* `row_exact`: packed bf16 products (oneDNN, AMX / AVX512-BF16) and exact attention: row-exact forwards.
* `narrow`: weight-major products for the few rows of a decoding forward (fp32 CPUs where they measure faster).
* `sgemm`: fp32 products by MKL-packed weights, F.linear's bits.
* `int4`: products by a GGUF file's blocks (bf16: torch's int4 CPU kernel; fp32: `csrc/block_products.cpp`), and
  `int4-q8`, the same blocks times rows rounded to 8-bit blocks, in integers (llama.cpp's arithmetic).
* `fused`: q/k/v and gate/up as one product each, every member's own bits.
* `gated_lora`: a LoRA adapter acting at `<|mask|>` rows only, and its native row updates.
* `native` + `extension` + `csrc/decoder_layers.cpp`: the compact forward's decoder layers in C++.
* `choice`: which kernel a model gets (`choose_linear_kernel`), from the CPU's features and the probes' record.
"""
