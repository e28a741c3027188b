// Batch-invariant matmuls: every output is one fixed sequence of floating
// point operations, whatever the number of rows, the row's index among
// them, the tiling or the threads. A row's result therefore depends only on
// the row and the weight (chunkwise's "invariant" numerics).
//
//   x: f32 [G, M, K]; w: f32, bf16 or int8, [Gw, K, N] ("k-major") or
//   [Gw, N, K] ("n-major"), Gw = 1 (one weight for every g) or G;
//   scale: f32 [Gw, K / group, N] or [Gw, N, K / group] when `scaled`;
//   acc: f32 [G, M, N'] when `has_acc`; out: f32 [G, M, N'], N' = N + ones.
//
// A weight element enters as f32: int8 times its group's scale (one f32
// rounding, as `QArray.astype` dequantizes), bf16 widened, f32 as it is.
// k-major: out[g, m, n] is the chain a <- fma(x[g, m, k], w[k, n], a) over
//   k = 0 .. K-1 in order, from a = acc[g, m, n] (or +0). With `ones`,
//   column N has weight 1 everywhere (the chained sum of the row's x).
// n-major: 16 lanes; lane l chains the inputs k = 16 j + l as above (past
//   K, a lane takes fma(0, 0, a)); the lanes are then added as a fixed
//   tree: (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1).
//
// Tiles (rows x columns per register block) and the blocks threads claim
// change only which outputs are computed together, never an output's
// operations. The portable loops at the end define the same sums for CPUs
// without AVX-512; tests/test_cpu_kernels.py compares the kernel with
// them and with XLA's dot.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include <immintrin.h>
#define CW_INV512 1
#endif

#include "xla/ffi/api/ffi.h"
#include "pool.h"

namespace ffi = xla::ffi;

namespace {

using i64 = int64_t;
using chunkwise::parallel_for;

inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return static_cast<float>(v); }
inline float as_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct Problem {
  const float* x;
  const void* w;
  const float* s;  // nullptr unless scaled
  const float* acc;  // nullptr unless has_acc
  float* out;
  i64 G, M, K, N, groups, group;
  bool w_shared, ones;
  // A window of `count` of w's `heads` (its second dim) from `first`:
  // batch g reads w's [g / count, first + g % count]; count 0: none.
  i64 heads = 0, count = 0, first = 0;
  i64 cols() const { return N + (ones ? 1 : 0); }
  i64 w_index(i64 g) const {
    if (w_shared) return 0;
    return count ? (g / count) * heads + first + g % count : g;
  }
  template <class W>
  const W* weight(i64 g) const {
    return static_cast<const W*>(w) + w_index(g) * K * N;
  }
  const float* scale(i64 g) const {
    return s == nullptr ? nullptr : s + w_index(g) * groups * N;
  }
};

// The fixed tree over 16 lanes (module doc).
inline float tree16(const float* a) {
  float t[8], u[4], v[2];
  for (int l = 0; l < 8; ++l) t[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
  for (int l = 0; l < 2; ++l) v[l] = u[l] + u[l + 2];
  return v[0] + v[1];
}

// A weight element as f32: int8 times its group's scale (one rounding, as
// `QArray.astype` dequantizes), bf16 widened, f32 itself.
template <class W>
inline float weight_kn(const Problem& p, const W* w, const float* s, i64 k, i64 n) {
  if (n == p.N) return 1.f;  // the ones column
  const float v = as_float(w[k * p.N + n]);
  return s ? v * s[(k / p.group) * p.N + n] : v;
}
template <class W>
inline float weight_nk(const Problem& p, const W* w, const float* s, i64 n, i64 k) {
  const float v = as_float(w[n * p.K + k]);
  return s ? v * s[n * p.groups + k / p.group] : v;
}

// ---- the portable definition -----------------------------------------------

template <class W>
void kmajor_portable(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const W* w = p.weight<W>(g);
  const float* s = p.scale(g);
  const i64 cols = p.cols();
  for (i64 m = m0; m < m1; ++m) {
    const float* x = p.x + (g * p.M + m) * p.K;
    for (i64 n = n0; n < n1; ++n) {
      const i64 at = (g * p.M + m) * cols + n;
      float a = p.acc ? p.acc[at] : 0.f;
      for (i64 k = 0; k < p.K; ++k) a = std::fma(x[k], weight_kn(p, w, s, k, n), a);
      p.out[at] = a;
    }
  }
}

template <class W>
void nmajor_portable(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const W* w = p.weight<W>(g);
  const float* s = p.scale(g);
  for (i64 m = m0; m < m1; ++m) {
    const float* x = p.x + (g * p.M + m) * p.K;
    for (i64 n = n0; n < n1; ++n) {
      float a[16] = {};
      for (i64 k = 0; k < p.K; k += 16)
        for (int l = 0; l < 16; ++l) {
          const bool in = k + l < p.K;
          a[l] = std::fma(in ? x[k + l] : 0.f, in ? weight_nk(p, w, s, n, k + l) : 0.f, a[l]);
        }
      p.out[(g * p.M + m) * p.N + n] = tree16(a);
    }
  }
}

#ifdef CW_INV512
// ---- AVX-512 ---------------------------------------------------------------

inline __mmask16 first(i64 count) {
  return count >= 16 ? static_cast<__mmask16>(0xffff)
                     : static_cast<__mmask16>((1u << std::max<i64>(count, 0)) - 1);
}
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) {
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline __m512 load(const int8_t* p, __mmask16 m) {
  const __m128i v = _mm_maskz_loadu_epi8(m, p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load(const uint16_t* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

inline float tree16(__m512 a) {
  const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// tree16 of 16 vectors at once: out[o] = tree16(v[o]). Each level adds
// the same pairs of lanes, (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1),
// with the vectors' halves, quarters and pairs shuffled side by side.
inline __m512 trees16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // [t_2i (8 lanes), t_2i+1 (8 lanes)]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int i = 0; i < 4; ++i)  // [u_4i, u_4i+1, u_4i+2, u_4i+3] (4 lanes each)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int i = 0; i < 2; ++i)  // chunk q: [v_8i+q (2 lanes), v_8i+q+4 (2 lanes)]
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // chunk q: [r_q, r_q+4, r_q+8, r_q+12]
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// Rows at or above which a k-major block's weight columns are first
// dequantized into a contiguous f32 panel ([K, 16 NV]) that register tiles
// then read; below, `kmajor_stream`.
constexpr i64 kPackRows = 32;
// Weight rows read ahead (the hardware prefetchers miss short segments of
// rows N apart).
constexpr i64 kAhead = 8;

// 16 weights of k-major row k from column c as f32 (dequantized, the ones
// column set); prefetches the row kAhead on at each new line.
inline __m512 load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

template <class W>
inline __m512 kmajor_weights(const Problem& p, const W* w, const float* s, i64 k, i64 c,
                             const __m512* scale = nullptr) {
  const W* row = w + k * p.N + c;
  if (((c * static_cast<i64>(sizeof(W))) & 63) == 0)
    _mm_prefetch(reinterpret_cast<const char*>(row + kAhead * p.N), _MM_HINT_T0);
  const __mmask16 m = first(p.N - c);
  __m512 v = c + 16 <= p.N ? load(row) : load(row, m);
  if (s)
    v = _mm512_mul_ps(v, scale ? *scale : _mm512_maskz_loadu_ps(m, s + (k / p.group) * p.N + c));
  const i64 at = p.N - c;  // the ones column's lane
  if (p.ones && at >= 0 && at < 16)
    v = _mm512_mask_blend_ps(static_cast<__mmask16>(1u << at), v, _mm512_set1_ps(1.f));
  return v;
}

// k-major, MR rows x 16 NV columns [n0, n0 + 16 NV) of batch g from the
// packed panel pp ([K, 16 NV]); masks cut columns >= cols. NV is 4, or 5 for
// 65-80 columns (attention's values and the ones column in one block).
template <int MR, int NV>
inline void kmajor_tile(const Problem& p, i64 g, i64 m0, i64 n0, const float* pp) {
  const i64 cols = p.cols();
  __mmask16 mask[NV];
  for (int j = 0; j < NV; ++j) mask[j] = first(cols - n0 - 16 * j);
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = p.x + (g * p.M + m0 + r) * p.K;
  __m512 a[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      const i64 at = (g * p.M + m0 + r) * cols + n0 + 16 * j;
      a[r][j] = p.acc ? _mm512_maskz_loadu_ps(mask[j], p.acc + at) : _mm512_setzero_ps();
    }
  for (i64 k = 0; k < p.K; ++k) {
    __m512 wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = _mm512_loadu_ps(pp + k * 16 * NV + 16 * j);
    for (int r = 0; r < MR; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r][k]);
      for (int j = 0; j < NV; ++j) a[r][j] = _mm512_fmadd_ps(xb, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j)
      _mm512_mask_storeu_ps(p.out + (g * p.M + m0 + r) * cols + n0 + 16 * j, mask[j], a[r][j]);
}

template <class W, int NV>
void kmajor_block(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0) {
  const W* w = p.weight<W>(g);
  const float* s = p.scale(g);
  thread_local std::vector<float> panel;
  if (panel.size() < static_cast<size_t>(p.K * 16 * NV)) panel.resize(p.K * 16 * NV);
  float* pp = panel.data();
  for (i64 k = 0; k < p.K; ++k)
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(pp + k * 16 * NV + 16 * j, kmajor_weights(p, w, s, k, n0 + 16 * j));
  i64 m = m0;
  if (NV == 4)  // 24 accumulators and 4 weight vectors in 32 registers
    for (; m + 6 <= m1; m += 6) kmajor_tile<6, NV>(p, g, m, n0, pp);
  for (; m + 4 <= m1; m += 4) kmajor_tile<4, NV>(p, g, m, n0, pp);
  switch (m1 - m) {
    case 3: kmajor_tile<3, NV>(p, g, m, n0, pp); break;
    case 2: kmajor_tile<2, NV>(p, g, m, n0, pp); break;
    case 1: kmajor_tile<1, NV>(p, g, m, n0, pp); break;
    default: break;
  }
}

// k-major, few rows (decode): rows [m0, m1) x columns [n0, n1), in
// sub-blocks of 16 NV columns, four weight rows a step: each weight vector
// is loaded once for every row and a step reads (n1 - n0) contiguous
// columns of four rows; the accumulators stay in L1. (Register tiles per
// row band read the weight from memory once and from L2 again for every
// further band: half the speed at 16 rows.) The same chains as the tiles.
template <class W, int NV>
void kmajor_stream(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  constexpr i64 kSub = 16 * NV;
  const W* w = p.weight<W>(g);
  const float* s = p.scale(g);
  const i64 cols = p.cols(), rows = m1 - m0;
  const i64 subs = (n1 - n0 + kSub - 1) / kSub;
  const i64 stride = subs * kSub;  // floats per accumulator row
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(rows * stride)) buf.resize(rows * stride);
  float* A = buf.data();
  for (i64 m = 0; m < rows; ++m)
    for (i64 c = 0; c < stride; c += 16) {
      const i64 at = (g * p.M + m0 + m) * cols + n0 + c;
      const __m512 a0 = p.acc ? _mm512_maskz_loadu_ps(first(cols - n0 - c), p.acc + at)
                              : _mm512_setzero_ps();
      _mm512_storeu_ps(A + m * stride + c, a0);
    }
  i64 k = 0;
  for (; k + 4 <= p.K; k += 4)
    for (i64 sb = 0; sb < subs; ++sb) {
      const i64 c0 = n0 + sb * kSub;
      __m512 wv[4][NV];
      if (s && (k / p.group == (k + 3) / p.group)) {  // one scale row for the four
        for (int j = 0; j < NV; ++j) {
          const __m512 sv = _mm512_maskz_loadu_ps(first(p.N - c0 - 16 * j),
                                                  s + (k / p.group) * p.N + c0 + 16 * j);
          for (int i = 0; i < 4; ++i) wv[i][j] = kmajor_weights(p, w, s, k + i, c0 + 16 * j, &sv);
        }
      } else {
        for (int i = 0; i < 4; ++i)
          for (int j = 0; j < NV; ++j) wv[i][j] = kmajor_weights(p, w, s, k + i, c0 + 16 * j);
      }
      for (i64 m = 0; m < rows; ++m) {
        const float* xm = p.x + (g * p.M + m0 + m) * p.K + k;
        const __m512 x0 = _mm512_set1_ps(xm[0]), x1 = _mm512_set1_ps(xm[1]);
        const __m512 x2 = _mm512_set1_ps(xm[2]), x3 = _mm512_set1_ps(xm[3]);
        for (int j = 0; j < NV; ++j) {
          float* a = A + m * stride + sb * kSub + 16 * j;
          __m512 t = _mm512_fmadd_ps(x0, wv[0][j], _mm512_loadu_ps(a));
          t = _mm512_fmadd_ps(x1, wv[1][j], t);
          t = _mm512_fmadd_ps(x2, wv[2][j], t);
          _mm512_storeu_ps(a, _mm512_fmadd_ps(x3, wv[3][j], t));
        }
      }
    }
  for (; k < p.K; ++k)
    for (i64 c = 0; c < stride; c += 16) {
      const __m512 wv = kmajor_weights(p, w, s, k, n0 + c);
      for (i64 m = 0; m < rows; ++m) {
        const __m512 xb = _mm512_set1_ps(p.x[(g * p.M + m0 + m) * p.K + k]);
        float* a = A + m * stride + c;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(xb, wv, _mm512_loadu_ps(a)));
      }
    }
  for (i64 m = 0; m < rows; ++m)
    for (i64 c = 0; c < n1 - n0; c += 16)
      _mm512_mask_storeu_ps(p.out + (g * p.M + m0 + m) * cols + n0 + c,
                            static_cast<__mmask16>(first(cols - n0 - c) & first(n1 - n0 - c)),
                            _mm512_loadu_ps(A + m * stride + c));
}

// n-major, RR weight rows [n, n + RR) x MR x rows [m, m + MR); w: f32 or
// bf16 rows of K (`rk` elements apart).
template <int RR, int MR, class W>
inline void nmajor_tile(const Problem& p, i64 g, const W* w, i64 rk, i64 m, i64 n) {
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = p.x + (g * p.M + m + r) * p.K;
  __m512 a[RR][MR];
  for (int i = 0; i < RR; ++i)
    for (int r = 0; r < MR; ++r) a[i][r] = _mm512_setzero_ps();
  i64 k = 0;
  for (; k + 16 <= p.K; k += 16) {
    __m512 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm512_loadu_ps(x[r] + k);
    for (int i = 0; i < RR; ++i) {
      const __m512 wv = load(w + i * rk + k);
      for (int r = 0; r < MR; ++r) a[i][r] = _mm512_fmadd_ps(xv[r], wv, a[i][r]);
    }
  }
  if (k < p.K) {  // the last, partial step
    const __mmask16 mk = first(p.K - k);
    __m512 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm512_maskz_loadu_ps(mk, x[r] + k);
    for (int i = 0; i < RR; ++i) {
      const __m512 wv = load(w + i * rk + k, mk);
      for (int r = 0; r < MR; ++r) a[i][r] = _mm512_fmadd_ps(xv[r], wv, a[i][r]);
    }
  }
  if constexpr (RR * MR == 16) {  // all 16 trees at once
    __m512 v[16];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < RR; ++i) v[r * RR + i] = a[i][r];
    alignas(64) float sums[16];
    _mm512_store_ps(sums, trees16(v));
    for (int r = 0; r < MR; ++r)
      std::memcpy(p.out + (g * p.M + m + r) * p.N + n, sums + r * RR, RR * sizeof(float));
  } else {
    for (int i = 0; i < RR; ++i)
      for (int r = 0; r < MR; ++r) p.out[(g * p.M + m + r) * p.N + n + i] = tree16(a[i][r]);
  }
}

template <int RR, class W>
inline void nmajor_rows(const Problem& p, i64 g, const W* w, i64 rk, i64 m0, i64 m1, i64 n) {
  i64 m = m0;
  for (; m + 4 <= m1; m += 4) nmajor_tile<RR, 4>(p, g, w, rk, m, n);
  switch (m1 - m) {
    case 3: nmajor_tile<RR, 3>(p, g, w, rk, m, n); break;
    case 2: nmajor_tile<RR, 2>(p, g, w, rk, m, n); break;
    case 1: nmajor_tile<RR, 1>(p, g, w, rk, m, n); break;
    default: break;
  }
}

// Weight rows [n0, n1) (w: row n0's first element), rows [m0, m1).
template <class W>
inline void nmajor_block_rows(const Problem& p, i64 g, const W* w, i64 m0, i64 m1,
                              i64 n0, i64 n1) {
  i64 n = n0;
  if (m1 - m0 < 4)  // few x rows: more weight rows for independent chains
    for (; n + 8 <= n1; n += 8) nmajor_rows<8>(p, g, w + (n - n0) * p.K, p.K, m0, m1, n);
  for (; n + 4 <= n1; n += 4) nmajor_rows<4>(p, g, w + (n - n0) * p.K, p.K, m0, m1, n);
  for (; n < n1; ++n) nmajor_rows<1>(p, g, w + (n - n0) * p.K, p.K, m0, m1, n);
}

// Weight rows [n0, n1), all rows of [m0, m1). An int8 weight's rows are
// first dequantized into an f32 buffer (each element times its group's
// scale), which the tiles then read.
template <class W>
void nmajor_block(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const W* w = p.weight<W>(g) + n0 * p.K;
  const float* s = p.scale(g);
  if constexpr (std::is_same_v<W, int8_t>) {
    thread_local std::vector<float> rows;
    if (rows.size() < static_cast<size_t>((n1 - n0) * p.K)) rows.resize((n1 - n0) * p.K);
    for (i64 n = n0; n < n1; ++n) {
      const int8_t* src = w + (n - n0) * p.K;
      float* dst = rows.data() + (n - n0) * p.K;
      for (i64 gr = 0; gr < p.groups; ++gr) {
        const __m512 sv = _mm512_set1_ps(s ? s[n * p.groups + gr] : 1.f);
        for (i64 k = gr * p.group; k < (gr + 1) * p.group; k += 16) {
          const __mmask16 mk = first((gr + 1) * p.group - k);
          _mm512_mask_storeu_ps(dst + k, mk, _mm512_mul_ps(load(src + k, mk), sv));
        }
      }
    }
    nmajor_block_rows(p, g, static_cast<const float*>(rows.data()), m0, m1, n0, n1);
  } else {
    nmajor_block_rows(p, g, w, m0, m1, n0, n1);
  }
}
#endif  // CW_INV512

// Row bands of this many rows per block (large M), and columns (k-major)
// or weight rows (n-major) per block.
constexpr i64 kBandRows = 96;
constexpr i64 kNBlock = 64;
// Multiply-adds below which a call runs on the calling thread alone.
constexpr i64 kInline = 1 << 18;

template <class W>
void run(ffi::ThreadPool& pool, const Problem& p, bool nmajor, bool portable) {
  const i64 width = nmajor ? p.N : p.cols();
#ifdef CW_INV512
  const bool five = !nmajor && width > 64 && width <= 80;
  // Few rows (k-major): wider blocks (whole lines of four weight rows a
  // step), two per thread, in multiples of 64 columns.
  const bool stream = !nmajor && p.M < kPackRows;
#else
  const bool five = false, stream = false;
#endif
  const i64 threads = std::max<i64>(1, pool.num_threads());
  const i64 wide = std::max<i64>(64, (width + 2 * threads - 1) / (2 * threads) + 63) / 64 * 64;
  const i64 nblock = five ? 80 : stream ? std::min<i64>(wide, 512) : kNBlock;
  const i64 nblocks = (width + nblock - 1) / nblock;
  const i64 bands = (p.M + kBandRows - 1) / kBandRows;
  const i64 total = p.G * bands * nblocks;
  auto body = [&, portable](i64 b) {
    const i64 g = b / (bands * nblocks);
    const i64 band = b / nblocks % bands;
    const i64 n0 = b % nblocks * nblock, n1 = std::min(width, n0 + nblock);
    const i64 m0 = band * kBandRows, m1 = std::min(p.M, m0 + kBandRows);
#ifdef CW_INV512
    if (!portable) {
      if (nmajor) nmajor_block<W>(p, g, m0, m1, n0, n1);
      else if (stream && five) kmajor_stream<W, 5>(p, g, m0, m1, n0, n1);
      else if (stream) kmajor_stream<W, 4>(p, g, m0, m1, n0, n1);
      else if (five) kmajor_block<W, 5>(p, g, m0, m1, n0);
      else kmajor_block<W, 4>(p, g, m0, m1, n0);
      return;
    }
#endif
    (void)portable;
    if (nmajor) nmajor_portable<W>(p, g, m0, m1, n0, n1);
    else kmajor_portable<W>(p, g, m0, m1, n0, n1);
  };
  // Small products (a decode step's attention: a few rows against a short
  // cache) run on the calling thread: waking a pool thread cost more.
  if (p.G * p.M * p.K * width < kInline) {
    for (i64 b = 0; b < total; ++b) body(b);
    return;
  }
  parallel_for(pool, total, body);
}

ffi::Error Invariant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                     ffi::Buffer<ffi::F32> acc, ffi::Buffer<ffi::S32> first,
                     ffi::ResultBuffer<ffi::F32> out, int64_t count,
                     int64_t nmajor, int64_t scaled, int64_t has_acc,
                     int64_t ones, int64_t portable) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 3 || wd.size() < 3 || sd.size() != 3 || od.size() != 3)
    return ffi::Error::InvalidArgument(
        "x, scale and out must be 3-D, w at least 3-D");
  // w's leading dims are its batch ([b, kv, S, D] attention caches are read
  // as they are: a reshape made XLA copy a loop's buffer every step).
  const size_t r = wd.size();
  int64_t gw = 1;
  for (size_t i = 0; i + 2 < r; ++i) gw *= wd[i];
  Problem p{};
  p.G = xd[0];
  p.M = xd[1];
  p.K = xd[2];
  p.N = nmajor ? wd[r - 2] : wd[r - 1];
  p.ones = ones != 0;
  if (count > 0) {  // a window of heads: w [b, heads, ...]
    if (r != 4 || p.G != wd[0] * count || count > wd[1] || scaled)
      return ffi::Error::InvalidArgument("a heads window needs w [b, kv, ., .], G = b * count");
    p.heads = wd[1];
    p.count = count;
    p.first = first.typed_data()[0];
    if (p.first < 0 || p.first + count > p.heads)
      return ffi::Error::InvalidArgument("heads window out of range");
    gw = p.G;
  }
  p.w_shared = gw == 1 && count == 0;
  if ((nmajor ? wd[r - 1] : wd[r - 2]) != p.K || (gw != 1 && gw != p.G))
    return ffi::Error::InvalidArgument("x and w shapes disagree");
  if (od[0] != p.G || od[1] != p.M || od[2] != p.cols())
    return ffi::Error::InvalidArgument("out shape disagrees");
  if (p.ones && nmajor) return ffi::Error::InvalidArgument("ones needs a k-major weight");
  p.groups = 1;
  p.group = p.K;
  if (scaled) {
    p.groups = nmajor ? sd[2] : sd[1];
    if (sd[0] != gw || (nmajor ? sd[1] : sd[2]) != p.N || p.groups <= 0 ||
        p.K % p.groups != 0)
      return ffi::Error::InvalidArgument("w and scale shapes disagree");
    p.group = p.K / p.groups;
    p.s = scale.typed_data();
  }
  if (has_acc) {
    auto ad = acc.dimensions();
    if (ad.size() != 3 || ad[0] != p.G || ad[1] != p.M || ad[2] != p.cols() || nmajor)
      return ffi::Error::InvalidArgument("acc needs a k-major product's [G, M, N']");
    p.acc = acc.typed_data();
  }
  p.x = x.typed_data();
  p.w = w.untyped_data();
  p.out = out->typed_data();
  if (p.G * p.M * p.cols() == 0) return ffi::Error::Success();
  const bool nm = nmajor != 0, port = portable != 0;
  switch (w.element_type()) {
    case ffi::DataType::S8: run<int8_t>(pool, p, nm, port); break;
    case ffi::DataType::BF16: run<uint16_t>(pool, p, nm, port); break;
    case ffi::DataType::F32: run<float>(pool, p, nm, port); break;
    default: return ffi::Error::InvalidArgument("w must be int8, bf16 or f32");
  }
  return ffi::Error::Success();
}

// ---- exp and log, the same operations in every lane -------------------------
//
// XLA:CPU computes exp and log with a vector routine in a loop's vector body
// and another in its scalar remainder, so an element's value depended on the
// array's shape (e.g. 7 elements vs 16). These are Cephes' single-precision
// polynomials (about 1 ulp), written once for a lane: `Lane` is a scalar
// (the portable definition) or an AVX-512 vector whose every operation
// rounds as the scalar one does; a call's tail runs the vector code on
// masked loads. exp flushes results below 2^-126 to 0 (x < -87.33) and
// overflows to inf above 88.72; log(0) = -inf (and of subnormals, which
// XLA:CPU flushes to 0), log(x < 0) = NaN.

struct Scalar {
  using F = float;
  using I = int32_t;
  static F set(float v) { return v; }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static F mul(F a, F b) { return a * b; }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F round(F a) { return std::nearbyint(a); }
  static F min(F a, F b) { return a < b ? a : b; }
  static F max(F a, F b) { return a > b ? a : b; }
  static I to_int(F a) { return static_cast<I>(a); }  // a is integral
  static F from_int(I a) { return static_cast<F>(a); }
  static I bits(F a) { I i; std::memcpy(&i, &a, 4); return i; }
  static F from_bits(I i) { F a; std::memcpy(&a, &i, 4); return a; }
  static I iadd(I a, I b) { return a + b; }
  static I iand(I a, I b) { return a & b; }
  static I ior(I a, I b) { return a | b; }
  static I shr(I a, int n) { return static_cast<I>(static_cast<uint32_t>(a) >> n); }
  static I shl(I a, int n) { return static_cast<I>(static_cast<uint32_t>(a) << n); }
  // where(c, a, b)
  static F lt_select(F x, F y, F a, F b) { return x < y ? a : b; }   // x < y ? a : b
  static F gt_select(F x, F y, F a, F b) { return x > y ? a : b; }
  static F nan_select(F x, F a) { return x != x ? x : a; }           // NaN x passes
};

template <class L>
typename L::F exp_lanes(typename L::F x) {
  using F = typename L::F;
  const F n = L::round(L::mul(x, L::set(1.44269504088896341f)));
  F r = L::fma(n, L::set(-0.693359375f), x);
  r = L::fma(n, L::set(2.12194440e-4f), r);
  F p = L::set(1.9875691500E-4f);
  p = L::fma(p, r, L::set(1.3981999507E-3f));
  p = L::fma(p, r, L::set(8.3334519073E-3f));
  p = L::fma(p, r, L::set(4.1665795894E-2f));
  p = L::fma(p, r, L::set(1.6666665459E-1f));
  p = L::fma(p, r, L::set(5.0000001201E-1f));
  const F y = L::add(L::fma(p, L::mul(r, r), r), L::set(1.f));
  // 2^n as a normal float's bits, n clamped to [-126, 127]; n = 128 (x
  // near 88.7) takes its last factor 2 apart. Out-of-range x below.
  const F nc = L::min(L::max(n, L::set(-126.f)), L::set(127.f));
  const F scale = L::from_bits(L::shl(L::iadd(L::to_int(nc), 127), 23));
  const F twice = L::gt_select(n, L::set(127.f), L::set(2.f), L::set(1.f));
  F out = L::mul(L::mul(y, twice), scale);
  out = L::gt_select(x, L::set(88.72283935546875f), L::set(INFINITY), out);
  out = L::lt_select(x, L::set(-87.33654022216797f), L::set(0.f), out);
  return L::nan_select(x, out);
}

template <class L>
typename L::F log_lanes(typename L::F x) {
  using F = typename L::F;
  using I = typename L::I;
  // XLA:CPU runs with subnormals flushed to zero: x < 2^-126 is 0 below.
  const I b = L::bits(x);
  F e = L::from_int(L::iadd(L::shr(b, 23), -127));
  F m = L::from_bits(L::ior(L::iand(b, 0x007fffff), 0x3f800000));  // [1, 2)
  // m > sqrt(2): m / 2 (exact) and e + 1.
  const F big = L::gt_select(m, L::set(1.41421356f), L::set(1.f), L::set(0.f));
  m = L::gt_select(m, L::set(1.41421356f), L::mul(m, L::set(0.5f)), m);
  e = L::add(e, big);
  const F f = L::sub(m, L::set(1.f));
  F y = L::set(7.0376836292E-2f);
  y = L::fma(y, f, L::set(-1.1514610310E-1f));
  y = L::fma(y, f, L::set(1.1676998740E-1f));
  y = L::fma(y, f, L::set(-1.2420140846E-1f));
  y = L::fma(y, f, L::set(1.4249322787E-1f));
  y = L::fma(y, f, L::set(-1.6668057665E-1f));
  y = L::fma(y, f, L::set(2.0000714765E-1f));
  y = L::fma(y, f, L::set(-2.4999993993E-1f));
  y = L::fma(y, f, L::set(3.3333331174E-1f));
  const F z = L::mul(f, f);
  y = L::mul(L::mul(y, f), z);
  y = L::fma(e, L::set(-2.12194440e-4f), y);
  y = L::fma(L::set(-0.5f), z, y);
  F out = L::fma(e, L::set(0.693359375f), L::add(f, y));
  out = L::gt_select(x, L::set(3.40282347e+38f), x, out);          // inf
  out = L::lt_select(x, L::set(1.17549435e-38f), L::set(-INFINITY), out);  // 0
  out = L::lt_select(x, L::set(0.f), L::set(NAN), out);            // x < 0
  return L::nan_select(x, out);
}

#ifdef CW_INV512
struct Vec {
  using F = __m512;
  using I = __m512i;
  static F set(float v) { return _mm512_set1_ps(v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F round(F a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static F min(F a, F b) {  // a < b ? a : b, as the scalar
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), b, a);
  }
  static F max(F a, F b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_GT_OQ), b, a);
  }
  static I to_int(F a) { return _mm512_cvttps_epi32(a); }
  static F from_int(I a) { return _mm512_cvtepi32_ps(a); }
  static I bits(F a) { return _mm512_castps_si512(a); }
  static F from_bits(I i) { return _mm512_castsi512_ps(i); }
  static I iadd(I a, int32_t b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
  static I iand(I a, int32_t b) { return _mm512_and_si512(a, _mm512_set1_epi32(b)); }
  static I ior(I a, int32_t b) { return _mm512_or_si512(a, _mm512_set1_epi32(b)); }
  static I shr(I a, int n) { return _mm512_srli_epi32(a, n); }
  static I shl(I a, int n) { return _mm512_slli_epi32(a, n); }
  static F lt_select(F x, F y, F a, F b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_LT_OQ), b, a);
  }
  static F gt_select(F x, F y, F a, F b) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, y, _CMP_GT_OQ), b, a);
  }
  static F nan_select(F x, F a) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), a, x);
  }
};
#endif

enum Unary : int64_t { kExp = 0, kLog = 1 };

void unary(ffi::ThreadPool& pool, const float* x, float* out, i64 n, int64_t op,
           bool portable) {
  constexpr i64 kBlock = 1 << 14;
  const i64 blocks = (n + kBlock - 1) / kBlock;
  parallel_for(pool, blocks, [=](i64 b) {
    const i64 i0 = b * kBlock, i1 = std::min(n, i0 + kBlock);
#ifdef CW_INV512
    if (!portable) {
      for (i64 i = i0; i < i1; i += 16) {
        const __mmask16 m = first(i1 - i);
        const __m512 v = _mm512_maskz_loadu_ps(m, x + i);
        _mm512_mask_storeu_ps(out + i, m, op == kExp ? exp_lanes<Vec>(v) : log_lanes<Vec>(v));
      }
      return;
    }
#endif
    for (i64 i = i0; i < i1; ++i)
      out[i] = op == kExp ? exp_lanes<Scalar>(x[i]) : log_lanes<Scalar>(x[i]);
  });
}

// out[m] = the row sum (16 lane chains, tree16) of exp(x[m, k] - shift[m]):
// bit for bit the n-major product of exp(x - shift) with ones, without
// writing exp(x - shift) out (a log-softmax's total).
void exp_sum(ffi::ThreadPool& pool, const float* x, const float* shift,
             float* out, i64 M, i64 K, bool portable) {
  const i64 per = std::max<i64>(1, (1 << 16) / std::max<i64>(K, 1));
  const i64 blocks = (M + per - 1) / per;
  parallel_for(pool, blocks, [=](i64 b) {
    for (i64 m = b * per; m < std::min(M, (b + 1) * per); ++m) {
      const float* xm = x + m * K;
#ifdef CW_INV512
      if (!portable) {
        const __m512 sh = _mm512_set1_ps(shift[m]);
        __m512 a = _mm512_setzero_ps();
        for (i64 k = 0; k < K; k += 16) {
          const __mmask16 mk = first(K - k);
          const __m512 e = exp_lanes<Vec>(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, xm + k), sh));
          a = _mm512_fmadd_ps(_mm512_maskz_mov_ps(mk, e), _mm512_maskz_mov_ps(mk, _mm512_set1_ps(1.f)), a);
        }
        out[m] = tree16(a);
        continue;
      }
#endif
      float a[16] = {};
      for (i64 k = 0; k < K; k += 16)
        for (int l = 0; l < 16; ++l) {
          const bool in = k + l < K;
          const float e = in ? exp_lanes<Scalar>(xm[k + l] - shift[m]) : 0.f;
          a[l] = std::fma(e, in ? 1.f : 0.f, a[l]);
        }
      out[m] = tree16(a);
    }
  });
}

ffi::Error ExpSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::Buffer<ffi::F32> shift, ffi::ResultBuffer<ffi::F32> out,
                  int64_t portable) {
  auto xd = x.dimensions();
  const i64 K = xd.size() ? xd[xd.size() - 1] : 1;
  const i64 M = K ? static_cast<i64>(x.element_count()) / K : 0;
  if (static_cast<i64>(shift.element_count()) != M ||
      static_cast<i64>(out->element_count()) != M)
    return ffi::Error::InvalidArgument("shift and out need one value per row of x");
  exp_sum(pool, x.typed_data(), shift.typed_data(), out->typed_data(), M, K, portable != 0);
  return ffi::Error::Success();
}

ffi::Error Unary(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                 ffi::ResultBuffer<ffi::F32> out, int64_t op, int64_t portable) {
  if (op != kExp && op != kLog) return ffi::Error::InvalidArgument("op: 0 exp, 1 log");
  unary(pool, x.typed_data(), out->typed_data(), static_cast<i64>(x.element_count()), op,
        portable != 0);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantMatmul, Invariant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("nmajor")
                                  .Attr<int64_t>("scaled")
                                  .Attr<int64_t>("has_acc")
                                  .Attr<int64_t>("ones")
                                  .Attr<int64_t>("portable"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantUnary, Unary,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("portable"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantExpSum, ExpSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("portable"));
