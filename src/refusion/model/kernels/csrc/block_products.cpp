// Products by a GGUF file's weight blocks with fp32 activations: the linear kernel "int4" of fp32 models
// (refusion/model/kernels/int4.py says where it runs).
//
// A block of 32 weights is dequantized to fp32 as gguf dequantizes it (d * q is exact in fp32; + m rounds once; d and m
// are the file's fp16 numbers, or -8 d for Q4_0, also exact in fp16), and
// every output element out[r, n] is summed the same way whatever the rows, the outputs and the threads of the call:
// 8 lanes, lane l accumulating x[r, k] * w[n, k] over k = l (mod 8) in increasing k with fused multiply-adds, then
// the lanes added in a fixed tree. So each row comes out bit for bit as it would alone (the exact mode's verify rows
// are AR's one-row forwards), with AVX2 and FMA on x86 and lane by lane with std::fma elsewhere: the same bits.
//
// Each call reads the weights once: a tile of kTile outputs is dequantized into a buffer that every row is then
// multiplied by, three or two rows by four outputs at a time, or one row by eight. Rows of the weight that the file
// has no blocks for (an LM head grown by added tokens) follow the blocks' as fp32 rows, summed the same way.

#include "block_products.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define REFUSION_X86_BLOCKS 1
#endif

namespace refusion {
namespace {

constexpr int64_t kBlock = 32;     // weights per block
constexpr int64_t kLanes = 8;      // lanes of each accumulator
constexpr int64_t kTile = 8;       // outputs dequantized together (N must be a multiple)
constexpr int64_t kRowBlock = 64;  // rows multiplied by a tile before the next rows (kept in the CPU cache)
constexpr int64_t kMaxBlocks = 2048;  // blocks per row of the weight (K up to 65,536 features)

// ------------------------------------------------------------------------------------------------ any CPU
// w[k] of one output: 4-bit blocks (16 bytes each) or 8-bit ones (32 signed bytes each)
void dequantize_portable(const uint8_t* q, bool four_bit, const at::Half* dm, int64_t K, float* w) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float d = static_cast<float>(dm[2 * b]), m = static_cast<float>(dm[2 * b + 1]);
    for (int64_t j = 0; j < kBlock; ++j) {
      int v;
      if (four_bit) {
        uint8_t byte = q[b * 16 + j % 16];
        v = j < 16 ? (byte & 15) : (byte >> 4);
      } else {
        v = static_cast<int8_t>(q[b * kBlock + j]);
      }
      w[b * kBlock + j] = std::fma(static_cast<float>(v), d, m);
    }
  }
}

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the tree the AVX2 sum below adds in
float lanes_sum(const float* lanes) {
  float t0 = lanes[0] + lanes[4], t1 = lanes[1] + lanes[5], t2 = lanes[2] + lanes[6], t3 = lanes[3] + lanes[7];
  return (t0 + t2) + (t1 + t3);
}

void tile_portable(const float* x, int64_t rows, int64_t K, const float* w, float* out, int64_t N) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < kTile; ++o) {
      float acc[kLanes] = {};
      for (int64_t k = 0; k < K; k += kLanes) {
        for (int64_t l = 0; l < kLanes; ++l) acc[l] = std::fma(w[o * K + k + l], x[r * K + k + l], acc[l]);
      }
      out[r * N + o] = lanes_sum(acc);
    }
  }
}

#ifdef REFUSION_X86_BLOCKS
// ------------------------------------------------------------------------------------------------ AVX2 and FMA
#define REFUSION_AVX2 __attribute__((target("avx2,fma,f16c")))

// the four vectors of weights 8i..8i+7 of block b of one output's row of blocks: (float) q * d + m
REFUSION_AVX2 inline void block_weights_avx2(const uint8_t* q, bool four_bit, int64_t b, __m256 d, __m256 m,
                                             __m256* w) {
  __m256i v[4];
  if (four_bit) {
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    __m128i low = _mm_and_si128(raw, nibble), high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
    v[0] = _mm256_cvtepu8_epi32(low);
    v[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(low, 8));
    v[2] = _mm256_cvtepu8_epi32(high);
    v[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(high, 8));
  } else {
    __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock));
    __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * kBlock + 16));
    v[0] = _mm256_cvtepi8_epi32(first);
    v[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(first, 8));
    v[2] = _mm256_cvtepi8_epi32(second);
    v[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(second, 8));
  }
  for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v[i]), d, m);
}

REFUSION_AVX2 void dequantize_avx2(const uint8_t* q, bool four_bit, const at::Half* half_dm, int64_t K, float* w) {
  float dm[kMaxBlocks * 2];  // the row's (d, m) widened to fp32, 8 at a time
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(half_dm);
  int64_t i = 0;
  for (; i + 8 <= (K / kBlock) * 2; i += 8) {
    _mm256_storeu_ps(dm + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bits + i))));
  }
  for (; i < (K / kBlock) * 2; ++i) dm[i] = _cvtsh_ss(bits[i]);
  for (int64_t b = 0; b < K / kBlock; ++b) {
    __m256 values[4];
    block_weights_avx2(q, four_bit, b, _mm256_set1_ps(dm[2 * b]), _mm256_set1_ps(dm[2 * b + 1]), values);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(w + b * kBlock + j * kLanes, values[j]);
  }
}

REFUSION_AVX2 inline float sum_avx2(__m256 acc) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));  // t_i = l_i + l_{i+4}
  __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));                                       // t0 + t2, t1 + t3
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
}

// out[r * N + o] for RT rows of x and OT outputs of w
template <int RT, int OT>
REFUSION_AVX2 inline void dot_avx2(const float* x, int64_t K, const float* w, float* out, int64_t N) {
  __m256 acc[RT][OT];
  for (int r = 0; r < RT; ++r)
    for (int o = 0; o < OT; ++o) acc[r][o] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    __m256 xv[RT];
    for (int r = 0; r < RT; ++r) xv[r] = _mm256_loadu_ps(x + r * K + k);
    for (int o = 0; o < OT; ++o) {
      __m256 wv = _mm256_loadu_ps(w + o * K + k);
      asm("" : "+x"(wv));  // one load into a register, not one per row folded into the multiply-adds
      for (int r = 0; r < RT; ++r) acc[r][o] = _mm256_fmadd_ps(wv, xv[r], acc[r][o]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int o = 0; o < OT; ++o) out[r * N + o] = sum_avx2(acc[r][o]);
}

REFUSION_AVX2 void tile_avx2(const float* x, int64_t rows, int64_t K, const float* w, float* out, int64_t N) {
  int64_t r = 0;
  for (; r + 3 <= rows; r += 3) {
    dot_avx2<3, 4>(x + r * K, K, w, out + r * N, N);
    dot_avx2<3, 4>(x + r * K, K, w + 4 * K, out + r * N + 4, N);
  }
  for (; r + 2 <= rows; r += 2) {
    dot_avx2<2, 4>(x + r * K, K, w, out + r * N, N);
    dot_avx2<2, 4>(x + r * K, K, w + 4 * K, out + r * N + 4, N);
  }
  if (r < rows) dot_avx2<1, 8>(x + r * K, K, w, out + r * N, N);
}

bool has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
}
#else
bool has_avx2() { return false; }
void dequantize_avx2(const uint8_t*, bool, const at::Half*, int64_t, float*) {}
void tile_avx2(const float*, int64_t, int64_t, const float*, float*, int64_t) {}
#endif

}  // namespace

bool blocks_vectorized() { return has_avx2(); }

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm,
                        const c10::optional<at::Tensor>& tail, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && dm.scalar_type() == at::kHalf,
              "block_linear: fp32 rows and fp16 scales");
  const int64_t K = x.size(-1), blocked = q.size(0);
  const bool four_bit = q.scalar_type() == at::kByte;
  TORCH_CHECK(four_bit || q.scalar_type() == at::kChar, "block_linear: uint8 (4-bit) or int8 (8-bit) blocks");
  TORCH_CHECK(K % kBlock == 0 && K <= kMaxBlocks * kBlock && blocked % kTile == 0 && q.size(1) == (four_bit ? K / 2 : K) &&
                  dm.numel() == blocked * (K / kBlock) * 2,
              "block_linear: blocks of shape ", q.sizes(), " for rows of ", K, " features");
  TORCH_CHECK(q.is_contiguous() && dm.is_contiguous(), "block_linear: contiguous blocks");
  at::Tensor dense = tail ? tail->contiguous() : at::empty({0, K}, x.options());
  TORCH_CHECK(dense.scalar_type() == at::kFloat && dense.dim() == 2 && dense.size(1) == K,
              "block_linear: fp32 tail rows of ", K, " features");
  const int64_t extra = dense.size(0), N = blocked + extra;
  at::Tensor flat = x.reshape({-1, K}).contiguous();
  const int64_t rows = flat.size(0);
  at::Tensor out = at::empty({rows, N}, x.options());
  if (rows > 0) {
    const float* xs = flat.data_ptr<float>();
    const uint8_t* qs = reinterpret_cast<const uint8_t*>(q.data_ptr());
    const at::Half* dms = dm.data_ptr<at::Half>();
    const float* tails = dense.data_ptr<float>();
    float* outs = out.data_ptr<float>();
    const int64_t q_row = q.size(1), dm_row = (K / kBlock) * 2, tiles = blocked / kTile;
    const bool avx2 = has_avx2();
    auto tile = avx2 ? tile_avx2 : tile_portable;
    at::parallel_for(0, tiles + (extra + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> w(kTile * K);
      std::vector<float> last;  // a tail tile's outputs, of which the first `extra % kTile` are kept
      for (int64_t t = begin; t < end; ++t) {
        int64_t count = kTile;  // outputs of this tile
        if (t < tiles) {
          for (int64_t o = 0; o < kTile; ++o) {
            int64_t n = t * kTile + o;
            (avx2 ? dequantize_avx2 : dequantize_portable)(qs + n * q_row, four_bit, dms + n * dm_row, K,
                                                           w.data() + o * K);
          }
        } else {  // the dense rows as they are (zero rows after the last)
          int64_t first = (t - tiles) * kTile;
          count = std::min(kTile, extra - first);
          std::fill(w.begin(), w.end(), 0.0f);
          std::copy(tails + first * K, tails + (first + count) * K, w.begin());
        }
        for (int64_t r = 0; r < rows; r += kRowBlock) {
          int64_t chunk = std::min(kRowBlock, rows - r);
          if (count == kTile) {
            tile(xs + r * K, chunk, K, w.data(), outs + r * N + t * kTile, N);
            continue;
          }
          last.resize(chunk * kTile);
          tile(xs + r * K, chunk, K, w.data(), last.data(), kTile);
          for (int64_t i = 0; i < chunk; ++i) {
            std::copy(last.begin() + i * kTile, last.begin() + i * kTile + count, outs + (r + i) * N + t * kTile);
          }
        }
      }
    });
  }
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = N;
  out = out.view(shape);
  return bias ? out + *bias : out;
}

}  // namespace refusion
