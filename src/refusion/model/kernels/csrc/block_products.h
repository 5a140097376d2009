// Products by a GGUF file's weight blocks with fp32 activations (block_products.cpp; refusion/model/kernels/int4.py).
#pragma once

#include <torch/extension.h>

namespace refusion {

// x [..., K] fp32 times the weight [N, K] that `q` and `dm` hold as blocks of 32 weights, w = d * q + m:
// q [N, K / 2] uint8 (4-bit blocks, ggml's order: a block's low nibbles are its weights 0-15, the high ones 16-31)
// or q [N, K] int8 (8-bit blocks); dm [N, K / 32, 2] fp16 (d, m); then `tail` [T, K] fp32, rows of the weight as
// they are. Returns [..., N + T] fp32 (plus `bias` where given). With `int8_rows` the rows are first rounded to
// blocks of 8-bit integers and multiplied by the weight blocks in integers, as llama.cpp multiplies (the kernel
// "int4-q8"); the tail rows still multiply the fp32 rows.
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm,
                        const c10::optional<at::Tensor>& tail, const c10::optional<at::Tensor>& bias,
                        bool int8_rows = false);

// Whether block_linear runs vectorized here (AVX2, FMA and F16C), not lane by lane.
bool blocks_vectorized();

}  // namespace refusion
