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
      std::vector<float> sums(parts * M * nv);
      float* sp = sums.data();
      parallel_for(pool, parts, [=](i64 b) {
        const i64 kb = quads * b / parts * 4, ke = std::min(K, quads * (b + 1) / parts * 4);
        thread_local std::vector<int32_t> iacc;
        thread_local std::vector<int8_t> zeros;
        if (iacc.size() < static_cast<size_t>(M * nv)) iacc.resize(M * nv);
        if (zeros.size() < static_cast<size_t>(N)) zeros.resize(N, 0);
        kmajor_i8(*xqp, w, s, sp + b * M * nv, iacc.data(), zeros.data(), M, K,
                  N, group, kb, ke, 0, nv);
      });
      for (i64 m = 0; m < M; ++m) {
        float* o = out + m * N;
        std::copy(sp + m * nv, sp + (m + 1) * nv, o);
        for (i64 b = 1; b < parts; ++b) {
          const float* p = sp + (b * M + m) * nv;
          for (i64 n = 0; n < nv; ++n) o[n] += p[n];
        }
      }
      scalar_rows<true>(x, w, s, out, M, K, N, group, false, nv, N);
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
        if (zeros.size() < static_cast<size_t>(N)) zeros.resize(N, 0);
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
