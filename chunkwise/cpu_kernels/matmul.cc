// Skinny matmuls for XLA:CPU that read int8 / bf16 / f32 weights in place.
//
//   out[m, n] = sum_k x[m, k] * w(k, n) * scale(k / group, n)
//
// x: f32 [M, K], small M (decode rows). w: int8, bf16 or f32, either
// [K, N] ("k-major": a weight whose contracted dims lead, e.g. q, o, down)
// or [N, K] ("n-major": a tied embedding table used to unembed); scale: f32
// [K / group, N] or [N, K / group] (group = K / its size: a float weight
// passes one group of ones). out: f32 [M, N].
//
// Each weight element is read once per call and converted in registers:
// int8 reads a quarter of f32's bytes, which is what decode is bound by.
// With AVX2, int8 weights multiply int16 activations: x is quantized once
// per call, one scale per row and weight group (max |x| / 32767, so each
// entry is off by at most 2^-16 of its group's largest), and pairs of
// products are summed in int32 (`_mm256_madd_epi16`), converted to f32
// once per group (or per 256 inputs). Converting every int8 weight to f32
// ran on one pipe of this Zen CPU and left int8 compute-bound at ~40% of
// the bandwidth ("this Zen CPU": the 2-core AMD EPYC this was measured on).
// With AVX-512 (F, BW, VL; VNNI's `vpdpwssd` where the CPU has it) int8
// weights take register tiles instead: a vector of 16 output columns'
// weight pairs (two inputs each, as int16) is converted once per step and
// multiplied into up to 8 x rows' int32 sums held in registers, scaled
// into f32 once per group; an n-major table is transposed into that form
// 16 rows at a time in L1. The AVX2 loops converted each weight vector
// once per x row, or kept the sums in memory: at 16 decode rows of
// SmolLM2-135M on a 2-core Zen 4 the tiles took int8 from 0.8x to 1.5x
// float32's tokens/s (n-major unembedding ~3x faster, k-major ~1.7-2.5x).
// A row's result is the same whatever the other rows and their number:
// its int32 sums are exact and its f32 sums run over groups in one order
// (k-major: for a given split, see `run`; tests check it bit for bit).
//
// Work is split into column (k-major) or row (n-major) blocks that the
// calling thread and XLA's intra-op threads claim from a shared counter,
// so the call completes even if no pool thread ever runs its task; an
// int8 k-major weight is split by whole weight rows instead, each block
// summing its own partial output, which the caller adds up.
//
// The plain twin (XLA's dot of the dequantized weight) is in matmul.py;
// tests/test_cpu_kernels.py compares the two.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CW_AVX2 1
#endif
#if defined(CW_AVX2) && defined(__AVX512F__)
#define CW_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"
#include "pool.h"

namespace ffi = xla::ffi;

namespace {

using i64 = int64_t;
using chunkwise::parallel_for;

// Weight rows read ahead of the k-major loop: each step reads short
// segments of four rows N apart, which the hardware prefetchers miss
// (measured on Zen: int8 rows from DRAM 3 -> 5 GB/s per core, f32 10 -> 13).
constexpr i64 kAhead = 8;

inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The portable twin of the AVX2 blocks below (any CPU the compiler
// targets); they also use it for column tails.
template <bool SCALED, class W>
void scalar_rows(const float* x, const W* w, const float* s, float* out, i64 M,
                 i64 K, i64 N, i64 group, bool nmajor, i64 n0, i64 n1) {
  const i64 groups = K / group;
  for (i64 n = n0; n < n1; ++n)
    for (i64 m = 0; m < M; ++m) {
      float acc = 0.f;
      for (i64 k = 0; k < K; ++k) {
        float wk = to_float(nmajor ? w[n * K + k] : w[k * N + n]);
        float sc = !SCALED ? 1.f : nmajor ? s[n * groups + k / group]
                                          : s[(k / group) * N + n];
        acc += x[m * K + k] * wk * sc;
      }
      out[m * N + n] = acc;
    }
}

#ifdef CW_AVX2
// 8 consecutive weights as f32.
inline __m256 load8(const int8_t* p) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline __m256 load8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// k-major: columns [n0, n1) of out, all M rows, accumulated in `acc`
// ([M, n1 - n0], L1-sized) four weight rows at a time: every step streams
// four contiguous row segments and converts each weight vector once for
// all M rows; the group's scale multiplies the four rows' sum.
template <bool SCALED, class W>
void kmajor_cols(const float* x, const W* w, const float* s, float* out,
                 float* acc, i64 M, i64 K, i64 N, i64 group, i64 n0, i64 n1) {
  const i64 B = n1 - n0;
  const i64 nv = n0 + (B / 8) * 8;  // columns [nv, n1) are done one by one
  std::fill(acc, acc + M * B, 0.f);
  const i64 groups = K / group;
  for (i64 g = 0; g < groups; ++g) {
    const float* sr = SCALED ? s + g * N : nullptr;
    const i64 k1 = (g + 1) * group;
    i64 k = g * group;
    for (; k + 4 <= k1; k += 4) {
      const W* r0 = w + k * N;
      const W *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
      for (i64 n = n0; n < nv; n += 8) {
        if (((n * static_cast<i64>(sizeof(W))) & 63) == 0) {  // a new line
          _mm_prefetch(reinterpret_cast<const char*>(r0 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r1 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r2 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r3 + kAhead * N + n), _MM_HINT_T0);
        }
        const __m256 w0 = load8(r0 + n), w1 = load8(r1 + n);
        const __m256 w2 = load8(r2 + n), w3 = load8(r3 + n);
        const __m256 sv = SCALED ? _mm256_loadu_ps(sr + n) : _mm256_set1_ps(1.f);
        for (i64 m = 0; m < M; ++m) {
          const float* xm = x + m * K + k;
          __m256 t = _mm256_mul_ps(_mm256_set1_ps(xm[0]), w0);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[1]), w1, t);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[2]), w2, t);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[3]), w3, t);
          float* a = acc + m * B + (n - n0);
          _mm256_storeu_ps(a, _mm256_fmadd_ps(t, sv, _mm256_loadu_ps(a)));
        }
      }
    }
    for (; k < k1; ++k) {
      const W* r0 = w + k * N;
      for (i64 n = n0; n < nv; n += 8) {
        __m256 w0 = load8(r0 + n);
        if (SCALED) w0 = _mm256_mul_ps(w0, _mm256_loadu_ps(sr + n));
        for (i64 m = 0; m < M; ++m) {
          float* a = acc + m * B + (n - n0);
          _mm256_storeu_ps(
              a, _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), w0, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (i64 m = 0; m < M; ++m)
    std::copy(acc + m * B, acc + m * B + (nv - n0), out + m * N + n0);
  scalar_rows<SCALED>(x, w, s, out, M, K, N, group, false, nv, n1);
}

#ifdef CW_AVX512
// 16 consecutive float weights as f32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// `kmajor_cols` for unscaled float weights, 16 columns a vector: the same
// four-row steps with half the instructions per weight (at 16 decode rows
// the 8-wide loop is bound by its FMAs and accumulator loads and stores:
// ~95 GFLOP/s on a 2-core Sapphire Rapids). Columns past the last whole
// 16 go to `kmajor_cols`.
template <class W>
void kmajor_cols16(const float* x, const W* w, float* out, float* acc, i64 M,
                   i64 K, i64 N, i64 n0, i64 n1) {
  const i64 B = n1 - n0;
  const i64 nv = n0 + (B / 16) * 16;
  std::fill(acc, acc + M * B, 0.f);
  i64 k = 0;
  for (; k + 4 <= K; k += 4) {
    const W* r0 = w + k * N;
    const W *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
    for (i64 n = n0; n < nv; n += 16) {
      if (((n * static_cast<i64>(sizeof(W))) & 63) == 0) {  // a new line
        _mm_prefetch(reinterpret_cast<const char*>(r0 + kAhead * N + n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r1 + kAhead * N + n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r2 + kAhead * N + n), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(r3 + kAhead * N + n), _MM_HINT_T0);
      }
      const __m512 w0 = load16(r0 + n), w1 = load16(r1 + n);
      const __m512 w2 = load16(r2 + n), w3 = load16(r3 + n);
      for (i64 m = 0; m < M; ++m) {
        const float* xm = x + m * K + k;
        float* a = acc + m * B + (n - n0);
        __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(xm[0]), w0, _mm512_loadu_ps(a));
        t = _mm512_fmadd_ps(_mm512_set1_ps(xm[1]), w1, t);
        t = _mm512_fmadd_ps(_mm512_set1_ps(xm[2]), w2, t);
        t = _mm512_fmadd_ps(_mm512_set1_ps(xm[3]), w3, t);
        _mm512_storeu_ps(a, t);
      }
    }
  }
  for (; k < K; ++k) {
    const W* r0 = w + k * N;
    for (i64 n = n0; n < nv; n += 16) {
      const __m512 w0 = load16(r0 + n);
      for (i64 m = 0; m < M; ++m) {
        float* a = acc + m * B + (n - n0);
        _mm512_storeu_ps(
            a, _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w0, _mm512_loadu_ps(a)));
      }
    }
  }
  for (i64 m = 0; m < M; ++m)
    std::copy(acc + m * B, acc + m * B + (nv - n0), out + m * N + n0);
  if (nv < n1)
    kmajor_cols<false>(x, w, nullptr, out, acc, M, K, N, K, nv, n1);
}

// n-major, unscaled float weights: out[m0 .. m0 + MR, n .. n + R), R table
// rows times MR x rows in R * MR registers, 16 inputs a step (each table
// vector loaded once for MR rows, each x vector once for R table rows).
template <int R, int MR, class W>
inline void nmajor_block16(const float* x, const W* w, float* out, i64 K,
                           i64 N, i64 m0, i64 n) {
  __m512 acc[R][MR];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  const i64 kv = K / 16 * 16;
  for (i64 k = 0; k < kv; k += 16) {
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_loadu_ps(x + (m0 + m) * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = load16(w + (n + r) * K + k);
      for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_fmadd_ps(xv[m], wv, acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MR; ++m) {
      float t = _mm512_reduce_add_ps(acc[r][m]);
      for (i64 k = kv; k < K; ++k)
        t += x[(m0 + m) * K + k] * to_float(w[(n + r) * K + k]);
      out[(m0 + m) * N + n + r] = t;
    }
}

// Rows [n0, n1) of an unscaled n-major float weight: blocks of four table
// rows outermost (read from memory once, then from L1 for every further
// block of four x rows).
template <class W>
void nmajor_rows16(const float* x, const W* w, float* out, i64 M, i64 K, i64 N,
                   i64 n0, i64 n1) {
  const i64 mv = M / 4 * 4;
  i64 n = n0;
  for (; n + 4 <= n1; n += 4) {
    for (i64 t = 0; t < 4; ++t)  // the next block's rows
      for (i64 k = 0; k < K; k += 64 / static_cast<i64>(sizeof(W)))
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + 4 + t) * K + k), _MM_HINT_T0);
    i64 m = 0;
    for (; m < mv; m += 4) nmajor_block16<4, 4>(x, w, out, K, N, m, n);
    for (; m < M; ++m) nmajor_block16<4, 1>(x, w, out, K, N, m, n);
  }
  for (; n < n1; ++n)
    for (i64 m = 0; m < M; ++m) nmajor_block16<1, 1>(x, w, out, K, N, m, n);
}
#endif

// n-major: out[n .. n + R) of one x row, R weight rows at a time (R
// independent FMA chains); group partial sums are scaled as they close.
template <int R, bool SCALED, class W>
inline void nmajor_rows(const float* xm, const W* w, const float* s,
                        float* outm, i64 K, i64 group, i64 n) {
  const i64 groups = K / group;
  const W* r[R];
  __m256 total[R];
  float tail[R];
  for (int j = 0; j < R; ++j) {
    r[j] = w + (n + j) * K;
    total[j] = _mm256_setzero_ps();
    tail[j] = 0.f;
  }
  for (i64 g = 0; g < groups; ++g) {
    __m256 part[R];
    float part_tail[R];
    for (int j = 0; j < R; ++j) {
      part[j] = _mm256_setzero_ps();
      part_tail[j] = 0.f;
    }
    const i64 k1 = (g + 1) * group;
    i64 k = g * group;
    for (; k + 8 <= k1; k += 8) {
      if (((k * static_cast<i64>(sizeof(W))) & 63) == 0)  // the next rows
        for (int j = 0; j < R; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(r[j] + R * K + k), _MM_HINT_T0);
      const __m256 xv = _mm256_loadu_ps(xm + k);
      for (int j = 0; j < R; ++j) part[j] = _mm256_fmadd_ps(xv, load8(r[j] + k), part[j]);
    }
    for (; k < k1; ++k)
      for (int j = 0; j < R; ++j) part_tail[j] += xm[k] * to_float(r[j][k]);
    for (int j = 0; j < R; ++j) {
      const float sc = SCALED ? s[(n + j) * groups + g] : 1.f;
      total[j] = _mm256_fmadd_ps(part[j], _mm256_set1_ps(sc), total[j]);
      tail[j] += part_tail[j] * sc;
    }
  }
  for (int j = 0; j < R; ++j) outm[n + j] = hsum(total[j]) + tail[j];
}

// ---- int8 weights x int16 activations -------------------------------------

// Inputs summed in int32 before a conversion to f32: a pair of products is
// at most 2 * 128 * 32767, so 128 pairs per int32 lane stay below 2^31.
constexpr i64 kChunk = 256;
// k-major int8 splits weight rows among threads while each block's partial
// output ([M, N] f32) is at most this many floats, else columns.
constexpr i64 kRowSplit = 32768;

// x quantized per row and weight group: group g of row m holds `P` int16
// (the group's entries, then zeros up to a multiple of 16) at
// q[(m * groups + g) * P], its scale at scale[m * groups + g].
struct QuantizedX {
  std::vector<int16_t> q;
  std::vector<float> scale;
  i64 groups = 0, P = 0;

  QuantizedX(const float* x, i64 M, i64 K, i64 group)
      : groups(K / group), P((group + 15) / 16 * 16) {
    q.assign(M * groups * P, 0);
    scale.resize(M * groups);
    for (i64 m = 0; m < M; ++m)
      for (i64 g = 0; g < groups; ++g) {
        const float* xg = x + m * K + g * group;
        float mx = 0.f;
        bool finite = true;
        for (i64 k = 0; k < group; ++k) {
          finite &= std::isfinite(xg[k]);
          mx = std::max(mx, std::fabs(xg[k]));
        }
        // A non-finite input makes its group's sums NaN, as in f32 math.
        scale[m * groups + g] =
            finite ? mx / 32767.f : std::numeric_limits<float>::quiet_NaN();
        if (!finite || mx == 0.f) continue;
        const float inv = 32767.f / mx;
        int16_t* qg = q.data() + (m * groups + g) * P;
        for (i64 k = 0; k < group; ++k) {
          const float v = std::nearbyint(xg[k] * inv);
          qg[k] = static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, v)));
        }
      }
  }
  const int16_t* at(i64 m, i64 g) const { return q.data() + (m * groups + g) * P; }
  float scale_of(i64 m, i64 g) const { return scale[m * groups + g]; }
};

// Two weight rows' 16 columns as int16 pairs (row a, row b) per column:
// columns [0, 8) in `lo`, [8, 16) in `hi`.
inline void pairs16(const int8_t* a, const int8_t* b, __m256i& lo, __m256i& hi) {
  const __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a));
  const __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(va, vb));
  hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(va, vb));
}

inline __m256i pair_of(const int16_t* x) {  // (x[0], x[1]) in every lane
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm256_set1_epi32(v);
}

// k-major int8: weight rows [kb, ke) and columns [n0, nv) (a multiple of
// 16 wide), all M rows, summed into acc [M, nv - n0], four weight rows a
// step. A step's rows past the chunk read `zeros`; kb and ke are
// multiples of 4 (or of whole groups) so x's pairs stay in their group.
void kmajor_i8(const QuantizedX& xq, const int8_t* w, const float* s,
               float* acc, int32_t* iacc, const int8_t* zeros, i64 M, i64 K,
               i64 N, i64 group, i64 kb, i64 ke, i64 n0, i64 nv) {
  const i64 B = nv - n0;
  std::fill(acc, acc + M * B, 0.f);
  for (i64 g = kb / group; g * group < ke; ++g) {
    const i64 k0 = g * group;
    const i64 t_end = std::min(group, ke - k0);
    for (i64 c0 = std::max<i64>(0, kb - k0); c0 < t_end; c0 += kChunk) {
      const i64 c1 = std::min(t_end, c0 + kChunk);
      auto row = [&](i64 t) { return t < c1 ? w + (k0 + t) * N : zeros; };
      std::fill(iacc, iacc + M * B, 0);
      for (i64 t = c0; t < c1; t += 4) {
        const int8_t *r0 = row(t), *r1 = row(t + 1), *r2 = row(t + 2), *r3 = row(t + 3);
        for (i64 n = n0; n < nv; n += 16) {
          if ((n & 63) == 0 && k0 + t + kAhead + 4 <= K) {  // a new line
            const int8_t* ahead = w + (k0 + t + kAhead) * N + n;
            for (int j = 0; j < 4; ++j)
              _mm_prefetch(reinterpret_cast<const char*>(ahead + j * N), _MM_HINT_T0);
          }
          __m256i w01lo, w01hi, w23lo, w23hi;
          pairs16(r0 + n, r1 + n, w01lo, w01hi);
          pairs16(r2 + n, r3 + n, w23lo, w23hi);
          for (i64 m = 0; m < M; ++m) {
            const int16_t* xm = xq.at(m, g) + t;
            const __m256i x01 = pair_of(xm), x23 = pair_of(xm + 2);
            const __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(w01lo, x01),
                                                _mm256_madd_epi16(w23lo, x23));
            const __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(w01hi, x01),
                                                _mm256_madd_epi16(w23hi, x23));
            __m256i* a = reinterpret_cast<__m256i*>(iacc + m * B + (n - n0));
            _mm256_storeu_si256(a, _mm256_add_epi32(_mm256_loadu_si256(a), lo));
            _mm256_storeu_si256(a + 1, _mm256_add_epi32(_mm256_loadu_si256(a + 1), hi));
          }
        }
      }
      const float* sr = s + g * N;
      for (i64 m = 0; m < M; ++m) {
        const __m256 xs = _mm256_set1_ps(xq.scale_of(m, g));
        for (i64 n = n0; n < nv; n += 8) {
          const __m256 sum = _mm256_cvtepi32_ps(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(iacc + m * B + (n - n0))));
          float* a = acc + m * B + (n - n0);
          _mm256_storeu_ps(a, _mm256_fmadd_ps(sum, _mm256_mul_ps(_mm256_loadu_ps(sr + n), xs),
                                              _mm256_loadu_ps(a)));
        }
      }
    }
  }
}

// n-major int8: out[n .. n + R) of row m, R weight rows at a time, 16
// inputs a step (a group's last step reads into the next group, or past
// the row's end through a copy, against zero x).
template <int R>
inline void nmajor_rows_i8(const QuantizedX& xq, i64 m, const int8_t* w,
                           const float* s, float* outm, i64 K, i64 group, i64 n) {
  const i64 groups = xq.groups;
  const int8_t* r[R];
  __m256 total[R];
  for (int j = 0; j < R; ++j) {
    r[j] = w + (n + j) * K;
    total[j] = _mm256_setzero_ps();
  }
  for (i64 g = 0; g < groups; ++g) {
    const int16_t* xg = xq.at(m, g);
    const i64 k0 = g * group;
    for (i64 c0 = 0; c0 < xq.P; c0 += kChunk) {
      const i64 c1 = std::min(xq.P, c0 + kChunk);
      __m256i part[R];
      for (int j = 0; j < R; ++j) part[j] = _mm256_setzero_si256();
      for (i64 t = c0; t < c1; t += 16) {
        const i64 k = k0 + t;
        if ((k & 63) < 16)  // the next rows' line
          for (int j = 0; j < R; ++j)
            _mm_prefetch(reinterpret_cast<const char*>(r[j] + R * K + k), _MM_HINT_T0);
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + t));
        for (int j = 0; j < R; ++j) {
          __m128i wv;
          if (k + 16 <= K) {
            wv = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r[j] + k));
          } else {
            alignas(16) int8_t last[16] = {};
            std::memcpy(last, r[j] + k, K - k);
            wv = _mm_load_si128(reinterpret_cast<const __m128i*>(last));
          }
          part[j] = _mm256_add_epi32(part[j], _mm256_madd_epi16(_mm256_cvtepi8_epi16(wv), xv));
        }
      }
      const float xs = xq.scale_of(m, g);
      for (int j = 0; j < R; ++j)
        total[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[j]),
                                   _mm256_set1_ps(s[(n + j) * groups + g] * xs), total[j]);
    }
  }
  for (int j = 0; j < R; ++j) outm[n + j] = hsum(total[j]);
}

#if defined(CW_AVX512) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define CW_I8_512 1
// ---- int8 weights x int16 activations, AVX-512 ------------------------------
//
// Register tiles: each weight pair vector (16 output columns, two inputs
// each, as int16) is converted once per step and multiplied into up to
// `kMR` x rows' int32 accumulators held in registers; a group's (or
// kChunk's) int32 sums are converted to f32 and scaled once at its end.
// A row's result is the same whatever the number of rows: its int32 sums
// are exact and its f32 sums run over groups in one order.

constexpr int kMR = 8;  // x rows per register tile

// acc += a . b over int16 pairs (VNNI `vpdpwssd` where the CPU has it).
inline __m512i dp16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

inline __m512i pair_of16(const int16_t* x) {  // (x[0], x[1]) in every lane
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return _mm512_set1_epi32(v);
}

// k-major: columns [n, n + cols) (cols <= 32; fewer read and write under a
// mask) of rows [m0, m0 + MR), weight rows [kb, ke), added into acc
// (row m at acc + m * B + (n - n0)). Two weight rows a step: their 32
// columns' bytes interleaved and widened to int16 pairs, columns
// {0-7, 16-23} in `lo`, {8-15, 24-31} in `hi` (put back in order once a
// group). A step's second row past the chunk reads `zeros`.
template <int MR, bool MASKED>
void kmajor_tile_i8(const QuantizedX& xq, const int8_t* w, const float* s,
                    float* acc, i64 B, const int8_t* zeros, i64 N, i64 group,
                    i64 kb, i64 ke, i64 m0, i64 n0, i64 n, i64 cols) {
  const __mmask32 bmask = MASKED ? static_cast<__mmask32>((1ull << cols) - 1) : ~0u;
  const __mmask16 f0 = static_cast<__mmask16>(bmask), f1 = static_cast<__mmask16>(bmask >> 16);
  for (i64 g = kb / group; g * group < ke; ++g) {
    const i64 k0 = g * group;
    const i64 t_end = std::min(group, ke - k0);
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(m0 + m, g);
    for (i64 c0 = std::max<i64>(0, kb - k0); c0 < t_end; c0 += kChunk) {
      const i64 c1 = std::min(t_end, c0 + kChunk);
      __m512i lo[MR], hi[MR];
      for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (i64 t = c0; t < c1; t += 2) {
        const int8_t* r0 = w + (k0 + t) * N + n;
        const int8_t* r1 = t + 1 < c1 ? r0 + N : zeros + n;
        if ((n & 63) == 0) {  // this row's next line, for the next tiles
          _mm_prefetch(reinterpret_cast<const char*>(r0 + 64), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r1 + 64), _MM_HINT_T0);
        }
        __m256i a, b;
        if (MASKED) {
          a = _mm256_maskz_loadu_epi8(bmask, r0);
          b = _mm256_maskz_loadu_epi8(bmask, r1);
        } else {
          a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
          b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1));
        }
        const __m512i wl = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
        const __m512i wh = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
        for (int m = 0; m < MR; ++m) {
          const __m512i xp = pair_of16(xg[m] + t);
          lo[m] = dp16(lo[m], wl, xp);
          hi[m] = dp16(hi[m], wh, xp);
        }
      }
      const float* sr = s + g * N + n;
      const __m512 s0 = _mm512_maskz_loadu_ps(f0, sr);
      const __m512 s1 = _mm512_maskz_loadu_ps(f1, sr + 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(xq.scale_of(m0 + m, g));
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_shuffle_i64x2(lo[m], hi[m], 0x44));
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_shuffle_i64x2(lo[m], hi[m], 0xEE));
        float* a = acc + (m0 + m) * B + (n - n0);
        if (MASKED) {
          _mm512_mask_storeu_ps(a, f0, _mm512_fmadd_ps(v0, _mm512_mul_ps(s0, xs),
                                                      _mm512_maskz_loadu_ps(f0, a)));
          _mm512_mask_storeu_ps(a + 16, f1, _mm512_fmadd_ps(v1, _mm512_mul_ps(s1, xs),
                                                           _mm512_maskz_loadu_ps(f1, a + 16)));
        } else {
          _mm512_storeu_ps(a, _mm512_fmadd_ps(v0, _mm512_mul_ps(s0, xs), _mm512_loadu_ps(a)));
          _mm512_storeu_ps(a + 16,
                           _mm512_fmadd_ps(v1, _mm512_mul_ps(s1, xs), _mm512_loadu_ps(a + 16)));
        }
      }
    }
  }
}

template <int MR>
void kmajor_cols_i8_mr(const QuantizedX& xq, const int8_t* w, const float* s,
                       float* acc, i64 B, const int8_t* zeros, i64 N, i64 group,
                       i64 kb, i64 ke, i64 m0, i64 n0, i64 na, i64 n1) {
  i64 n = na;  // columns [na, n1) of a block starting at n0
  for (; n + 32 <= n1; n += 32)
    kmajor_tile_i8<MR, false>(xq, w, s, acc, B, zeros, N, group, kb, ke, m0, n0, n, 32);
  if (n < n1)
    kmajor_tile_i8<MR, true>(xq, w, s, acc, B, zeros, N, group, kb, ke, m0, n0, n, n1 - n);
}

// k-major int8: weight rows [kb, ke), columns [n0, n1) (any width), all M
// rows, into acc [M, n1 - n0] (zeroed here). Column tiles outermost: a
// tile's weight lines are read from memory once, then from L1 for every
// further tile of x rows. zeros: at least N + 32 zero bytes.
void kmajor_i8_512(const QuantizedX& xq, const int8_t* w, const float* s,
                   float* acc, const int8_t* zeros, i64 M, i64 N, i64 group,
                   i64 kb, i64 ke, i64 n0, i64 n1) {
  const i64 B = n1 - n0;
  std::fill(acc, acc + M * B, 0.f);
  // Column strips of 32 (a cache line is two tiles), row tiles inside.
  for (i64 n = n0; n < n1; n += 64) {
    const i64 e = std::min(n1, n + 64);
    i64 m = 0;
    for (; m + kMR <= M; m += kMR)
      kmajor_cols_i8_mr<kMR>(xq, w, s, acc, B, zeros, N, group, kb, ke, m, n0, n, e);
    switch (M - m) {
#define CW_CASE(r) \
  case r:          \
    kmajor_cols_i8_mr<r>(xq, w, s, acc, B, zeros, N, group, kb, ke, m, n0, n, e); break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4) CW_CASE(5) CW_CASE(6) CW_CASE(7)
#undef CW_CASE
      default: break;
    }
  }
}

// n-major int8, even groups: table rows [n, n + rows) (rows <= 16) as
// k-major int16 pairs in `buf` (pair p of the 16 rows at buf + 32 p,
// rows past `rows` zero) and their scales in `sbuf` (group g at
// sbuf + 16 g): 16 rows x 32 inputs at a time, a 16 x 16 transpose of
// 16-bit words (pairs of int8 inputs), then widened.
inline void nmajor_pack_i8(const int8_t* w, const float* s, int16_t* buf,
                           float* sbuf, i64 K, i64 groups, i64 n, i64 rows) {
  for (i64 k = 0; k < K; k += 32) {
    const __mmask32 km = K - k >= 32 ? ~0u : static_cast<__mmask32>((1ull << (K - k)) - 1);
    __m256i a[16];
    if (rows == 16 && K - k >= 32) {
      for (int j = 0; j < 16; ++j)
        a[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + j) * K + k));
    } else {
      for (int j = 0; j < 16; ++j)
        a[j] = j < rows ? _mm256_maskz_loadu_epi8(km, w + (n + j) * K + k)
                        : _mm256_setzero_si256();
    }
    __m256i b[16], c[16], d[16];
    for (int i = 0; i < 8; ++i) {  // words w (+8 per lane): rows 2i, 2i+1
      b[2 * i] = _mm256_unpacklo_epi16(a[2 * i], a[2 * i + 1]);      // w 0-3
      b[2 * i + 1] = _mm256_unpackhi_epi16(a[2 * i], a[2 * i + 1]);  // w 4-7
    }
    for (int j = 0; j < 4; ++j) {  // rows 4j .. 4j + 3
      c[4 * j + 0] = _mm256_unpacklo_epi32(b[4 * j], b[4 * j + 2]);      // w 0, 1
      c[4 * j + 1] = _mm256_unpackhi_epi32(b[4 * j], b[4 * j + 2]);      // w 2, 3
      c[4 * j + 2] = _mm256_unpacklo_epi32(b[4 * j + 1], b[4 * j + 3]);  // w 4, 5
      c[4 * j + 3] = _mm256_unpackhi_epi32(b[4 * j + 1], b[4 * j + 3]);  // w 6, 7
    }
    for (int h = 0; h < 2; ++h)  // rows 8h .. 8h + 7
      for (int q = 0; q < 4; ++q) {
        d[8 * h + 2 * q] = _mm256_unpacklo_epi64(c[8 * h + q], c[8 * h + 4 + q]);
        d[8 * h + 2 * q + 1] = _mm256_unpackhi_epi64(c[8 * h + q], c[8 * h + 4 + q]);
      }
    // d[8h + v]: rows 8h .. 8h + 7 of word v (low lane), v + 8 (high lane)
    const i64 pairs = std::min<i64>(16, (K - k + 1) / 2);
    int16_t* out = buf + k * 16;  // pair k / 2
    for (int v = 0; v < 8; ++v) {
      const __m256i lo = _mm256_permute2x128_si256(d[v], d[8 + v], 0x20);
      const __m256i hi = _mm256_permute2x128_si256(d[v], d[8 + v], 0x31);
      if (v < pairs)
        _mm512_storeu_si512(out + v * 32, _mm512_cvtepi8_epi16(lo));
      if (v + 8 < pairs)
        _mm512_storeu_si512(out + (v + 8) * 32, _mm512_cvtepi8_epi16(hi));
    }
  }
  for (i64 g = 0; g < groups; ++g)
    for (int j = 0; j < 16; ++j)
      sbuf[g * 16 + j] = j < rows ? s[(n + j) * groups + g] : 0.f;
}

// out[m0 .. m0 + MR, n .. n + rows) from a packed block (see above).
// Prefetches `lines` cache lines from `ahead` (the next block), spread
// over the groups.
template <int MR>
void nmajor_tile_i8(const QuantizedX& xq, const int16_t* buf, const float* sbuf,
                    float* out, i64 N, i64 group, i64 m0, i64 n, i64 rows,
                    const char* ahead, i64 lines) {
  __m512 total[MR];
  for (int m = 0; m < MR; ++m) total[m] = _mm512_setzero_ps();
  for (i64 g = 0; g < xq.groups; ++g) {
    for (i64 l = lines * g / xq.groups; l < lines * (g + 1) / xq.groups; ++l)
      _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    const i64 k0 = g * group;
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(m0 + m, g);
    for (i64 c0 = 0; c0 < group; c0 += kChunk) {
      const i64 c1 = std::min(group, c0 + kChunk);
      __m512i part[MR];
      for (int m = 0; m < MR; ++m) part[m] = _mm512_setzero_si512();
      for (i64 t = c0; t < c1; t += 2) {
        const __m512i wv = _mm512_loadu_si512(buf + (k0 + t) * 16);
        for (int m = 0; m < MR; ++m) part[m] = dp16(part[m], wv, pair_of16(xg[m] + t));
      }
      const __m512 sv = _mm512_loadu_ps(sbuf + g * 16);
      for (int m = 0; m < MR; ++m)
        total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[m]),
                                   _mm512_mul_ps(sv, _mm512_set1_ps(xq.scale_of(m0 + m, g))),
                                   total[m]);
    }
  }
  const __mmask16 rm = static_cast<__mmask16>((1u << rows) - 1);
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(out + (m0 + m) * N + n, rm, total[m]);
}

// n-major int8 (group even): rows [n0, n1) of the table, all M x rows,
// 16 table rows a block. buf: K * 16 int16, sbuf: 16 * groups floats.
void nmajor_i8_512(const QuantizedX& xq, const int8_t* w, const float* s,
                   float* out, int16_t* buf, float* sbuf, i64 M, i64 K, i64 N,
                   i64 group, i64 n0, i64 n1) {
  for (i64 n = n0; n < n1; n += 16) {
    const i64 rows = std::min<i64>(16, n1 - n);
    // the next block (contiguous rows), prefetched by the first row tile
    const char* next = reinterpret_cast<const char*>(w + (n + 16) * K);
    i64 lines = (std::min<i64>(16, std::max<i64>(0, n1 - n - 16)) * K + 63) / 64;
    nmajor_pack_i8(w, s, buf, sbuf, K, xq.groups, n, rows);
    i64 m = 0;
    for (; m + kMR <= M; m += kMR, lines = 0)
      nmajor_tile_i8<kMR>(xq, buf, sbuf, out, N, group, m, n, rows, next, lines);
    switch (M - m) {
#define CW_CASE(r) \
  case r:          \
    nmajor_tile_i8<r>(xq, buf, sbuf, out, N, group, m, n, rows, next, lines); break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4) CW_CASE(5) CW_CASE(6) CW_CASE(7)
#undef CW_CASE
      default: break;
    }
  }
}
#endif  // AVX-512 int8
#endif  // CW_AVX2

// Columns (k-major) or rows (n-major) [n0, n1) of the output, all M rows;
// `acc` holds M * (n1 - n0) floats.
template <bool SCALED, class W>
void compute(const float* x, const W* w, const float* s, float* out,
             float* acc, i64 M, i64 K, i64 N, i64 group, bool nmajor, i64 n0,
             i64 n1) {
#ifdef CW_AVX2
  if (!nmajor) {
#ifdef CW_AVX512
    if constexpr (!SCALED && !std::is_same_v<W, int8_t>) {
      kmajor_cols16(x, w, out, acc, M, K, N, n0, n1);
      return;
    }
#endif
    kmajor_cols<SCALED>(x, w, s, out, acc, M, K, N, group, n0, n1);
    return;
  }
#ifdef CW_AVX512
  if constexpr (!SCALED && !std::is_same_v<W, int8_t>) {
    if (M >= 4) {  // (one row: the loop below streams the table faster)
      nmajor_rows16(x, w, out, M, K, N, n0, n1);
      return;
    }
  }
#endif
  // Weight rows outermost: a block of four rows is read from memory once
  // and from L1 for every further x row (x rows outermost read the whole
  // table M times: 16 decode rows of a tied 49152 x 576 table, 1.8 GB).
  i64 n = n0;
  for (; n + 4 <= n1; n += 4)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows<4, SCALED>(x + m * K, w, s, out + m * N, K, group, n);
  for (; n < n1; ++n)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows<1, SCALED>(x + m * K, w, s, out + m * N, K, group, n);
#else
  (void)acc;
  scalar_rows<SCALED>(x, w, s, out, M, K, N, group, nmajor, n0, n1);
#endif
}

#ifdef CW_AVX2
// int8 columns (k-major) or rows (n-major) [n0, n1), all M rows.
void compute_i8(const QuantizedX& xq, const float* x, const int8_t* w,
                const float* s, float* out, float* acc, int32_t* iacc,
                const int8_t* zeros, i64 M, i64 K, i64 N, i64 group,
                bool nmajor, i64 n0, i64 n1) {
#ifdef CW_I8_512
  if (!nmajor) {
    kmajor_i8_512(xq, w, s, acc, zeros, M, N, group, 0, K, n0, n1);
    for (i64 m = 0; m < M; ++m)
      std::copy(acc + m * (n1 - n0), acc + (m + 1) * (n1 - n0), out + m * N + n0);
    return;
  }
  if (group % 2 == 0) {  // (odd groups: pairs would straddle two)
    thread_local std::vector<int16_t> buf;
    thread_local std::vector<float> sbuf;
    if (buf.size() < static_cast<size_t>(K * 16)) buf.resize(K * 16);
    if (sbuf.size() < static_cast<size_t>(16 * xq.groups)) sbuf.resize(16 * xq.groups);
    nmajor_i8_512(xq, w, s, out, buf.data(), sbuf.data(), M, K, N, group, n0, n1);
    return;
  }
#endif
  if (!nmajor) {
    const i64 nv = n0 + (n1 - n0) / 16 * 16;  // [nv, n1) one by one, in f32
    kmajor_i8(xq, w, s, acc, iacc, zeros, M, K, N, group, 0, K, n0, nv);
    for (i64 m = 0; m < M; ++m)
      std::copy(acc + m * (nv - n0), acc + (m + 1) * (nv - n0), out + m * N + n0);
    scalar_rows<true>(x, w, s, out, M, K, N, group, false, nv, n1);
    return;
  }
  i64 n = n0;  // weight rows outermost, as in compute()
  for (; n + 4 <= n1; n += 4)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows_i8<4>(xq, m, w, s, out + m * N, K, group, n);
  for (; n < n1; ++n)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows_i8<1>(xq, m, w, s, out + m * N, K, group, n);
}
#endif

template <class W>
void run(ffi::ThreadPool& pool, const float* x, const W* w, const float* s,
         float* out, i64 M, i64 K, i64 N, i64 group, bool nmajor) {
  const bool scaled = s != nullptr;
  const i64 threads = std::max<i64>(1, pool.num_threads());
  // Two blocks per thread; k-major blocks are multiples of 16 columns whose
  // accumulators (M rows) stay within 64 KB.
  i64 block = (N + 2 * threads - 1) / (2 * threads);
  if (!nmajor) {
    block = std::min<i64>((block + 15) / 16 * 16, std::max<i64>(16, 16384 / M / 16 * 16));
  }
#ifdef CW_I8_512
  // int8 n-major: whole blocks of 16 table rows (see nmajor_i8_512)
  if constexpr (std::is_same_v<W, int8_t>)
    if (nmajor) block = (block + 15) / 16 * 16;
#endif
  block = std::max<i64>(block, 1);
  const i64 blocks = (N + block - 1) / block;
#ifdef CW_AVX2
  if constexpr (std::is_same_v<W, int8_t>) {
    // Quantized once by the caller; blocks only read it (a pool task that
    // starts after the call returned finds no block left to run).
    const QuantizedX xq(x, M, K, group);
    const QuantizedX* xqp = &xq;
    const i64 nv = N / 16 * 16;
    if (!nmajor && group % 4 == 0 && nv > 0 && M * nv <= kRowSplit) {
      // Blocks of whole weight rows (4 at a time), not columns: short
      // column segments of N-byte rows were read at ~4 GB/s per core
      // against ~7 for whole rows. Each block sums into its own [M, nv];
      // the caller adds them up.
      const i64 quads = (K + 3) / 4;
      const i64 parts = std::min(2 * threads, quads);
#ifdef CW_I8_512
      const i64 nw = N;  // every column, tails under a mask
#else
      const i64 nw = nv;  // [nv, N) one by one, in f32
#endif
      std::vector<float> sums(parts * M * nw);
      float* sp = sums.data();
      parallel_for(pool, parts, [=](i64 b) {
        const i64 kb = quads * b / parts * 4, ke = std::min(K, quads * (b + 1) / parts * 4);
        thread_local std::vector<int8_t> zeros;
        if (zeros.size() < static_cast<size_t>(N + 64)) zeros.resize(N + 64, 0);
#ifdef CW_I8_512
        kmajor_i8_512(*xqp, w, s, sp + b * M * nw, zeros.data(), M, N, group, kb, ke, 0, nw);
#else
        thread_local std::vector<int32_t> iacc;
        if (iacc.size() < static_cast<size_t>(M * nw)) iacc.resize(M * nw);
        kmajor_i8(*xqp, w, s, sp + b * M * nw, iacc.data(), zeros.data(), M, K,
                  N, group, kb, ke, 0, nw);
#endif
      });
      for (i64 m = 0; m < M; ++m) {
        float* o = out + m * N;
        std::copy(sp + m * nw, sp + (m + 1) * nw, o);
        for (i64 b = 1; b < parts; ++b) {
          const float* p = sp + (b * M + m) * nw;
          for (i64 n = 0; n < nw; ++n) o[n] += p[n];
        }
      }
      if (nw < N) scalar_rows<true>(x, w, s, out, M, K, N, group, false, nw, N);
      return;
    }
    parallel_for(pool, blocks, [=](i64 b) {
      const i64 n0 = b * block, n1 = std::min(N, n0 + block);
      // Per-thread scratch, grown, never freed between calls.
      thread_local std::vector<float> acc;
      thread_local std::vector<int32_t> iacc;
      thread_local std::vector<int8_t> zeros;
      if (!nmajor) {
        const size_t need = M * (n1 - n0);
        if (acc.size() < need) acc.resize(need);
        if (iacc.size() < need) iacc.resize(need);
        if (zeros.size() < static_cast<size_t>(N + 64)) zeros.resize(N + 64, 0);
      }
      compute_i8(*xqp, x, w, s, out, acc.data(), iacc.data(), zeros.data(), M,
                 K, N, group, nmajor, n0, n1);
    });
    return;
  }
#endif
  parallel_for(pool, blocks, [=](i64 b) {
    const i64 n0 = b * block, n1 = std::min(N, n0 + block);
    // k-major accumulators: one buffer per thread, grown, never freed
    // between calls (at most 64 KB, see above).
    thread_local std::vector<float> acc;
    if (!nmajor && acc.size() < static_cast<size_t>(M * (n1 - n0)))
      acc.resize(M * (n1 - n0));
    if (scaled)
      compute<true>(x, w, s, out, acc.data(), M, K, N, group, nmajor, n0, n1);
    else
      compute<false>(x, w, s, out, acc.data(), M, K, N, group, nmajor, n0, n1);
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out, int64_t nmajor) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, w and scale must be 2-D");
  const i64 M = xd[0], K = xd[1];
  const i64 N = nmajor ? wd[0] : wd[1];
  const i64 G = nmajor ? sd[1] : sd[0];
  if ((nmajor ? wd[1] : wd[0]) != K || (nmajor ? sd[0] : sd[1]) != N ||
      G <= 0 || K % G != 0)
    return ffi::Error::InvalidArgument("x, w and scale shapes disagree");
  const float* s = scale.typed_data();
  // A float weight passes one group of ones: no scaling to do.
  const bool ones = G == 1 && w.element_type() != ffi::DataType::S8;
  const float* sp = ones ? nullptr : s;
  const i64 group = K / G;
  float* o = out->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::S8:
      run(pool, x.typed_data(), static_cast<const int8_t*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    case ffi::DataType::BF16:
      run(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    case ffi::DataType::F32:
      run(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    default:
      return ffi::Error::InvalidArgument("w must be int8, bf16 or f32");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("nmajor"));
