// The decoder layers of a compact forward (refusion/model/compact.py) as one C++ call: the products through the
// same ATen kernels as the Python layer loop, and the operations between them either as the same ATen calls or as
// fused passes that give every element the same operations and roundings ("fused kernels" below), without the
// interpreter between them. Loaded by refusion/model/kernels/native.py, which documents what it runs and when; each
// function below names the Python it mirrors. A change to either side must keep the two bit for bit equal
// (tests/model/test_native.py).

#include <torch/extension.h>

#include "block_products.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cmath>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstring>
#include <numeric>
#include <type_traits>
#include <limits>

using at::Tensor;

namespace {

// kinds of product (registry.py: LinearKernel.native_code)
constexpr int64_t kPlain = 0;   // F.linear on the weight as it is
constexpr int64_t kPacked = 1;  // row_exact.PackedLinear: the oneDNN-packed bf16 weight, chunks of exact rows
constexpr int64_t kInt4 = 2;    // int4.Int4Linear: the file's blocks (bf16: torch's int4 kernel; fp32: block_products)
constexpr int64_t kSgemm = 3;   // sgemm.SgemmLinear: MKL's packed fp32 weight where it gives F.linear's bits
constexpr int64_t kNarrow = 4;  // narrow.NarrowLinear: weight-major (W @ x.T).T for narrow forwards, maybe padded
constexpr int64_t kInt4Q8 = 5;  // int4.Int4Q8Linear: the file's blocks times rows rounded to 8 bits (block_products)

// states of a row count in an sgemm product's `exact` (sgemm.py NOT_PROBED, EXACT, INEXACT)
constexpr uint8_t kNotProbed = 0;
constexpr uint8_t kExactRows = 1;
constexpr uint8_t kInexactRows = 2;

// A mask-gated adapter's update, added at the mask rows to one member's columns (gated_lora.MaskGatedLoRA).
struct Update {
  int64_t part;  // which member of the product's output
  Tensor a;      // [in, r] fp32
  Tensor b;      // [r, out] fp32, scaled
};

// One kernel call over the members' stacked weights (model/kernels/fused.py FusedProduct), or a lone linear layer.
struct Product {
  int64_t kind;
  Tensor weight;                // plain weight, packed weight or 4-bit blocks
  Tensor scales;                // int4: the blocks' scales and zeros (bf16), or scales and offsets (fp32)
  c10::optional<Tensor> bias;
  int64_t rows;                 // packed: rows per exact chunk (row_exact.ExactRows.high); narrow: narrow.MAX_ROWS
  int64_t low_rows;             // packed: narrower products padded with zero rows to this many (ExactRows.low);
                                // narrow: products of this many rows or more by `packed` (0: never)
  int64_t group;                // int4: weights per block
  std::vector<int64_t> splits;  // the members' output features
  std::vector<Update> updates;
  Tensor packed;                // sgemm: the MKL-packed weight; narrow: the oneDNN-packed one
  Tensor exact;                 // sgemm: uint8 [thread counts, row counts], shared with the Python layers
  std::vector<int64_t> padded_rows;  // narrow: padded_rows[r], the rows a product of r rows is computed with
};

struct Norm {
  Tensor weight;
  double eps;
};

// attention implementations (native.py ATTENTIONS)
constexpr int64_t kExact = 0;      // row_exact.exact_attention, KV entries in fp64
constexpr int64_t kSdpa = 1;       // transformers' sdpa_attention_forward (on a CPU)
constexpr int64_t kExactHalf = 2;  // row_exact.exact_half_attention: exact attention over fp16 KV entries

inline bool exact_attention_kind(int64_t attention) {
  return attention == kExact || attention == kExactHalf;
}

struct Layer {
  Norm input, post;
  c10::optional<Norm> q_norm, k_norm;  // Qwen3
  std::vector<Product> qkv;            // one fused product, or q, k, v
  Product o;
  std::vector<Product> gate_up;        // one fused product, or gate, up
  Product down;
  int64_t head_dim;
  double scaling;
  int64_t attention;  // kExact, kSdpa or kExactHalf
  int64_t kv_groups;  // query heads per KV head
  int64_t softmax_columns;  // exact attention: the fewest columns its softmax runs over (row_exact.SOFTMAX_COLUMNS)
};

// Where the forward's mask rows are (gated_lora.MaskRows), as the adapter's updates read them.
struct MaskRows {
  bool active;  // a mask row is in the forward: the updates apply
  bool gated;   // every row times the 0/1 gate, else the listed rows only
  bool kernel;  // the updates by mask_update (gated_lora.MaskRows.kernel), else ATen's products
  c10::optional<Tensor> dense;
  c10::optional<Tensor> rows;
};

// row_exact.packed_product
Tensor packed_product(const Tensor& x, const Tensor& weight, const c10::optional<Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, c10::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, weight, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// flat [n, K] followed by zero rows up to `rows` rows (the padding of narrow products: row_exact, narrow)
Tensor with_zero_rows(const Tensor& flat, int64_t rows) {
  return at::cat({flat, flat.new_zeros({rows - flat.size(0), flat.size(1)})});
}

// row_exact.chunked_product: products of low_rows..rows rows, narrower ones padded with zero rows, wider in chunks
Tensor chunked_product(const Tensor& flat, const Product& p) {
  int64_t n = flat.size(0);
  if (n >= p.low_rows && n <= p.rows) return packed_product(flat, p.weight, p.bias);
  if (n < p.low_rows) return packed_product(with_zero_rows(flat, p.low_rows), p.weight, p.bias).narrow(0, 0, n);
  std::vector<Tensor> chunks;
  for (const Tensor& chunk : flat.split(p.rows)) chunks.push_back(chunked_product(chunk, p));
  return at::cat(chunks);
}

// sgemm.SgemmLinear._packed_product
Tensor sgemm_product(const Tensor& flat, const Product& p) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkl::_mkl_linear", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                     int64_t)>();
  return op.call(flat, p.packed, p.weight, p.bias, flat.size(0));
}

// sgemm.SgemmLinear.forward (fp32 inference on the CPU): packed where that row count gave F.linear's bits at this
// thread count, a row count probed before its first product (SgemmLinear._probe: random inputs, Python's numbers)
Tensor sgemm_linear(const Tensor& x, const Product& p) {
  int64_t rows = x.size(-1) ? x.numel() / x.size(-1) : 0;
  int64_t threads = at::get_num_threads();
  if (rows == 0 || rows >= p.exact.size(1) || threads >= p.exact.size(0) || x.scalar_type() != at::kFloat) {
    return at::linear(x, p.weight, p.bias);
  }
  uint8_t* state = p.exact.data_ptr<uint8_t>() + threads * p.exact.stride(0) + rows;
  if (*state == kNotProbed) {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(rows));
    Tensor probe = at::randn({rows, x.size(-1)}, generator, x.options());
    *state = at::equal(sgemm_product(probe, p), at::linear(probe, p.weight, p.bias)) ? kExactRows : kInexactRows;
  }
  if (*state == kInexactRows) return at::linear(x, p.weight, p.bias);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.weight.size(0);
  return sgemm_product(x.reshape({rows, x.size(-1)}), p).view(shape);
}

// narrow.narrow_product: products of p.low_rows rows or more (of the weight's dtype) by the oneDNN-packed weight
// where there is one; else of at most p.rows rows weight-major, padded with zero rows to padded_rows[rows]; wider
// ones F.linear
Tensor narrow_linear(const Tensor& x, const Product& p) {
  int64_t in = x.size(-1), rows = in ? x.numel() / in : 0;
  if (rows == 0 || x.scalar_type() != p.weight.scalar_type()) return at::linear(x, p.weight, p.bias);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = p.weight.size(0);
  Tensor flat = x.reshape({rows, in});
  if (p.low_rows > 0 && rows >= p.low_rows) return packed_product(flat, p.packed, p.bias).view(shape);
  if (rows > p.rows) return at::linear(x, p.weight, p.bias);
  int64_t padded = rows < static_cast<int64_t>(p.padded_rows.size()) ? p.padded_rows[rows] : rows;
  if (padded > rows) flat = with_zero_rows(flat, padded);
  Tensor out = at::mm(p.weight, flat.t()).t().slice(0, 0, rows).contiguous();  // the padding's rows never copied
  if (p.bias) out = out + *p.bias;
  return out.view(shape);
}

// ------------------------------------------------------------------------------------------------ fused kernels
// Chains of element-wise ATen operations computed in one pass, element by element with the same IEEE operations
// and roundings as the chain (each names the Python it replaces): bf16 operands widened to fp32, each
// operation's fp32 result rounded to the dtype before the next (round to nearest even, c10's conversion), no
// contraction into FMAs (compiled with -ffp-contract=off): the same values bit for bit. Reductions stay ATen's
// (`sum`, `_softmax`), whose order of summation is its own. Used for bf16 and fp32 layers; other dtypes take the
// ATen operations.

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// the hot fp64 loops compiled for AVX-512, AVX2 and baseline x86-64, the widest the CPU runs chosen at load time
#define REFUSION_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// exact fp64 loops (products of bf16 numbers, or of fp32 ones: at most 48 significant bits, exact in fp64): a
// product rounds to itself, so fma(a, b, c) rounds as a * b + c does and contracting the two into an FMA changes no
// bit; where the CPU has FMA (x86-64-v3 and v4) those loops take it, half the instructions
#define REFUSION_EXACT_PRODUCTS __attribute__((optimize("fp-contract=fast")))
#else
#define REFUSION_CLONES
#define REFUSION_EXACT_PRODUCTS
#endif

constexpr int64_t kMaxHeadDim = 512;  // the widest head the fused attention takes (its rotary row buffer)

bool fusable(const Tensor& x) {
  return x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat;
}

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

// an fp32 result rounded to T (c10::BFloat16's round to nearest even; nothing for fp32)
template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}

// an fp64 value to T as ATen converts it (to fp32 first, then to T)
template <typename T>
inline T narrow64(double x) {
  return static_cast<T>(static_cast<float>(x));
}

// bf16 <-> fp32 on the raw bits, as c10::BFloat16 converts (its round to nearest even, 0x7FC0 for NaN), written
// without branches so that the loops below vectorise: the passes over many rows (prefill, verify forwards) run
// at the vector width instead of one element at a time
using bf16_bits = uint16_t;

inline float bf16_float(bf16_bits h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline bf16_bits float_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  auto rounded = static_cast<bf16_bits>((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
  return f != f ? static_cast<bf16_bits>(0x7FC0) : rounded;
}

inline const bf16_bits* bits(const c10::BFloat16* x) {
  return reinterpret_cast<const bf16_bits*>(x);
}

inline bf16_bits* bits(c10::BFloat16* x) {
  return reinterpret_cast<bf16_bits*>(x);
}

// out = a + b (bf16)
REFUSION_CLONES void bf16_add(const bf16_bits* a, const bf16_bits* b, bf16_bits* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_bf16(bf16_float(a[i]) + bf16_float(b[i]));
}

// squares[i] = float(h[i])^2
REFUSION_CLONES void bf16_squares(const bf16_bits* h, float* squares, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float f = bf16_float(h[i]);
    squares[i] = f * f;
  }
}

// out = weight * bf16(h * r) (bf16), one row
REFUSION_CLONES void bf16_normalize(const bf16_bits* h, const bf16_bits* w, float r, bf16_bits* out, int64_t dim) {
  for (int64_t i = 0; i < dim; ++i) {
    out[i] = float_bf16(bf16_float(w[i]) * bf16_float(float_bf16(bf16_float(h[i]) * r)));
  }
}

// (x * cos) + (rotate_half(x) * sin) for one head's row (bf16); the two halves apart, so that each loop vectorises
REFUSION_CLONES void bf16_rope(const bf16_bits* x, const bf16_bits* c, const bf16_bits* s, int64_t dim,
                               bf16_bits* out) {
  int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) {
    bf16_bits a = float_bf16(bf16_float(x[d]) * bf16_float(c[d]));
    bf16_bits b = float_bf16(-bf16_float(x[d + half]) * bf16_float(s[d]));
    out[d] = float_bf16(bf16_float(a) + bf16_float(b));
  }
  for (int64_t d = half; d < dim; ++d) {
    bf16_bits a = float_bf16(bf16_float(x[d]) * bf16_float(c[d]));
    bf16_bits b = float_bf16(bf16_float(x[d - half]) * bf16_float(s[d]));
    out[d] = float_bf16(bf16_float(a) + bf16_float(b));
  }
}

// out += bf16(v) (bf16), one row
REFUSION_CLONES void bf16_add_rounded(bf16_bits* out, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = float_bf16(bf16_float(out[i]) + bf16_float(float_bf16(v[i])));
}

// flat_out (bf16 or fp32, columns contiguous) += product.to(flat_out's dtype), at `rows` of flat_out when given,
// in one pass: ATen's `.to(dtype)` then `add_` / `index_add_` (each sum in fp32, rounded to the dtype)
template <typename T>
void add_rounded(const Tensor& flat_out, const Tensor& product, const c10::optional<Tensor>& rows) {
  int64_t n = product.size(0), cols = product.size(1), stride = flat_out.stride(0);
  const float* src = product.const_data_ptr<float>();
  T* dst = flat_out.mutable_data_ptr<T>();
  const int64_t* index = rows ? rows->const_data_ptr<int64_t>() : nullptr;
  for (int64_t r = 0; r < n; ++r) {
    T* o = dst + (index ? index[r] : r) * stride;
    const float* v = src + r * cols;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      bf16_add_rounded(bits(o), v, cols);
    } else {
      for (int64_t c = 0; c < cols; ++c) o[c] = narrow<T>(widen(o[c]) + widen(narrow<T>(v[c])));
    }
  }
}

// ------------------------------------------------------------------------------------------------ mask updates
// A mask-gated adapter's update at the mask rows, as refusion defines it on the CPU (gated_lora.mask_update, which
// calls `mask_update` below from Python too, so that every path computes the same bits): for each listed row,
// low = x @ a then v = low @ b in fp32 without FMA contraction, in a fixed order of summation (below), then
// out += v rounded to out's dtype (bf16: the sum in fp32, rounded). A row's result depends on that row alone.
// Two ATen products per adapted layer, with their conversions, gate and add, are mostly dispatch at a few mask
// rows (docs/DECODING.md, "Mask-gated updates").

REFUSION_CLONES void bf16_widen(const bf16_bits* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_float(x[i]);
}

// low[i][j] = ((s0 + s1) + (s2 + s3)), s_q the sum in order of x[i][k] * a[k][j] over the k = q (mod 4) (the k
// past the last multiple of 4 in s0), for n rows of x and the L columns j0.. of a; four sums so that the products
// of one column do not wait for each other. Each column's order is fixed: the same bits whatever L and from every
// target clone. Inlined into lora_down below.
template <int64_t L>
__attribute__((always_inline)) inline void lora_down_columns(const float* __restrict__ x, int64_t n, int64_t in,
                                                             const float* __restrict__ a, int64_t rank, int64_t j0,
                                                             float* __restrict__ low) {
  const int64_t whole = in - in % 4;
  for (int64_t i = 0; i < n; ++i) {
    const float* xi = x + i * in;
    float s0[L] = {}, s1[L] = {}, s2[L] = {}, s3[L] = {};
    for (int64_t k = 0; k < whole; k += 4) {
      const float* ak = a + k * rank + j0;
      for (int64_t l = 0; l < L; ++l) {
        s0[l] += xi[k] * ak[l];
        s1[l] += xi[k + 1] * ak[rank + l];
        s2[l] += xi[k + 2] * ak[2 * rank + l];
        s3[l] += xi[k + 3] * ak[3 * rank + l];
      }
    }
    for (int64_t k = whole; k < in; ++k) {
      for (int64_t l = 0; l < L; ++l) s0[l] += xi[k] * a[k * rank + j0 + l];
    }
    for (int64_t l = 0; l < L; ++l) low[i * rank + j0 + l] = (s0[l] + s1[l]) + (s2[l] + s3[l]);
  }
}

// lora_down_columns over every column of a [in, rank], by blocks of 16 (one AVX-512 register) while they last
REFUSION_CLONES void lora_down(const float* x, int64_t n, int64_t in, const float* a, int64_t rank, float* low) {
  for (int64_t j0 = 0; j0 < rank;) {
    if (rank - j0 >= 16) {
      lora_down_columns<16>(x, n, in, a, rank, j0, low), j0 += 16;
    } else if (rank - j0 >= 4) {
      lora_down_columns<4>(x, n, in, a, rank, j0, low), j0 += 4;
    } else {
      lora_down_columns<1>(x, n, in, a, rank, j0, low), j0 += 1;
    }
  }
}

// v[i][c] = sum in order over j of low[i][j] * b[j][c], for n rows (b: [rank, cols]); by blocks of 16 columns whose
// sums stay in registers (the columns past the last block one at a time, in the same order)
REFUSION_CLONES void lora_up(const float* __restrict__ low, int64_t n, int64_t rank, const float* __restrict__ b,
                             int64_t cols, float* __restrict__ v) {
  constexpr int64_t kBlock = 16;
  const int64_t whole = cols - cols % kBlock;
  for (int64_t i = 0; i < n; ++i) {
    const float* li = low + i * rank;
    float* vi = v + i * cols;
    for (int64_t c0 = 0; c0 < whole; c0 += kBlock) {
      float acc[kBlock] = {};
      for (int64_t j = 0; j < rank; ++j) {
        const float* bj = b + j * cols + c0;
        for (int64_t l = 0; l < kBlock; ++l) acc[l] += li[j] * bj[l];
      }
      for (int64_t l = 0; l < kBlock; ++l) vi[c0 + l] = acc[l];
    }
    for (int64_t c = whole; c < cols; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < rank; ++j) sum += li[j] * b[j * cols + c];
      vi[c] = sum;
    }
  }
}

REFUSION_CLONES void float_add(float* out, const float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] += v[i];
}

bool mask_update_takes(const Tensor& x, const Tensor& a, const Tensor& b, const Tensor& out) {
  return x.device().is_cpu() && x.dim() == 2 && out.dim() == 2 && fusable(x) && fusable(out) &&
         x.stride(1) == 1 && out.stride(1) == 1 && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat &&
         a.is_contiguous() && b.is_contiguous() && a.size(0) == x.size(1) && b.size(0) == a.size(1) &&
         b.size(1) == out.size(1) && x.size(0) == out.size(0);
}

// out[rows] += (x[rows] @ a) @ b as described above; x [N, in] and out [N, cols] with contiguous columns (out may
// be a member's columns of a larger product), a [in, rank] and b [rank, cols] fp32, rows int64. Returns false
// (nothing done) for inputs it does not take.
bool mask_update(const Tensor& x, const Tensor& rows, const Tensor& a, const Tensor& b, const Tensor& out) {
  if (!mask_update_takes(x, a, b, out) || rows.scalar_type() != at::kLong || !rows.is_contiguous()) return false;
  const int64_t in = a.size(0), rank = a.size(1), cols = b.size(1), n = rows.numel();
  const int64_t* index = rows.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(index[i] >= 0 && index[i] < x.size(0), "mask_update: row ", index[i], " out of range");
  }
  // more than 4 rows (a plan's masks) apart on the threads; a row's sums are the same on any thread
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    const int64_t m = end - begin;
    std::vector<float> rows_x(m * in), low(m * rank), v(m * cols);
    for (int64_t i = 0; i < m; ++i) {  // the listed rows of x, widened to fp32 (exact)
      const int64_t r = index[begin + i];
      if (x.scalar_type() == at::kBFloat16) {
        bf16_widen(bits(x.const_data_ptr<c10::BFloat16>() + r * x.stride(0)), rows_x.data() + i * in, in);
      } else {
        std::memcpy(rows_x.data() + i * in, x.const_data_ptr<float>() + r * x.stride(0), in * sizeof(float));
      }
    }
    lora_down(rows_x.data(), m, in, a.const_data_ptr<float>(), rank, low.data());
    lora_up(low.data(), m, rank, b.const_data_ptr<float>(), cols, v.data());
    for (int64_t i = 0; i < m; ++i) {
      const int64_t r = index[begin + i];
      if (out.scalar_type() == at::kBFloat16) {
        bf16_add_rounded(bits(out.mutable_data_ptr<c10::BFloat16>() + r * out.stride(0)), v.data() + i * cols, cols);
      } else {
        float_add(out.mutable_data_ptr<float>() + r * out.stride(0), v.data() + i * cols, cols);
      }
    }
  });
  return true;
}

// MaskGatedLoRA.add_update; `low_x`: the rows it multiplies (every row, or the mask rows), in A's dtype, shared
// by the members of one product
void add_update(const Update& u, const Tensor& low_x, const Tensor& out, const MaskRows& m) {
  Tensor flat_out = out.view({-1, out.size(-1)});
  Tensor low = at::mm(low_x, u.a);
  if (m.gated) low.mul_(m.dense->reshape({-1, 1}));
  if (m.gated && flat_out.scalar_type() == low.scalar_type()) {
    flat_out.addmm_(low, u.b);
    return;
  }
  Tensor product = at::mm(low, u.b);
  bool fused = fusable(flat_out) && product.scalar_type() == at::kFloat && product.is_contiguous() &&
               flat_out.stride(1) == 1 && (m.gated || (m.rows->scalar_type() == at::kLong && m.rows->is_contiguous()));
  c10::optional<Tensor> rows = m.gated ? c10::nullopt : m.rows;
  if (fused && flat_out.scalar_type() == at::kBFloat16) {
    add_rounded<c10::BFloat16>(flat_out, product, rows);
  } else if (fused) {
    add_rounded<float>(flat_out, product, rows);
  } else if (m.gated) {
    flat_out.add_(product.to(flat_out.scalar_type()));
  } else {
    flat_out.index_add_(0, *m.rows, product.to(flat_out.scalar_type()));
  }
}

// The rows an update multiplies, in `dtype`: every row of x (the gate zeroes the others) or the mask rows
Tensor update_rows(const Tensor& x, const MaskRows& m, at::ScalarType dtype) {
  Tensor flat_x = x.reshape({-1, x.size(-1)});
  return (m.gated ? flat_x : flat_x.index_select(0, *m.rows)).to(dtype);
}

// FusedProduct.__call__, PackedLinear.forward (chunked_product), Int4Linear.forward, SgemmLinear.forward,
// NarrowLinear.forward, nn.Linear.forward, and the
// MaskGatedLoRA updates of the members: the members' outputs in order (views of `*whole`, when asked for)
std::vector<Tensor> product(const Product& p, const Tensor& x, const MaskRows& m, Tensor* whole = nullptr) {
  Tensor out;
  if (p.kind == kPlain) {
    out = at::linear(x, p.weight, p.bias);
  } else if (p.kind == kSgemm) {
    out = sgemm_linear(x, p);
  } else if (p.kind == kNarrow) {
    out = narrow_linear(x, p);
  } else {
    Tensor flat = x.reshape({-1, x.size(-1)});
    if (p.kind == kPacked) {
      out = chunked_product(flat, p);
    } else if (flat.scalar_type() == at::kFloat) {  // Int4Linear.forward: int4.block_product
      out = refusion::block_linear(flat, p.weight, p.scales, c10::nullopt, p.bias, p.kind == kInt4Q8);
    } else {
      out = at::_weight_int4pack_mm_for_cpu(flat.contiguous(), p.weight, p.group, p.scales);
      if (p.bias) out = out + *p.bias;
    }
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out.size(-1);
    out = out.view(shape);
  }
  std::vector<Tensor> parts = p.splits.size() == 1 ? std::vector<Tensor>{out} : out.split_with_sizes(p.splits, -1);
  if (m.active) {
    Tensor low_x;  // converted once for the members that share x
    Tensor flat_x = x.reshape({-1, x.size(-1)});
    for (const Update& u : p.updates) {
      if (m.kernel && m.rows && mask_update(flat_x, *m.rows, u.a, u.b, parts[u.part].view({-1, parts[u.part].size(-1)}))) {
        continue;  // gated_lora.MaskGatedLoRA.add_update takes the same path for the same inputs
      }
      if (!low_x.defined() || low_x.scalar_type() != u.a.scalar_type()) low_x = update_rows(x, m, u.a.scalar_type());
      add_update(u, low_x, parts[u.part], m);
    }
  }
  if (whole != nullptr) *whole = out;
  return parts;
}

// the members' outputs of a block's products, in order
std::vector<Tensor> products(const std::vector<Product>& ps, const Tensor& x, const MaskRows& m) {
  std::vector<Tensor> outs;
  for (const Product& p : ps) {
    for (Tensor& part : product(p, x, m)) outs.push_back(std::move(part));
  }
  return outs;
}

// LlamaRMSNorm.forward after an optional residual add: [hidden = residual + x;] h = hidden.to(fp32);
// variance = h.pow(2).mean(-1, keepdim=True); h = h * rsqrt(variance + eps); weight * h.to(dtype).
// Returns (hidden, normed). x contiguous, bf16 or fp32, weight of the same dtype.
template <typename T>
std::pair<Tensor, Tensor> fused_rms_norm(const c10::optional<Tensor>& residual, const Tensor& x, const Norm& norm) {
  int64_t dim = x.size(-1), n = x.numel(), rows = dim ? n / dim : 0;
  Tensor hidden = x;
  constexpr bool bf16 = std::is_same_v<T, c10::BFloat16>;
  if (residual) {
    hidden = at::empty_like(x);
    const T *a = residual->const_data_ptr<T>(), *b = x.const_data_ptr<T>();
    T* h = hidden.mutable_data_ptr<T>();
    if constexpr (bf16) {
      bf16_add(bits(a), bits(b), bits(h), n);
    } else {
      for (int64_t i = 0; i < n; ++i) h[i] = narrow<T>(widen(a[i]) + widen(b[i]));  // residual + x
    }
  }
  Tensor squares = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  const T* h = hidden.const_data_ptr<T>();
  float* sq = squares.mutable_data_ptr<float>();
  if constexpr (bf16) {
    bf16_squares(bits(h), sq, n);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      float f = widen(h[i]);
      sq[i] = f * f;  // h.pow(2)
    }
  }
  // mean: ATen's sum (its order of summation), then divided by the count as ATen's mean divides; + eps in fp32
  Tensor sums = at::sum(squares, -1, true);
  const float* sum = sums.const_data_ptr<float>();
  float count = static_cast<float>(dim), eps = static_cast<float>(norm.eps);
  const T* w = norm.weight.const_data_ptr<T>();
  Tensor out = at::empty_like(hidden);
  T* o = out.mutable_data_ptr<T>();
  for (int64_t row = 0; row < rows; ++row) {
    float r = 1.0f / std::sqrt(sum[row] / count + eps);  // rsqrt(variance + eps)
    if constexpr (bf16) {
      bf16_normalize(bits(h + row * dim), bits(w), r, bits(o + row * dim), dim);
    } else {
      for (int64_t i = 0; i < dim; ++i) {
        o[row * dim + i] = narrow<T>(widen(w[i]) * widen(narrow<T>(widen(h[row * dim + i]) * r)));
      }
    }
  }
  return {hidden, out};
}

// A [B, T, heads, D] tensor's element pointer and strides (the last dimension contiguous).
template <typename S>
struct Heads {
  S* data;
  int64_t sb, st, sh;
  explicit Heads(const Tensor& x)
      : data(static_cast<S*>(x.data_ptr())), sb(x.stride(0)), st(x.stride(1)), sh(x.stride(2)) {}
  S* at(int64_t b, int64_t t, int64_t h) const { return data + b * sb + t * st + h * sh; }
};

// apply_rotary_pos_emb's formula on one head's row: (x * cos) + (rotate_half(x) * sin), each product rounded to
// T, then the sum
template <typename T, typename Out>
inline void rope_row(const T* x, const T* c, const T* s, int64_t dim, Out* out) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if constexpr (std::is_same_v<Out, c10::BFloat16>) {
      bf16_rope(bits(x), bits(c), bits(s), dim, bits(out));
    } else {
      bf16_bits row[kMaxHeadDim];  // checked where the fused attention is chosen
      bf16_rope(bits(x), bits(c), bits(s), dim, row);
      for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<Out>(bf16_float(row[d]));
    }
    return;
  }
  int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    float rotated = d < half ? -widen(x[d + half]) : widen(x[d - half]);
    T a = narrow<T>(widen(x[d]) * widen(c[d])), b = narrow<T>(rotated * widen(s[d]));
    out[d] = static_cast<Out>(narrow<T>(widen(a) + widen(b)));
  }
}

// The rotary embedding of q and k, and `SlotCache.write` of k and v: query heads rotated into `q_out` ([B, T, H, D],
// fp64 for exact attention or T), keys rotated and values as they are into the cache storage at columns
// [start, start + T) (KV entries fp64 or T; each value converted exactly). q, k, v: [B, T, heads, D] views;
// cos, sin: [B, T, D] contiguous.
template <typename T, typename Q, typename KV>
void rope_write(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos, const Tensor& sin,
                const Tensor& q_out, const Tensor& keys, const Tensor& values, int64_t start) {
  int64_t batch = q.size(0), width = q.size(1), heads = q.size(2), kv_heads = k.size(2), dim = q.size(3);
  Heads<const T> qi(q), ki(k), vi(v);
  Heads<Q> qo(q_out);
  KV *kd = keys.mutable_data_ptr<KV>(), *vd = values.mutable_data_ptr<KV>();
  int64_t capacity = keys.size(2);
  const T *cd = cos.const_data_ptr<T>(), *sd = sin.const_data_ptr<T>();
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < width; ++t) {
      const T *c = cd + (b * width + t) * dim, *s = sd + (b * width + t) * dim;
      for (int64_t h = 0; h < heads; ++h) rope_row<T, Q>(qi.at(b, t, h), c, s, dim, qo.at(b, t, h));
      for (int64_t g = 0; g < kv_heads; ++g) {
        int64_t entry = ((b * kv_heads + g) * capacity + start + t) * dim;
        rope_row<T, KV>(ki.at(b, t, g), c, s, dim, kd + entry);
        const T* x = vi.at(b, t, g);
        for (int64_t d = 0; d < dim; ++d) vd[entry + d] = static_cast<KV>(x[d]);
      }
    }
  }
}

// four fp64 lanes (GCC's vector extension: AVX2 registers in the AVX2 and AVX-512 clones, SSE pairs in the baseline)
typedef double lanes4 __attribute__((vector_size(32)));

inline lanes4 load4(const double* x) {
  lanes4 v;
  std::memcpy(&v, x, sizeof v);
  return v;
}

inline void store4(double* x, lanes4 v) {
  std::memcpy(x, &v, sizeof v);
}

// the sum of 8 partial sums (lanes 0-3 in `low`, 4-7 in `high`) in key_dots' order
inline double lane_sum(lanes4 low, lanes4 high) {
  return ((low[0] + low[1]) + (low[2] + low[3])) + ((high[0] + high[1]) + (high[2] + high[3]));
}

// fp64 dot products of a query row with `length` key rows: products of bf16 numbers are exact in fp64 and so
// are their sums, whatever the order (row_exact's docstring); here 8 partial sums (lane l takes the dims d with
// d % 8 == l, then lane 0 the dims past the last multiple of 8), then their sum. Four keys at a time share the
// query's loads; each key's sums are the ones it has alone.
REFUSION_CLONES REFUSION_EXACT_PRODUCTS void key_dots(const double* q, const double* keys, int64_t length,
                                                      int64_t dim, double* out) {
  int64_t whole = dim / 8 * 8, j = 0;
  auto tail = [&](const double* k, lanes4& low) {
    for (int64_t d = whole; d < dim; ++d) low[0] += q[d] * k[d];
  };
  for (; j + 4 <= length; j += 4) {
    const double *k0 = keys + j * dim, *k1 = k0 + dim, *k2 = k1 + dim, *k3 = k2 + dim;
    lanes4 l0 = {}, h0 = {}, l1 = {}, h1 = {}, l2 = {}, h2 = {}, l3 = {}, h3 = {};
    for (int64_t d = 0; d < whole; d += 8) {
      lanes4 ql = load4(q + d), qh = load4(q + d + 4);
      l0 += ql * load4(k0 + d), h0 += qh * load4(k0 + d + 4);
      l1 += ql * load4(k1 + d), h1 += qh * load4(k1 + d + 4);
      l2 += ql * load4(k2 + d), h2 += qh * load4(k2 + d + 4);
      l3 += ql * load4(k3 + d), h3 += qh * load4(k3 + d + 4);
    }
    tail(k0, l0), tail(k1, l1), tail(k2, l2), tail(k3, l3);
    out[j] = lane_sum(l0, h0), out[j + 1] = lane_sum(l1, h1), out[j + 2] = lane_sum(l2, h2);
    out[j + 3] = lane_sum(l3, h3);
  }
  for (; j < length; ++j) {
    const double* k = keys + j * dim;
    lanes4 low = {}, high = {};
    for (int64_t d = 0; d < whole; d += 8) {
      low += load4(q + d) * load4(k + d), high += load4(q + d + 4) * load4(k + d + 4);
    }
    tail(k, low);
    out[j] = lane_sum(low, high);
  }
}

// out[d] += sum_j w[j] * values[j][d] in fp64, j in order (exact products of bf16 numbers); zero weights add nothing.
// 32 (then 4) of the row's dims at a time stay in registers over all j; each dim's sum is the same, in the same order
REFUSION_CLONES REFUSION_EXACT_PRODUCTS void add_weighted_values(const double* w, const double* values,
                                                                 int64_t length, int64_t dim, double* out) {
  int64_t d0 = 0;
  for (; d0 + 32 <= dim; d0 += 32) {
    lanes4 a[8];
    for (int i = 0; i < 8; ++i) a[i] = load4(out + d0 + 4 * i);
    for (int64_t j = 0; j < length; ++j) {
      if (w[j] == 0) continue;
      const double* v = values + j * dim + d0;
      lanes4 wj = {w[j], w[j], w[j], w[j]};
      for (int i = 0; i < 8; ++i) a[i] += wj * load4(v + 4 * i);
    }
    for (int i = 0; i < 8; ++i) store4(out + d0 + 4 * i, a[i]);
  }
  for (; d0 + 4 <= dim; d0 += 4) {
    lanes4 a = load4(out + d0);
    for (int64_t j = 0; j < length; ++j) {
      if (w[j] == 0) continue;
      lanes4 wj = {w[j], w[j], w[j], w[j]};
      a += wj * load4(values + j * dim + d0);
    }
    store4(out + d0, a);
  }
  for (; d0 < dim; ++d0) {
    for (int64_t j = 0; j < length; ++j) {
      if (w[j] != 0) out[d0] += w[j] * values[j * dim + d0];
    }
  }
}

// Where a forward's rows sit in attention's padded [B, T] layout (compact.Ragged): the layers compute the real rows
// alone, [1, N, ...], and attention scatters them into that layout and gathers them back; `real` unset: the rows
// are the layout. `split` (compact.Ragged.split): each row's real tokens, where sdpa runs row by row over them alone
// (the padding's queries skipped); empty: one call over the padded layout. Exact attention computes the real rows
// alone (fused_exact_attention)
struct Layout {
  c10::optional<Tensor> real;  // [N] flat indices into B * T of the real rows
  int64_t batch, width;
  std::vector<int64_t> split;
};

// fp16 KV entries widened to fp64 (exact: any conversion gives the same numbers), with F16C where the CPU has it
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx,f16c"))) void half_doubles_f16c(const c10::Half* h, double* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i)));
    _mm256_storeu_pd(out + i, _mm256_cvtps_pd(_mm256_castps256_ps128(f)));
    _mm256_storeu_pd(out + i + 4, _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)));
  }
  for (; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(h[i]));
}
#endif

void half_doubles(const c10::Half* h, double* out, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool f16c = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  if (f16c) return half_doubles_f16c(h, out, n);
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<double>(static_cast<float>(h[i]));
}

constexpr int64_t kEntryRows = 64;  // KV entries widened to fp64 at a time (a block of 64 x 64 fp64 stays in L1/L2)
constexpr int64_t kTileRows = 8;     // query rows of one sequence that share each block of its entries

// rows [begin, begin + n) of one head's KV entries ([capacity, dim]) in fp64: fp64 entries in place, fp16 ones
// widened into `buffer` (at least kEntryRows * dim)
inline const double* entry_rows(const double* entries, int64_t begin, int64_t, int64_t dim, double*) {
  return entries + begin * dim;
}

inline const double* entry_rows(const c10::Half* entries, int64_t begin, int64_t n, int64_t dim, double* buffer) {
  half_doubles(entries + begin * dim, buffer, n * dim);
  return buffer;
}

// row_exact.exact_attention over the cache's entries (fp64, or fp16 for row_exact.exact_half_attention, each
// widened to fp64 exactly): scores = float(q . k * scaling + mask) (each in fp64), softmax in fp32 (ATen's) over the
// columns the row sees, moved to the front in their order (row_exact.canonical_softmax: the same sums wherever its
// keys sit in the cache), weights rounded to T, their product with the values summed in fp64, rounded to T.
// q: [B, T, H, D] fp64 contiguous; keys, values: the cache storage [B, H_kv, capacity, D] of KV, attended up to
// column `length`; mask: additive [B, 1, T, >= length] (the last dimension contiguous) or none. `rows`: the query
// rows computed, as flat indices b * T + t (a padded forward's real rows: its padding's are never read). Returns
// [rows, H * D] in T.
// Columns past the last one a query row sees (mask at its dtype's lowest) are not multiplied; no column it does not
// see enters its softmax, and each gets weight 0, as it would with its product and the mask added.
// The query heads that share a key head are computed together, each entry read (and widened) once for all of them;
// each head's sums are the same, in the same order, as alone.
template <typename T, typename KV>
Tensor exact_attention_rows(const Tensor& q, const Tensor& keys, const Tensor& values,
                            const c10::optional<Tensor>& mask, double scaling, int64_t length, int64_t columns,
                            const int64_t* query_rows, int64_t count) {
  int64_t width = q.size(1), heads = q.size(2), dim = q.size(3);
  int64_t kv_heads = keys.size(1), capacity = keys.size(2), groups = heads / kv_heads;
  int64_t span = std::max(length, columns);  // the softmax's columns: the row's own at the front, then padding
  constexpr float kFill = std::numeric_limits<float>::lowest();
  Tensor scores = at::empty({count, heads, span}, q.options().dtype(at::kFloat));
  const double* qd = q.const_data_ptr<double>();
  const KV *kd = keys.const_data_ptr<KV>(), *vd = values.const_data_ptr<KV>();
  float* sd = scores.mutable_data_ptr<float>();
  int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(1, length * dim * groups));
  Tensor m;
  double lowest = 0;  // the mask's value for a column a row does not see: its dtype's lowest
  int64_t mb = 0, mt = 0;
  at::ScalarType mask_type = at::kDouble;
  if (mask) {
    m = mask->stride(-1) == 1 ? *mask : mask->contiguous();
    mb = m.stride(0), mt = m.stride(2), mask_type = m.scalar_type();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask_type, "mask",
                                    [&] { lowest = static_cast<double>(std::numeric_limits<scalar_t>::lowest()); });
  }
  // the mask's row of (b, t) in fp64, and the columns from the first to the last one it sees
  auto mask_row = [&](int64_t b, int64_t t, double* masked, int64_t& first, int64_t& seen) {
    first = 0, seen = length;
    if (!mask) return;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask_type, "mask", [&] {
      const scalar_t* row = m.const_data_ptr<scalar_t>() + b * mb + t * mt;
      for (int64_t j = 0; j < length; ++j) masked[j] = static_cast<double>(row[j]);
    });
    while (seen > 0 && (masked[seen - 1] <= lowest)) --seen;
    while (first < seen && (masked[first] <= lowest)) ++first;  // a padding row sees its own columns alone
  };
  // tiles: up to kTileRows consecutive listed rows of one sequence (a prefill's), which read each block of its
  // entries once for all of them (from the CPU's cache) instead of once per row
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (first listed row, rows)
  for (int64_t i = 0; i < count; ++i) {
    int64_t b = query_rows[i] / width;
    if (!tiles.empty() && tiles.back().second < kTileRows &&
        query_rows[tiles.back().first] / width == b) {
      ++tiles.back().second;
    } else {
      tiles.emplace_back(i, 1);
    }
  }
  int64_t items = static_cast<int64_t>(tiles.size()) * kv_heads;  // (tile, g)
  int64_t widest = 1;  // rows of the largest tile: what each thread's buffers hold
  for (const auto& tile : tiles) widest = std::max(widest, tile.second);
  // a thread's scratch for one (tile, key head) at a time: the tile's rows' masks in fp64, the columns each sees
  // (first, seen) and the span they cover together; per row and query head a value per column (scores, then
  // weights), its output sums, and a block of entries
  struct Scratch {
    std::vector<double> masked, columns, sums, block;  // [rows, length], [rows, groups, length], [rows, groups, dim]
    int64_t first[kTileRows], seen[kTileRows], low = 0, high = 0;
  };
  // body(tile, g, b, scratch) for every (tile, key head g) in parallel, the tile's rows (of sequence b) read
  auto each_tile = [&](auto&& body) {
    at::parallel_for(0, items, std::max<int64_t>(1, grain / widest), [&](int64_t begin, int64_t end) {
      Scratch sc;
      sc.masked.resize(mask ? widest * length : 0), sc.columns.resize(widest * groups * length);
      sc.sums.resize(widest * groups * dim), sc.block.resize(kEntryRows * dim);
      for (int64_t item = begin; item < end; ++item) {
        const auto& tile = tiles[item / kv_heads];
        sc.low = length, sc.high = 0;
        for (int64_t k = 0; k < tile.second; ++k) {
          int64_t bt = query_rows[tile.first + k];
          mask_row(bt / width, bt % width, sc.masked.data() + k * length, sc.first[k], sc.seen[k]);
          if (sc.first[k] < sc.seen[k]) {
            sc.low = std::min(sc.low, sc.first[k]), sc.high = std::max(sc.high, sc.seen[k]);
          }
        }
        body(tile, item % kv_heads, query_rows[tile.first] / width, sc);
      }
    });
  };
  each_tile([&](const std::pair<int64_t, int64_t>& tile, int64_t g, int64_t b, Scratch& sc) {
    const KV* head_keys = kd + (b * kv_heads + g) * capacity * dim;
    for (int64_t j0 = sc.low; j0 < sc.high; j0 += kEntryRows) {
      int64_t n = std::min(kEntryRows, sc.high - j0);
      const double* k = entry_rows(head_keys, j0, n, dim, sc.block.data());
      for (int64_t r = 0; r < tile.second; ++r) {  // each row's keys of this block
        int64_t from = std::max(j0, sc.first[r]), to = std::min(j0 + n, sc.seen[r]);
        if (from >= to) continue;
        int64_t t = query_rows[tile.first + r] % width;
        for (int64_t i = 0; i < groups; ++i) {
          key_dots(qd + ((b * width + t) * heads + g * groups + i) * dim, k + (from - j0) * dim, to - from, dim,
                   sc.columns.data() + (r * groups + i) * length + from);
        }
      }
    }
    for (int64_t r = 0; r < tile.second; ++r) {
      const double* masked = mask ? sc.masked.data() + r * length : nullptr;
      for (int64_t i = 0; i < groups; ++i) {
        float* out = sd + ((tile.first + r) * heads + g * groups + i) * span;
        const double* head_dots = sc.columns.data() + (r * groups + i) * length;
        int64_t n = 0;  // the columns the row sees, in order, at the front
        for (int64_t j = sc.first[r]; j < sc.seen[r]; ++j) {
          if (mask && masked[j] <= lowest) continue;
          double score = head_dots[j] * scaling;
          if (mask) score = score + masked[j];
          out[n++] = static_cast<float>(score);
        }
        for (int64_t j = n; j < span; ++j) out[j] = kFill;
      }
    }
  });
  Tensor weights = at::_softmax(scores, -1, false);
  Tensor result = at::empty({count, heads * dim}, q.options().dtype(c10::CppTypeToScalarType<T>::value));
  const float* wd = weights.const_data_ptr<float>();
  T* od = result.mutable_data_ptr<T>();
  each_tile([&](const std::pair<int64_t, int64_t>& tile, int64_t g, int64_t b, Scratch& sc) {
    for (int64_t r = 0; r < tile.second; ++r) {
      const double* masked = mask ? sc.masked.data() + r * length : nullptr;
      for (int64_t i = 0; i < groups; ++i) {  // each seen column's weight back at its column, .to(dtype).double()
        const float* weights_row = wd + ((tile.first + r) * heads + g * groups + i) * span;
        double* head_w = sc.columns.data() + (r * groups + i) * length;
        int64_t n = 0;
        for (int64_t j = sc.first[r]; j < sc.seen[r]; ++j) {
          head_w[j] = mask && masked[j] <= lowest ? 0.0 : static_cast<double>(narrow<T>(weights_row[n++]));
        }
      }
    }
    std::fill(sc.sums.begin(), sc.sums.end(), 0.0);
    const KV* head_values = vd + (b * kv_heads + g) * capacity * dim;
    for (int64_t j0 = sc.low; j0 < sc.high; j0 += kEntryRows) {  // the columns outside weigh 0: they add nothing
      int64_t n = std::min(kEntryRows, sc.high - j0);
      const double* v = entry_rows(head_values, j0, n, dim, sc.block.data());
      for (int64_t r = 0; r < tile.second; ++r) {  // each row's sums go on in column order, block after block
        int64_t from = std::max(j0, sc.first[r]), to = std::min(j0 + n, sc.seen[r]);
        if (from >= to) continue;
        for (int64_t i = 0; i < groups; ++i) {
          add_weighted_values(sc.columns.data() + (r * groups + i) * length + from, v + (from - j0) * dim, to - from,
                              dim, sc.sums.data() + (r * groups + i) * dim);
        }
      }
    }
    for (int64_t r = 0; r < tile.second; ++r) {
      for (int64_t i = 0; i < groups; ++i) {
        T* out = od + (tile.first + r) * heads * dim + (g * groups + i) * dim;
        for (int64_t d = 0; d < dim; ++d) out[d] = narrow64<T>(sc.sums[(r * groups + i) * dim + d]);
      }
    }
  });
  return result;
}

constexpr int64_t kAttentionRows = 64;  // query rows per pass of a wide forward's exact attention

// exact_attention_rows over the forward's rows (a padded layout's real rows alone: Layout), at most kAttentionRows
// at a time (each row's numbers are its own: the same bits), so that a prefill's scores and weights take
// [64, H, length] at a time, not [T, H, length]. Returns [1, N, H * D] for the real rows, else [B, T, H * D].
template <typename T, typename KV>
Tensor fused_exact_attention(const Tensor& q, const Tensor& keys, const Tensor& values,
                             const c10::optional<Tensor>& mask, double scaling, int64_t length, int64_t columns,
                             const Layout& l) {
  int64_t batch = q.size(0), width = q.size(1), heads = q.size(2), dim = q.size(3);
  std::vector<int64_t> all;
  Tensor real;
  const int64_t* rows;
  int64_t count;
  if (l.real) {
    real = l.real->to(at::kLong).contiguous();
    rows = real.const_data_ptr<int64_t>(), count = real.numel();
  } else {
    all.resize(batch * width);
    std::iota(all.begin(), all.end(), int64_t{0});
    rows = all.data(), count = batch * width;
  }
  Tensor out;
  if (count <= kAttentionRows) {
    out = exact_attention_rows<T, KV>(q, keys, values, mask, scaling, length, columns, rows, count);
  } else {
    std::vector<Tensor> parts;
    for (int64_t i = 0; i < count; i += kAttentionRows) {
      parts.push_back(exact_attention_rows<T, KV>(q, keys, values, mask, scaling, length, columns, rows + i,
                                                  std::min(kAttentionRows, count - i)));
    }
    out = at::cat(parts, 0);
  }
  return l.real ? out.view({1, count, heads * dim}) : out.view({batch, width, heads * dim});
}

// LlamaRMSNorm.forward (Mistral, Qwen2, Qwen3 alike) after an optional residual add: (hidden, normed)
std::pair<Tensor, Tensor> add_rms_norm(const c10::optional<Tensor>& residual, const Tensor& x, const Norm& norm) {
  bool fused = fusable(x) && x.is_contiguous() && norm.weight.scalar_type() == x.scalar_type() &&
               norm.weight.is_contiguous() && norm.weight.numel() == x.size(-1) &&
               (!residual || (residual->scalar_type() == x.scalar_type() && residual->is_contiguous() &&
                              residual->sizes() == x.sizes()));
  if (fused) {
    return x.scalar_type() == at::kBFloat16 ? fused_rms_norm<c10::BFloat16>(residual, x, norm)
                                            : fused_rms_norm<float>(residual, x, norm);
  }
  Tensor hidden = residual ? *residual + x : x;
  auto dtype = hidden.scalar_type();
  Tensor h = hidden.to(at::kFloat);
  Tensor variance = h.pow(2).mean(-1, true);
  h = h * at::rsqrt(variance + norm.eps);
  return {hidden, norm.weight * h.to(dtype)};
}

Tensor rms_norm(const Tensor& x, const Norm& norm) {
  return add_rms_norm(c10::nullopt, x, norm).second;
}

// rotate_half
Tensor rotate_half(const Tensor& x) {
  int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

// row_exact.canonical_softmax: softmax in fp32 over the columns each row sees, moved to the front in their order and
// followed by padding up to `columns` (the same sums wherever the keys sit); 0 at the columns it does not see
Tensor canonical_softmax(const Tensor& scores, const c10::optional<Tensor>& mask, int64_t columns) {
  int64_t length = scores.size(-1);
  float fill = std::numeric_limits<float>::lowest();
  Tensor flat = scores.to(at::kFloat);
  if (!mask) {
    Tensor padded = at::constant_pad_nd(flat, {0, std::max<int64_t>(0, columns - length)}, fill);
    return at::_softmax(padded, -1, false).slice(-1, 0, length);
  }
  double lowest = 0;  // the mask's value at a column a row does not see
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mask->scalar_type(), "mask",
                                  [&] { lowest = static_cast<double>(std::numeric_limits<scalar_t>::lowest()); });
  Tensor visible = mask->slice(3, 0, length).gt(lowest).expand_as(scores);
  Tensor order = at::argsort(visible.logical_not().to(at::kByte), true, -1, false);  // stable: seen columns first
  Tensor front = at::where(visible, flat, at::scalar_tensor(fill, flat.options())).gather(-1, order);
  Tensor padded = at::constant_pad_nd(front, {0, std::max<int64_t>(0, columns - length)}, fill);
  Tensor weights = at::_softmax(padded, -1, false).slice(-1, 0, length);
  return at::where(visible, at::zeros_like(weights).scatter_(-1, order, weights), 0.0);
}

// row_exact.exact_attention
Tensor exact_attention(const Tensor& query, const Tensor& key, const Tensor& value, const c10::optional<Tensor>& mask,
                       double scaling, int64_t columns) {
  int64_t batch = query.size(0), heads = query.size(1), rows = query.size(2), dim = query.size(3);
  int64_t kv_heads = key.size(1), length = key.size(2);
  Tensor grouped = query.reshape({batch, kv_heads, heads / kv_heads * rows, dim}).to(at::kDouble);
  Tensor scores =
      at::matmul(grouped, key.to(at::kDouble).transpose(2, 3)).view({batch, heads, rows, length}).mul_(scaling);
  if (mask) scores.add_(mask->slice(3, 0, length));
  Tensor weights = canonical_softmax(scores, mask, columns).to(query.scalar_type());
  Tensor out = at::matmul(weights.view({batch, kv_heads, -1, length}).to(at::kDouble), value.to(at::kDouble));
  out = out.view({batch, heads, rows, dim}).to(query.scalar_type());
  return out.transpose(1, 2).contiguous();
}

// repeat_kv
Tensor repeat_kv(const Tensor& x, int64_t repeats) {
  if (repeats == 1) return x;
  int64_t batch = x.size(0), kv_heads = x.size(1), length = x.size(2), dim = x.size(3);
  return x.unsqueeze(2).expand({batch, kv_heads, repeats, length, dim}).reshape({batch, kv_heads * repeats, length, dim});
}

// pack_gqa
c10::optional<Tensor> pack_gqa(const c10::optional<Tensor>& x, int64_t repeats) {
  if (!x || x->size(1) == 1) return x;
  return x->reshape({x->size(0), x->size(1) / repeats, repeats, x->size(3)});
}

// sdpa_attention_forward on a CPU (no position bias, no dropout, causal module, TRANSFORMERS_SDPA_FORCE_GQA unset),
// except that several query rows with a mask read the shared key and value heads (enable_gqa) where transformers
// copies them per query head (repeat_kv): the same sums, bit for bit (tests/model/test_native.py), without copying
// the whole cache per layer (a batch of 8 drafting sequences over 220 columns spent 15 ms of a ~100 ms forward on
// those copies, on E5)
Tensor sdpa_attention(Tensor query, Tensor key, Tensor value, c10::optional<Tensor> mask, double scaling,
                      int64_t groups) {
  int64_t rows = query.size(2);
  bool gqa = false;
  if (groups > 1) {
    bool shareable = key.size(-1) == value.size(-1) && key.size(-1) <= 256;
    if (!mask && shareable) {  // use_gqa_in_sdpa
      gqa = true;
    } else if (rows == 1) {
      query = *pack_gqa(query, groups);
      mask = pack_gqa(mask, groups);
    } else if (shareable) {
      gqa = true;
    } else {
      key = repeat_kv(key, groups);
      value = repeat_kv(value, groups);
    }
  }
  bool causal = rows > 1 && !mask;
  if (causal && key.size(2) > rows) {
    key = key.slice(2, 0, rows);
    value = value.slice(2, 0, rows);
  }
  Tensor out = at::scaled_dot_product_attention(query, key, value, mask, 0.0, causal, scaling, gqa);
  out = out.reshape({out.size(0), -1, rows, value.size(-1)});
  return out.transpose(1, 2).contiguous();
}

// apply_rotary_pos_emb's formula for one of q and k; c, s: cos and sin unsqueezed at dim 1
Tensor rotary(const Tensor& x, const Tensor& c, const Tensor& s) {
  return (x * c) + (rotate_half(x) * s);
}

// Ragged.scatter: [1, N, F] -> [B, T, F], zeros at the padding
Tensor scatter(const Tensor& x, const Layout& l) {
  if (!l.real) return x;
  Tensor flat = x.reshape({-1, x.size(-1)});
  Tensor out = at::zeros({l.batch * l.width, flat.size(1)}, flat.options());
  return out.index_copy_(0, *l.real, flat).view({l.batch, l.width, flat.size(1)});
}

// Ragged.gather: [B, T, F] -> [1, N, F]
Tensor gather(const Tensor& x, const Layout& l) {
  if (!l.real) return x;
  return x.reshape({l.batch * l.width, x.size(-1)}).index_select(0, *l.real).unsqueeze(0);
}

// sdpa_attention of the forward's rows: query [B, H, T, D] over the cache's keys and values up to the forward's end;
// [1, N, H * D] for the real rows (Layout) or [B, T, H * D]. Split (compact.Ragged.split): row by row over each
// row's real (last) queries, as compact.CompactForward._split_attention does
Tensor sdpa_rows(const Tensor& query, const Tensor& keys, const Tensor& values, const c10::optional<Tensor>& mask,
                 double scaling, int64_t groups, const Layout& l) {
  int64_t batch = query.size(0), width = query.size(2);
  if (l.split.empty() || !mask) {
    return gather(sdpa_attention(query, keys, values, mask, scaling, groups).reshape({batch, width, -1}), l);
  }
  std::vector<Tensor> parts;
  for (int64_t b = 0; b < batch; ++b) {
    int64_t n = l.split[b];
    if (n == 0) continue;
    Tensor rows_mask = mask->size(0) == 1 ? *mask : mask->slice(0, b, b + 1);
    if (rows_mask.size(2) == width) rows_mask = rows_mask.slice(2, width - n, width);
    Tensor out = sdpa_attention(query.slice(0, b, b + 1).slice(2, width - n, width), keys.slice(0, b, b + 1),
                                values.slice(0, b, b + 1), rows_mask, scaling, groups);
    parts.push_back(out.reshape({1, n, -1}));
  }
  return at::cat(parts, 1);
}

// Forwards wider than this many rows (prefill, wide verify forwards) widen the fp16 context to fp64 once, for all
// their rows, where narrower ones widen each row's entries a block at a time (each row re-reads the whole context)
constexpr int64_t kWidenedContextRows = 2;

// rope_write into fp64 queries and the cache's fp64 or fp16 entries, then fused_exact_attention over them (the
// layout's real rows alone)
template <typename T>
Tensor rope_write_exact_attention(const Layer& layer, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& cos, const Tensor& sin, const Tensor& q_out,
                                  const c10::optional<Tensor>& mask, const Tensor& keys, const Tensor& values,
                                  int64_t start, const Layout& l) {
  int64_t end = start + q.size(1);
  if (layer.attention == kExactHalf) {
    rope_write<T, double, c10::Half>(q, k, v, cos, sin, q_out, keys, values, start);
    if (q.size(1) > kWidenedContextRows) {  // the context widened once for all rows (the same numbers)
      return fused_exact_attention<T, double>(q_out, keys.slice(2, 0, end).to(at::kDouble),
                                              values.slice(2, 0, end).to(at::kDouble), mask, layer.scaling, end,
                                              layer.softmax_columns, l);
    }
    return fused_exact_attention<T, c10::Half>(q_out, keys, values, mask, layer.scaling, end, layer.softmax_columns,
                                               l);
  }
  rope_write<T, double, double>(q, k, v, cos, sin, q_out, keys, values, start);
  return fused_exact_attention<T, double>(q_out, keys, values, mask, layer.scaling, end, layer.softmax_columns, l);
}

// The attention block's work between its products with the fused kernels: q and k (after their norms, Qwen3)
// rotated, k and v written to the cache, attention over it. Returns the rows for the output product ([1, N, H * D]
// with the layout's real rows, else [B, T, H * D]), or an undefined tensor where they do not apply (the ATen
// operations run then): bf16 or fp32 layers, cos and sin of their dtype, and exact attention over fp64 (or fp16)
// entries or sdpa over entries of the layers' dtype.
Tensor fused_attention(const Layer& layer, const std::vector<Tensor>& qkv, const Tensor& cos, const Tensor& sin,
                       const c10::optional<Tensor>& mask, const Tensor& keys, const Tensor& values, int64_t start,
                       const Layout& l) {
  const Tensor& x = qkv[0];
  int64_t batch = x.size(0), width = x.size(1), dim = layer.head_dim;
  auto dtype = x.scalar_type();
  bool exact = exact_attention_kind(layer.attention);
  auto entries = layer.attention == kExact ? at::kDouble : layer.attention == kExactHalf ? at::kHalf : dtype;
  if (!fusable(x) || dim % 2 != 0 || dim > kMaxHeadDim || cos.scalar_type() != dtype ||
      sin.scalar_type() != dtype || cos.dim() != 3 || cos.size(0) != batch || cos.size(1) != width ||
      cos.size(2) != dim || !cos.is_contiguous() || !sin.is_contiguous() || cos.sizes() != sin.sizes() ||
      !keys.is_contiguous() || !values.is_contiguous() ||
      keys.scalar_type() != entries || values.scalar_type() != keys.scalar_type() ||
      keys.size(3) != dim || values.size(3) != dim) {
    return Tensor();
  }
  if (exact && mask && (!mask->is_floating_point() || mask->size(0) != batch || mask->size(2) != width)) {
    return Tensor();
  }
  Tensor q = x.view({batch, width, -1, dim});
  Tensor k = qkv[1].view({batch, width, -1, dim}), v = qkv[2].view({batch, width, -1, dim});
  if (layer.q_norm) {
    q = rms_norm(q, *layer.q_norm);
    k = rms_norm(k, *layer.k_norm);
  }
  int64_t end = start + width;
  Tensor q_out = at::empty(q.sizes(), q.options().dtype(exact ? at::kDouble : dtype));
  if (dtype == at::kBFloat16) {
    using T = c10::BFloat16;
    if (exact) {
      return rope_write_exact_attention<T>(layer, q, k, v, cos, sin, q_out, mask, keys, values, start, l);
    }
    rope_write<T, T, T>(q, k, v, cos, sin, q_out, keys, values, start);
  } else {
    if (exact) {
      return rope_write_exact_attention<float>(layer, q, k, v, cos, sin, q_out, mask, keys, values, start, l);
    }
    rope_write<float, float, float>(q, k, v, cos, sin, q_out, keys, values, start);
  }
  return sdpa_rows(q_out.transpose(1, 2), keys.slice(2, 0, end), values.slice(2, 0, end), mask, layer.scaling,
                   layer.kv_groups, l);
}

// CompactForward._attention with apply_rotary_pos_emb, SlotCache.write (native.py: `SlotCache.native_storage`) and
// the model's attention function.
// Where q and k are adjacent columns of one fused product and no per-head norm comes between (Llama, Mistral,
// Qwen2), RoPE runs once over both: every element gets the same operations on the same numbers as in two calls.
Tensor attention(const Layer& layer, const Tensor& hidden, const Tensor& cos, const Tensor& sin, const Tensor& c,
                 const Tensor& s, const c10::optional<Tensor>& mask, Tensor& keys, Tensor& values, int64_t start,
                 const MaskRows& m, const Layout& l) {
  int64_t batch = l.batch, width = l.width, dim = layer.head_dim;
  Tensor query, key;
  std::vector<Tensor> qkv;
  Tensor whole;
  bool adjacent = layer.qkv.size() == 1 && !layer.q_norm;
  qkv = adjacent ? product(layer.qkv[0], hidden, m, &whole) : products(layer.qkv, hidden, m);
  if (l.real) {  // attention reads the padded layout
    if (adjacent) {
      whole = scatter(whole, l);
      qkv = whole.split_with_sizes(layer.qkv[0].splits, -1);
    } else {
      for (Tensor& x : qkv) x = scatter(x, l);
    }
  }
  Tensor fused = fused_attention(layer, qkv, cos, sin, mask, keys, values, start, l);
  if (fused.defined()) return product(layer.o, fused, m)[0];
  if (adjacent) {
    int64_t heads = qkv[0].size(-1) / dim, kv_heads = qkv[1].size(-1) / dim;
    Tensor both = rotary(whole.slice(-1, 0, (heads + kv_heads) * dim).view({batch, width, -1, dim}).transpose(1, 2),
                         c, s);
    query = both.slice(1, 0, heads);
    key = both.slice(1, heads);
  } else {
    query = qkv[0].view({batch, width, -1, dim});
    key = qkv[1].view({batch, width, -1, dim});
    if (layer.q_norm) {
      query = rms_norm(query, *layer.q_norm);
      key = rms_norm(key, *layer.k_norm);
    }
    query = rotary(query.transpose(1, 2), c, s);
    key = rotary(key.transpose(1, 2), c, s);
  }
  Tensor value = qkv[2].view({batch, width, -1, dim}).transpose(1, 2);
  int64_t end = start + width;
  keys.slice(2, start, end).copy_(key);
  values.slice(2, start, end).copy_(value);
  Tensor context_keys = keys.slice(2, 0, end), context_values = values.slice(2, 0, end);
  if (layer.attention == kExactHalf) {  // row_exact.exact_half_attention: the entries rounded to fp16 (if not yet)
    context_keys = context_keys.to(at::kHalf);
    context_values = context_values.to(at::kHalf);
  }
  Tensor out = exact_attention_kind(layer.attention)
                   ? gather(exact_attention(query, context_keys, context_values, mask, layer.scaling,
                                            layer.softmax_columns)
                                .reshape({batch, width, -1}),
                            l)
                   : sdpa_rows(query, context_keys, context_values, mask, layer.scaling, layer.kv_groups, l);
  return product(layer.o, out, m)[0];
}

// CompactForward._mlp
Tensor mlp(const Layer& layer, const Tensor& hidden, const MaskRows& m) {
  std::vector<Tensor> gate_up = products(layer.gate_up, hidden, m);
  return product(layer.down, at::silu(gate_up[0]) * gate_up[1], m)[0];
}

// A tensor the layers read, as a module holds it: (the module's parameter or buffer dict, name, tensor).
struct Source {
  py::dict tensors;
  py::str name;
  py::object tensor;
  Tensor value;
  std::pair<int64_t, int64_t> key;  // row_exact.weight_key when the stack was built
};

// A model's decoder layers with the tensors they read (native.NativeLayers).
class Stack {
 public:
  Stack(std::vector<Layer> layers, const std::vector<py::tuple>& sources, const std::vector<py::tuple>& kinds)
      : layers_(std::move(layers)) {
    for (const py::tuple& k : kinds) kinds_.emplace_back(k[0], k[1]);
    for (const py::tuple& s : sources) {
      Tensor value = s[2].cast<Tensor>();
      sources_.push_back(Source{s[0].cast<py::dict>(), s[1].cast<py::str>(), s[2], value, key_of(value)});
    }
  }

  // whether every source is still the tensor its module holds, unwritten and in place, and every linear layer
  // still of the type it had, since the stack was built
  bool fresh() const {
    for (const Source& s : sources_) {
      PyObject* held = PyDict_GetItem(s.tensors.ptr(), s.name.ptr());  // borrowed
      if (held != s.tensor.ptr() || key_of(s.value) != s.key) return false;
    }
    for (const auto& [layer, type] : kinds_) {
      if (reinterpret_cast<PyObject*>(Py_TYPE(layer.ptr())) != type.ptr()) return false;
    }
    return true;
  }

  // CompactForward.__call__'s layer loop: hidden [B, T, hidden] in, hidden out (with `real`, a padded [batch, width]
  // forward's real rows alone: [1, N, hidden]; Layout); masks: one per layer (or None); keys, values: each layer's
  // cache storage, the forward's entries written at columns [start, start + T)
  Tensor forward(Tensor hidden, const Tensor& cos, const Tensor& sin, const std::vector<c10::optional<Tensor>>& masks,
                 std::vector<Tensor> keys, std::vector<Tensor> values, int64_t start, bool mask_active,
                 bool mask_gated, bool mask_kernel, c10::optional<Tensor> mask_dense,
                 c10::optional<Tensor> mask_rows,
                 c10::optional<Tensor> real, int64_t batch, int64_t width, std::vector<int64_t> split) const {
    TORCH_CHECK(masks.size() == layers_.size() && keys.size() == layers_.size() && values.size() == layers_.size(),
                "one mask, key and value storage per layer");
    TORCH_CHECK(real ? real->numel() == hidden.size(1) : hidden.size(0) == batch && hidden.size(1) == width,
                "hidden holds the forward's rows: all of them, or the real ones listed");
    MaskRows m{mask_active, mask_gated, mask_kernel, mask_dense, mask_rows};
    TORCH_CHECK(split.empty() || (real && static_cast<int64_t>(split.size()) == batch),
                "a split forward lists its real rows and each row's count");
    Layout l{real, batch, width, std::move(split)};
    if (layers_.empty()) return hidden;
    Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
    // each residual add is done with the norm after it (add_rms_norm), the last one alone
    Tensor normed = rms_norm(hidden, layers_[0].input);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      Tensor out = attention(layer, normed, cos, sin, c, s, masks[i], keys[i], values[i], start, m, l);
      std::tie(hidden, normed) = add_rms_norm(hidden, out, layer.post);
      out = mlp(layer, normed, m);
      if (i + 1 < layers_.size()) {
        std::tie(hidden, normed) = add_rms_norm(hidden, out, layers_[i + 1].input);
      } else {
        hidden = hidden + out;
      }
    }
    return hidden;
  }

 private:
  static std::pair<int64_t, int64_t> key_of(const Tensor& t) {
    return {reinterpret_cast<int64_t>(t.const_data_ptr()),
            t.is_inference() ? -1 : static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version())};
  }

  std::vector<Layer> layers_;
  std::vector<std::pair<py::object, py::object>> kinds_;  // (linear layer, its type)
  std::vector<Source> sources_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Update>(m, "Update").def(py::init<int64_t, Tensor, Tensor>());
  m.def("block_linear", &refusion::block_linear, "x @ w.T (+ bias) for fp32 rows and a GGUF file's blocks of w "
        "(block_products.cpp)", py::arg("x"), py::arg("q"), py::arg("dm"), py::arg("tail"), py::arg("bias"),
        py::arg("int8_rows") = false);
  m.def("blocks_vectorized", &refusion::blocks_vectorized, "whether block_linear runs vectorized here");
  m.def("mask_update", &mask_update, "out[rows] += (x[rows] @ a) @ b, a mask-gated adapter's update (see above)");
  py::class_<Product>(m, "Product")
      .def(py::init<int64_t, Tensor, Tensor, c10::optional<Tensor>, int64_t, int64_t, int64_t, std::vector<int64_t>,
                    std::vector<Update>, Tensor, Tensor, std::vector<int64_t>>());
  py::class_<Norm>(m, "Norm").def(py::init<Tensor, double>());
  py::class_<Layer>(m, "Layer")
      .def(py::init<Norm, Norm, c10::optional<Norm>, c10::optional<Norm>, std::vector<Product>, Product,
                    std::vector<Product>, Product, int64_t, double, int64_t, int64_t, int64_t>());
  py::class_<Stack>(m, "Stack")
      .def(py::init<std::vector<Layer>, const std::vector<py::tuple>&, const std::vector<py::tuple>&>())
      .def("fresh", &Stack::fresh)
      .def("forward", &Stack::forward, py::call_guard<py::gil_scoped_release>());  // other threads run meanwhile
}
