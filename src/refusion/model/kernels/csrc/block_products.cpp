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
// multiplied by, three or two rows by four outputs at a time (a last row by eight); a call of one row multiplies
// each output's blocks as they are widened in registers (row_tile_avx2). Rows of the weight that the file has no
// blocks for (an LM head grown by added tokens) follow the blocks' as fp32 rows, summed the same way.
//
// With int8_rows ("int4-q8") the rows are rounded to 8-bit blocks and each block pair's bytes multiply in integers
// (tile8_portable says in which order the sums are taken). The AVX2 path widens a tile's scales and offsets to fp32
// once, transposed (tile_scales_avx2), reads the blocks straight from memory for up to eight rows at a time, and sums
// the offsets of the tile's outputs in the lanes of one vector per row.

#include "block_products.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <memory>
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
// asks the CPU to bring `bytes` from `p` on into its cache (a hint: no effect on any result)
inline void fetch_ahead(const void* p, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* first = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(first + line);
  if (bytes > 0) __builtin_prefetch(first + bytes - 1);  // the last line, where `p` starts mid-line
#endif
}

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

// ------------------------------------------------------------------------------------------------ 8-bit rows
// With `int8_rows` (the kernel "int4-q8") each row is first rounded to blocks of 32 signed bytes, as llama.cpp rounds
// the activations it multiplies by its 4-bit blocks (its Q8_1, with d and s kept in fp32): per block
// d = amax / 127, q = nearest-even(x * (127 / amax)), s = d * sum(q). A weight block times a row block is then
//   (d_w * d) * sum(w_q * q) + m_w * s,
// the sum of byte products an exact integer. Its 32 products go to 8 lanes of four (lane l: weights 4l..4l+3), each
// lane a fused multiply-add of its integer by the block's scale into its accumulator in increasing block order, the
// lanes then added in the fixed tree, then the offsets' term (fused multiply-adds over the blocks in increasing
// order) added last: the same whatever the rows, outputs and threads, so each row is still computed as alone.

struct Rows8 {
  std::vector<int8_t> q;  // [rows, K] the rows' bytes
  std::vector<float> d;   // [rows, K / 32] their blocks' scales
  std::vector<float> s;   // [rows, K / 32] d * the sum of the block's bytes
};

void quantize_block_portable(const float* x, int8_t* q, float* d, float* s) {
  float amax = 0.0f;
  for (int64_t j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int64_t j = 0; j < kBlock; ++j) {
    const int v = static_cast<int>(std::nearbyint(x[j] * id));
    q[j] = static_cast<int8_t>(v);
    sum += v;
  }
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(sum);
}

// One output tile of 8-bit products: each output's weights widened to one byte each (`w` [kTile, K]: 0..15 or
// -128..127), their block scales dw [kTile, B] and the offsets transposed, mt [B, kTile].
struct Tile8 {
  std::vector<int8_t> w;
  std::vector<float> dw, mt;
};

void unpack_tile_portable(const uint8_t* q, bool four_bit, const at::Half* dm, int64_t K, int64_t q_row,
                          int64_t dm_row, Tile8& t) {
  const int64_t B = K / kBlock;
  for (int64_t o = 0; o < kTile; ++o) {
    const uint8_t* row = q + o * q_row;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t j = 0; j < kBlock; ++j) {
        int v = four_bit ? (j < 16 ? row[b * 16 + j] & 15 : row[b * 16 + j - 16] >> 4)
                         : static_cast<int8_t>(row[b * kBlock + j]);
        t.w[o * K + b * kBlock + j] = static_cast<int8_t>(v);
      }
      t.dw[o * B + b] = static_cast<float>(dm[o * dm_row + 2 * b]);
      t.mt[b * kTile + o] = static_cast<float>(dm[o * dm_row + 2 * b + 1]);
    }
  }
}

// out[r * N + o] for the tile's outputs and `rows` rows (the rows' blocks at `y`, `yd`, `ys`)
void tile8_portable(const int8_t* y, const float* yd, const float* ys, int64_t rows, int64_t K, const Tile8& t,
                    float* out, int64_t N) {
  const int64_t B = K / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t o = 0; o < kTile; ++o) {
      float acc[kLanes] = {};
      float offsets = 0.0f;
      for (int64_t b = 0; b < B; ++b) {
        const float scale = t.dw[o * B + b] * yd[r * B + b];
        const int8_t* w = t.w.data() + o * K + b * kBlock;
        const int8_t* v = y + r * K + b * kBlock;
        for (int64_t l = 0; l < kLanes; ++l) {
          int sum = 0;
          for (int64_t e = 4 * l; e < 4 * l + 4; ++e) sum += static_cast<int>(w[e]) * static_cast<int>(v[e]);
          acc[l] = std::fma(static_cast<float>(sum), scale, acc[l]);
        }
        offsets = std::fma(t.mt[b * kTile + o], ys[r * B + b], offsets);
      }
      out[r * N + o] = lanes_sum(acc) + offsets;
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

REFUSION_AVX2 void quantize_block_avx2(const float* x, int8_t* q, float* d, float* s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + i * kLanes);
  __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                           _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
  const float amax = _mm_cvtss_f32(h);
  const __m256 id = _mm256_set1_ps(amax != 0.0f ? 127.0f / amax : 0.0f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) {
    i[k] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[k], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  __m256i total = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_unpackhi_epi64(t, t));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 1));
  // packing interleaves the 128-bit halves: the permutation puts the 32 bytes back in order
  __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  packed = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), packed);
  *d = amax / 127.0f;
  *s = *d * static_cast<float>(_mm_cvtsi128_si32(t));
}

// block b of one output's row of blocks as 32 bytes: 0..15 (4-bit blocks) or -128..127 (8-bit)
template <bool FOUR>
REFUSION_AVX2 inline __m256i block_bytes(const uint8_t* q, int64_t b, __m256i nibble) {
  if (FOUR) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nibble);
  }
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * kBlock));
}

// the 8 lanes of a block's byte products w·v, lane l summing the products 4l..4l+3 exactly, as fp32
template <bool FOUR>
REFUSION_AVX2 inline __m256 block_sum(__m256i w, __m256i v, __m256i ones) {
  __m256i pairs = FOUR ? _mm256_maddubs_epi16(w, v)  // 0..15 times a signed byte
                       : _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(v, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
}

// [d0..d7 | m0..m7] of the 8 words (d, m) of one block's outputs, widened to fp32: d to d[0..7], m to m[0..7]
REFUSION_AVX2 inline void split_scales(__m256i pairs, float* d, float* m) {
  // [d0..d3 m0..m3 | d4..d7 m4..m7] as 16-bit halves, then [d0..d7 | m0..m7]
  const __m256i halves = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_and_si256(pairs, _mm256_set1_epi32(0xffff)), _mm256_srli_epi32(pairs, 16)), 0xd8);
  _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm256_castsi256_si128(halves)));
  _mm256_storeu_ps(m, _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1)));
}

// One tile's block scales and offsets widened to fp32 and transposed block by block, d[b * kTile + o] and m[...]
// likewise: eight blocks of the kTile outputs' (d, m) words at a time, transposed in registers; the next tile's are
// fetched meanwhile
REFUSION_AVX2 void tile_scales_avx2(const at::Half* half_dm, int64_t dm_row, float* d, float* m) {
  const int64_t B = dm_row / 2;
  fetch_ahead(half_dm + kTile * dm_row, kTile * dm_row * static_cast<int64_t>(sizeof(at::Half)));
  const int* words = reinterpret_cast<const int*>(half_dm);  // (d, m) of block b of output o: words[o * B + b]
  if (B < 8) {
    for (int64_t b = 0; b < B; ++b) {
      split_scales(_mm256_setr_epi32(words[b], words[B + b], words[2 * B + b], words[3 * B + b], words[4 * B + b],
                                     words[5 * B + b], words[6 * B + b], words[7 * B + b]),
                   d + b * kTile, m + b * kTile);
    }
    return;
  }
  for (int64_t group = 0; group < B; group += 8) {
    const int64_t b = std::min(group, B - 8);  // the last eight blocks end the row (some written twice, the same)
    __m256i t[8], u[8];
    for (int o = 0; o < 8; ++o) t[o] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + o * B + b));
    for (int o = 0; o < 8; o += 2) {
      u[o] = _mm256_unpacklo_epi32(t[o], t[o + 1]);
      u[o + 1] = _mm256_unpackhi_epi32(t[o], t[o + 1]);
    }
    for (int o = 0; o < 8; o += 4) {
      t[o] = _mm256_unpacklo_epi64(u[o], u[o + 2]);
      t[o + 1] = _mm256_unpackhi_epi64(u[o], u[o + 2]);
      t[o + 2] = _mm256_unpacklo_epi64(u[o + 1], u[o + 3]);
      t[o + 3] = _mm256_unpackhi_epi64(u[o + 1], u[o + 3]);
    }
    // t[i] and t[4 + i]: blocks i and 4 + i of outputs 0..3 and 4..7 in their two halves
    for (int i = 0; i < 4; ++i) {
      split_scales(_mm256_permute2x128_si256(t[i], t[4 + i], 0x20), d + (b + i) * kTile, m + (b + i) * kTile);
      split_scales(_mm256_permute2x128_si256(t[i], t[4 + i], 0x31), d + (b + 4 + i) * kTile, m + (b + 4 + i) * kTile);
    }
  }
}

// Every loop over the rows or outputs of direct8_avx2 is unrolled before the compiler places its sums: otherwise GCC
// keeps them in memory as well as in registers and stores them at every block step.
#define REFUSION_UNROLL _Pragma("GCC unroll 8")

// RT rows by OT outputs (from `q`, rows q_row apart, whose block scales are `d`: tile_scales_avx2's), each output's
// blocks widened in registers as they are read: the lane sums tile8_portable adds, in its order (every (row, output)
// its own chain of multiply-adds: OT * RT chains side by side), without the offsets
template <int RT, int OT, bool FOUR>
REFUSION_AVX2 inline void direct8_avx2(const int8_t* y, const float* yd, int64_t K, const uint8_t* q, int64_t q_row,
                                       const float* d, float* out, int64_t N) {
  const int64_t B = K / kBlock;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i nibble = _mm256_set1_epi8(15);
  __m256 acc[RT][OT];
  REFUSION_UNROLL for (int r = 0; r < RT; ++r)
    REFUSION_UNROLL for (int o = 0; o < OT; ++o) acc[r][o] = _mm256_setzero_ps();
  // The OT outputs' rows of blocks lie one after another in memory, and the next OT outputs' right after them: each
  // block step fetches as many bytes of the next outputs' rows as it reads of these, so the next call finds them in
  // the CPU cache (each output's row alone is too short a stream for the hardware to fetch ahead of it).
  constexpr int64_t kStep = OT * (FOUR ? kBlock / 2 : kBlock);  // bytes of blocks each step reads
  const char* ahead = reinterpret_cast<const char*>(q + OT * q_row);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t line = 0; line < kStep; line += 64) _mm_prefetch(ahead + b * kStep + line, _MM_HINT_T0);
    REFUSION_UNROLL for (int o = 0; o < OT; ++o) {  // each output's block widened and taken by every row in turn
      const __m256i w = block_bytes<FOUR>(q + o * q_row, b, nibble);
      const __m256 scale = _mm256_broadcast_ss(d + b * kTile + o);  // the block's scale, in every lane
      REFUSION_UNROLL for (int r = 0; r < RT; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y + r * K + b * kBlock));
        // d_w * d rounded once, as the row alone rounds it
        acc[r][o] = _mm256_fmadd_ps(block_sum<FOUR>(w, v, ones),
                                    _mm256_mul_ps(scale, _mm256_broadcast_ss(yd + r * B + b)), acc[r][o]);
      }
    }
  }
  REFUSION_UNROLL for (int r = 0; r < RT; ++r)
    REFUSION_UNROLL for (int o = 0; o < OT; ++o) out[r * N + o] = sum_avx2(acc[r][o]);
}

// up to eight rows of one tile's kTile outputs: the more rows, the fewer outputs at a time (the sums stay in registers)
template <bool FOUR>
REFUSION_AVX2 void direct8_tile_avx2(const int8_t* y, const float* yd, int64_t rows, int64_t K, const uint8_t* q,
                                     int64_t q_row, const float* d, float* out, int64_t N) {
  auto outputs = [&](auto product, int64_t step) {
    for (int64_t o = 0; o < kTile; o += step) product(y, yd, K, q + o * q_row, q_row, d + o, out + o, N);
  };
  switch (rows) {
    case 1: return outputs(direct8_avx2<1, 4, FOUR>, 4);
    case 2: return outputs(direct8_avx2<2, 4, FOUR>, 4);
    case 3: return outputs(direct8_avx2<3, 2, FOUR>, 2);
    case 4: return outputs(direct8_avx2<4, 2, FOUR>, 2);
    case 5: return outputs(direct8_avx2<5, 1, FOUR>, 1);
    case 6: return outputs(direct8_avx2<6, 1, FOUR>, 1);
    case 7: return outputs(direct8_avx2<7, 1, FOUR>, 1);
    default: return outputs(direct8_avx2<8, 1, FOUR>, 1);
  }
}

// one tile's kTile outputs for every row, eight rows at a time (the tile's blocks stay in the CPU cache), then each
// row's offsets sum_b m[o, b] * s[r, b], the tile's outputs in the lanes of one vector, added to its lane sums
REFUSION_AVX2 void tile8_avx2(const int8_t* y, const float* yd, const float* ys, int64_t rows, int64_t K,
                              const uint8_t* q, int64_t q_row, bool four_bit, const at::Half* dm, int64_t dm_row,
                              float* scales, float* out, int64_t N) {
  const int64_t B = K / kBlock;
  float* d = scales;
  float* m = scales + B * kTile;
  tile_scales_avx2(dm, dm_row, d, m);
  for (int64_t r = 0; r < rows; r += 8) {
    auto product = four_bit ? direct8_tile_avx2<true> : direct8_tile_avx2<false>;
    product(y + r * K, yd + r * B, std::min<int64_t>(8, rows - r), K, q, q_row, d, out + r * N, N);
  }
  for (int64_t r = 0; r < rows; ++r) {
    __m256 offsets = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      offsets = _mm256_fmadd_ps(_mm256_loadu_ps(m + b * kTile), _mm256_broadcast_ss(ys + r * B + b), offsets);
    }
    _mm256_storeu_ps(out + r * N, _mm256_add_ps(_mm256_loadu_ps(out + r * N), offsets));
  }
}

// One row of fp32 times one tile's kTile outputs without widening the tile into a buffer: each output's block is
// widened in registers (as dequantize_avx2 widens it, from tile_scales_avx2's scales and offsets) and multiplied by
// the row's at once, four outputs side by side: the sums dot_avx2 adds, in its order (so the same bits as the tile)
REFUSION_AVX2 void row_tile_avx2(const float* x, int64_t K, const uint8_t* q, int64_t q_row, bool four_bit,
                                 const at::Half* dm, int64_t dm_row, float* scales, float* out) {
  const int64_t B = K / kBlock;
  float* d = scales;
  float* m = scales + B * kTile;
  tile_scales_avx2(dm, dm_row, d, m);
  for (int64_t first = 0; first < kTile; first += 4) {
    __m256 acc[4];
    REFUSION_UNROLL for (int o = 0; o < 4; ++o) acc[o] = _mm256_setzero_ps();
    const uint8_t* next = q + (first + 4) * q_row;  // the next outputs' blocks, fetched as these are read
    const int64_t step = four_bit ? 4 * kBlock / 2 : 4 * kBlock;
    for (int64_t b = 0; b < B; ++b) {
      fetch_ahead(next + b * step, step);
      REFUSION_UNROLL for (int o = 0; o < 4; ++o) {
        __m256 w[4];
        block_weights_avx2(q + (first + o) * q_row, four_bit, b, _mm256_broadcast_ss(d + b * kTile + first + o),
                           _mm256_broadcast_ss(m + b * kTile + first + o), w);
        REFUSION_UNROLL for (int j = 0; j < 4; ++j) {
          acc[o] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + b * kBlock + j * kLanes), acc[o]);
        }
      }
    }
    REFUSION_UNROLL for (int o = 0; o < 4; ++o) out[first + o] = sum_avx2(acc[o]);
  }
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
void row_tile_avx2(const float*, int64_t, const uint8_t*, int64_t, bool, const at::Half*, int64_t, float*, float*) {}
void quantize_block_avx2(const float*, int8_t*, float*, float*) {}
void tile8_avx2(const int8_t*, const float*, const float*, int64_t, int64_t, const uint8_t*, int64_t, bool,
                const at::Half*, int64_t, float*, float*, int64_t) {}
#endif

}  // namespace

bool blocks_vectorized() { return has_avx2(); }

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm,
                        const c10::optional<at::Tensor>& tail, const c10::optional<at::Tensor>& bias,
                        bool int8_rows) {
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
    const int64_t B = K / kBlock;
    Rows8 rows8;  // int8_rows: the rows rounded to 8-bit blocks, once for every tile
    if (int8_rows) {
      rows8.q.resize(rows * K);
      rows8.d.resize(rows * B);
      rows8.s.resize(rows * B);
      auto quantize = avx2 ? quantize_block_avx2 : quantize_block_portable;
      at::parallel_for(0, rows * B, 256, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          quantize(xs + i * kBlock, rows8.q.data() + i * kBlock, rows8.d.data() + i, rows8.s.data() + i);
        }
      });
    }
    at::parallel_for(0, tiles + (extra + kTile - 1) / kTile, 1, [&](int64_t begin, int64_t end) {
      std::unique_ptr<float[]> w;  // the fp32 tile (allocated on first use, not zeroed: every use writes it first)
      std::vector<float> last;  // a tail tile's outputs, of which the first `extra % kTile` are kept
      Tile8 t8;
      std::vector<float> scales(avx2 ? 2 * B * kTile : 0);  // the AVX2 paths' tile scales and offsets
      if (int8_rows && !avx2) {
        t8.w.resize(kTile * K);
        t8.dw.resize(kTile * B);
        t8.mt.resize(B * kTile);
      }
      for (int64_t t = begin; t < end; ++t) {
        int64_t count = kTile;  // outputs of this tile
        if (t < tiles && int8_rows) {
          const int64_t n = t * kTile;
          if (avx2) {
            tile8_avx2(rows8.q.data(), rows8.d.data(), rows8.s.data(), rows, K, qs + n * q_row, q_row, four_bit,
                       dms + n * dm_row, dm_row, scales.data(), outs + n, N);
            continue;
          }
          unpack_tile_portable(qs + n * q_row, four_bit, dms + n * dm_row, K, q_row, dm_row, t8);
          tile8_portable(rows8.q.data(), rows8.d.data(), rows8.s.data(), rows, K, t8, outs + n, N);
          continue;
        }
        if (t < tiles && rows == 1 && avx2) {  // one row: no tile widened into memory
          const int64_t n = t * kTile;
          row_tile_avx2(xs, K, qs + n * q_row, q_row, four_bit, dms + n * dm_row, dm_row, scales.data(), outs + n);
          continue;
        }
        if (!w) w.reset(new float[kTile * K]);
        if (t < tiles) {
          for (int64_t o = 0; o < kTile; ++o) {
            int64_t n = t * kTile + o;
            if (t + 1 < tiles) {  // the same output of the next tile, fetched while this one is widened
              fetch_ahead(qs + (n + kTile) * q_row, q_row);
              fetch_ahead(dms + (n + kTile) * dm_row, dm_row * static_cast<int64_t>(sizeof(at::Half)));
            }
            (avx2 ? dequantize_avx2 : dequantize_portable)(qs + n * q_row, four_bit, dms + n * dm_row, K,
                                                           w.get() + o * K);
          }
        } else {  // the dense rows as they are (zero rows after the last)
          int64_t first = (t - tiles) * kTile;
          count = std::min(kTile, extra - first);
          std::fill(w.get(), w.get() + kTile * K, 0.0f);
          std::copy(tails + first * K, tails + (first + count) * K, w.get());
        }
        for (int64_t r = 0; r < rows; r += kRowBlock) {
          int64_t chunk = std::min(kRowBlock, rows - r);
          if (count == kTile) {
            tile(xs + r * K, chunk, K, w.get(), outs + r * N + t * kTile, N);
            continue;
          }
          last.resize(chunk * kTile);
          tile(xs + r * K, chunk, K, w.get(), last.data(), kTile);
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
