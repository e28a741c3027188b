// One instruction set's float vectors, for kernels.cc's templates: `Vec`
// (W lanes, loads, stores, fma, the fixed 16-lane tree of common.h) and
// `Vec::L` (the lane operations of exp_lanes / log_lanes), each operation
// rounding as its scalar twin does. Exactly one of CW_ISA_AVX512,
// CW_ISA_AVX2 (either with AVX-512 VNNI or not) and CW_ISA_NEON is defined
// by the build (build.py), with the matching compiler flags.

#ifndef CHUNKWISE_CPU_KERNELS_VEC_H_
#define CHUNKWISE_CPU_KERNELS_VEC_H_

#include "common.h"

#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
#include <immintrin.h>
#elif defined(CW_ISA_NEON)
#include <arm_neon.h>
#else
#error "kernels.cc is built with one of CW_ISA_AVX512, CW_ISA_AVX2, CW_ISA_NEON"
#endif

#ifndef CW_NS
#error "vec.h is included with -DCW_NS=<namespace>"
#endif

namespace chunkwise {
// Everything built for one instruction set lives in its namespace: a
// function of the same name built for another set would be the same
// symbol, and the linker would keep one copy for both.
namespace CW_NS {

#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
inline void prefetch(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
}
#else
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
#endif

// n (0 .. count) leading elements of p, the rest zero, through a buffer.
template <class T, int W>
inline void partial(const T* p, i64 n, T* buf) {
  for (int i = 0; i < W; ++i) buf[i] = i < n ? p[i] : T{0};
}

#if defined(CW_ISA_AVX512)
// ---- AVX-512 (F, BW, VL, DQ) ----------------------------------------------
struct Vec {
  static constexpr int W = 16;
  using V = __m512;
  static __mmask16 mask(i64 n) {
    return n >= 16 ? static_cast<__mmask16>(0xffff)
                   : static_cast<__mmask16>((1u << std::max<i64>(n, 0)) - 1);
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static V loadn(const float* p, i64 n) { return _mm512_maskz_loadu_ps(mask(n), p); }
  static V loadn(const uint16_t* p, i64 n) {
    const __m256i v = _mm256_maskz_loadu_epi16(mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static void storen(float* p, V v, i64 n) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V set_lane(V v, int lane, float value) {
    return _mm512_mask_blend_ps(static_cast<__mmask16>(1u << lane), v, _mm512_set1_ps(value));
  }
  static float tree16(const V* v) {
    const __m512 a = v[0];
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
  }
  // out[o] = tree16(v[o]) for 16 vectors at once: each level adds the same
  // pairs of lanes with the vectors' halves, quarters and pairs shuffled
  // side by side.
  static void trees16(const V* v, float* out) {
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
    _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
  }
  // r[i] lane j <-> r[j] lane i (16 x 16).
  static void transpose(V* r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
      const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 4; ++j) {
        t[8 * h + j] = _mm512_shuffle_f32x4(r[8 * h + j], r[8 * h + 4 + j], 0x88);
        t[8 * h + 4 + j] = _mm512_shuffle_f32x4(r[8 * h + j], r[8 * h + 4 + j], 0xdd);
      }
    for (int j = 0; j < 8; ++j) {
      r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
      r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
    }
  }
  // max |v| over lanes (exact), and whether every lane is finite.
  static V abs(V v) { return _mm512_abs_ps(v); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  static bool finite(V v) {  // |v| <= FLT_MAX (false for NaN and inf)
    return _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(3.40282347e+38f), _CMP_LE_OQ) ==
           0xffff;
  }
  static bool within(V v, float lo, float hi) {  // lo <= every lane <= hi (no NaN)
    return (_mm512_cmp_ps_mask(v, _mm512_set1_ps(lo), _CMP_GE_OQ) &
            _mm512_cmp_ps_mask(v, _mm512_set1_ps(hi), _CMP_LE_OQ)) == 0xffff;
  }
  // W rounded values (common.h's round_i16 of v) stored as int16.
  static void store_i16(int16_t* q, V v) {
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-32767.f)),
                                   _mm512_set1_ps(32767.f));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(c)));
  }
  // The same into int8 (q8's activations: common.h's round_i8).
  static void store_i8(int8_t* q, V v) {
    const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(c)));
  }

  struct L {
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
    static I shr(I a, int n) { return _mm512_srlv_epi32(a, _mm512_set1_epi32(n)); }
    static I shl(I a, int n) { return _mm512_sllv_epi32(a, _mm512_set1_epi32(n)); }
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
};

#elif defined(CW_ISA_AVX2)
// ---- AVX2 + FMA -------------------------------------------------------------
struct Vec {
  static constexpr int W = 8;
  using V = __m256;
  static __m256i mask(i64 n) {  // lanes < n all ones
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<i64>(std::max<i64>(n, 0), 8))), lanes);
  }
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  }
  static V loadn(const float* p, i64 n) { return _mm256_maskload_ps(p, mask(n)); }
  static V loadn(const uint16_t* p, i64 n) {
    alignas(32) uint16_t buf[8];
    partial<uint16_t, 8>(p, n, buf);
    return load(buf);
  }
  // n IEEE halves (f16 scales) as f32, exactly; zeros past n
  static V loadn_half(const uint16_t* p, i64 n) {
    if (n >= 8) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    alignas(32) uint16_t buf[8];
    partial<uint16_t, 8>(p, n, buf);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(buf)));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static void storen(float* p, V v, i64 n) { _mm256_maskstore_ps(p, mask(n), v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V set_lane(V v, int lane, float value) {
    const __m256 one = _mm256_castsi256_ps(
        _mm256_cmpeq_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(lane)));
    return _mm256_blendv_ps(v, _mm256_set1_ps(value), one);
  }
  // v[0]: lanes 0-7, v[1]: lanes 8-15.
  static float tree16(const V* v) {
    const __m256 t = _mm256_add_ps(v[0], v[1]);
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
  }
  // out[o] = tree16(v + 2 o) for 16 trees (8 lanes at a time per level).
  static void trees16(const V* v, float* out) {
    for (int h = 0; h < 2; ++h) {  // trees 8h .. 8h + 7
      const V* a = v + 16 * h;
      __m256 t[8];
      for (int i = 0; i < 8; ++i) t[i] = _mm256_add_ps(a[2 * i], a[2 * i + 1]);  // (l, l + 8)
      __m256 u[4];  // [t_2i lanes 0-3 + 4-7 | t_2i+1 ...]: (l, l + 4)
      for (int i = 0; i < 4; ++i)
        u[i] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(t[2 * i], t[2 * i + 1], 0x31));
      // u[i] = [tree 2i: 4 lanes | tree 2i+1: 4 lanes]
      __m256 w[2];  // (l, l + 2): [2i: 2, 2i+2: 2 | 2i+1: 2, 2i+3: 2]
      for (int i = 0; i < 2; ++i)
        w[i] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
      // (l, l + 1): [4i+0, 4i+2, 4i+4?...] lanes: w0 = [t0 l0,l1, t2 l0,l1 | t1.., t3..]
      const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
      // r = [t0, t2, t4, t6 | t1, t3, t5, t7]
      alignas(32) float tmp[8];
      _mm256_store_ps(tmp, r);
      for (int i = 0; i < 4; ++i) {
        out[8 * h + 2 * i] = tmp[i];
        out[8 * h + 2 * i + 1] = tmp[4 + i];
      }
    }
  }
  // r[i] lane j <-> r[j] lane i (8 x 8).
  static void transpose(V* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
    }
    for (int j = 0; j < 4; ++j) {
      r[j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x20);
      r[4 + j] = _mm256_permute2f128_ps(u[j], u[4 + j], 0x31);
    }
  }
  static V abs(V v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hmax(V v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static bool finite(V v) {
    return _mm256_movemask_ps(_mm256_cmp_ps(abs(v), _mm256_set1_ps(3.40282347e+38f), _CMP_LE_OQ)) ==
           0xff;
  }
  static bool within(V v, float lo, float hi) {
    return _mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, _mm256_set1_ps(lo), _CMP_GE_OQ),
                                            _mm256_cmp_ps(v, _mm256_set1_ps(hi), _CMP_LE_OQ))) ==
           0xff;
  }
  static void store_i16(int16_t* q, V v) {
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-32767.f)),
                                   _mm256_set1_ps(32767.f));
    const __m256i i = _mm256_cvtps_epi32(c);
    const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), p);
  }
  static void store_i8(int8_t* q, V v) {
    const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f));
    const __m256i i = _mm256_cvtps_epi32(c);
    const __m128i p = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q), _mm_packs_epi16(p, p));
  }

  struct L {
    using F = __m256;
    using I = __m256i;
    static F set(float v) { return _mm256_set1_ps(v); }
    static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F add(F a, F b) { return _mm256_add_ps(a, b); }
    static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
    static F round(F a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
    static F min(F a, F b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_LT_OQ)); }
    static F max(F a, F b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
    static I to_int(F a) { return _mm256_cvttps_epi32(a); }
    static F from_int(I a) { return _mm256_cvtepi32_ps(a); }
    static I bits(F a) { return _mm256_castps_si256(a); }
    static F from_bits(I i) { return _mm256_castsi256_ps(i); }
    static I iadd(I a, int32_t b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
    static I iand(I a, int32_t b) { return _mm256_and_si256(a, _mm256_set1_epi32(b)); }
    static I ior(I a, int32_t b) { return _mm256_or_si256(a, _mm256_set1_epi32(b)); }
    static I shr(I a, int n) { return _mm256_srlv_epi32(a, _mm256_set1_epi32(n)); }
    static I shl(I a, int n) { return _mm256_sllv_epi32(a, _mm256_set1_epi32(n)); }
    static F lt_select(F x, F y, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_LT_OQ)); }
    static F gt_select(F x, F y, F a, F b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, y, _CMP_GT_OQ)); }
    static F nan_select(F x, F a) { return _mm256_blendv_ps(a, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q)); }
  };
};

#elif defined(CW_ISA_NEON)
// ---- AArch64 NEON (Advanced SIMD) ----------------------------------------
struct Vec {
  static constexpr int W = 4;
  using V = float32x4_t;
  static V zero() { return vdupq_n_f32(0.f); }
  static V set1(float v) { return vdupq_n_f32(v); }
  static V load(const float* p) { return vld1q_f32(p); }
  static V load(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  template <class T>
  static V loadn(const T* p, i64 n) {
    T buf[4];
    partial<T, 4>(p, n, buf);
    return load(buf);
  }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static void storen(float* p, V v, i64 n) {
    float buf[4];
    vst1q_f32(buf, v);
    for (i64 i = 0; i < std::min<i64>(n, 4); ++i) p[i] = buf[i];
  }
  static V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V set_lane(V v, int lane, float value) {
    float buf[4];
    vst1q_f32(buf, v);
    buf[lane] = value;
    return vld1q_f32(buf);
  }
  // v[q]: lanes 4q .. 4q + 3.
  static float tree16(const V* v) {
    const float32x4_t t0 = vaddq_f32(v[0], v[2]), t1 = vaddq_f32(v[1], v[3]);  // (l, l + 8)
    const float32x4_t u = vaddq_f32(t0, t1);                                      // (l, l + 4)
    const float32x2_t w = vadd_f32(vget_low_f32(u), vget_high_f32(u));           // (l, l + 2)
    return vget_lane_f32(w, 0) + vget_lane_f32(w, 1);                             // (l, l + 1)
  }
  static void trees16(const V* v, float* out) {
    for (int o = 0; o < 16; ++o) out[o] = tree16(v + 4 * o);
  }
  // r[i] lane j <-> r[j] lane i (4 x 4).
  static void transpose(V* r) {
    const float32x4x2_t a = vtrnq_f32(r[0], r[1]), b = vtrnq_f32(r[2], r[3]);
    r[0] = vcombine_f32(vget_low_f32(a.val[0]), vget_low_f32(b.val[0]));
    r[1] = vcombine_f32(vget_low_f32(a.val[1]), vget_low_f32(b.val[1]));
    r[2] = vcombine_f32(vget_high_f32(a.val[0]), vget_high_f32(b.val[0]));
    r[3] = vcombine_f32(vget_high_f32(a.val[1]), vget_high_f32(b.val[1]));
  }
  static V abs(V v) { return vabsq_f32(v); }
  static V max(V a, V b) { return vmaxq_f32(a, b); }
  static float hmax(V v) { return vmaxvq_f32(v); }
  static bool finite(V v) {
    return vminvq_u32(vcleq_f32(vabsq_f32(v), vdupq_n_f32(3.40282347e+38f))) != 0;
  }
  static bool within(V v, float lo, float hi) {
    return vminvq_u32(vandq_u32(vcgeq_f32(v, vdupq_n_f32(lo)), vcleq_f32(v, vdupq_n_f32(hi)))) != 0;
  }
  static void store_i16(int16_t* q, V v) {
    const float32x4_t c = vminq_f32(vmaxq_f32(vrndnq_f32(v), vdupq_n_f32(-32767.f)),
                                    vdupq_n_f32(32767.f));
    vst1_s16(q, vmovn_s32(vcvtq_s32_f32(c)));
  }
  static void store_i8(int8_t* q, V v) {
    const float32x4_t c = vminq_f32(vmaxq_f32(vrndnq_f32(v), vdupq_n_f32(-127.f)),
                                    vdupq_n_f32(127.f));
    const int16x4_t h = vmovn_s32(vcvtq_s32_f32(c));
    const int8x8_t b = vmovn_s16(vcombine_s16(h, h));
    int8_t tmp[8];
    vst1_s8(tmp, b);
    std::memcpy(q, tmp, 4);
  }

  struct L {
    using F = float32x4_t;
    using I = int32x4_t;
    static F set(float v) { return vdupq_n_f32(v); }
    static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }
    static F mul(F a, F b) { return vmulq_f32(a, b); }
    static F add(F a, F b) { return vaddq_f32(a, b); }
    static F sub(F a, F b) { return vsubq_f32(a, b); }
    static F round(F a) { return vrndnq_f32(a); }
    static F min(F a, F b) { return vbslq_f32(vcltq_f32(a, b), a, b); }
    static F max(F a, F b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
    static I to_int(F a) { return vcvtq_s32_f32(a); }
    static F from_int(I a) { return vcvtq_f32_s32(a); }
    static I bits(F a) { return vreinterpretq_s32_f32(a); }
    static F from_bits(I i) { return vreinterpretq_f32_s32(i); }
    static I iadd(I a, int32_t b) { return vaddq_s32(a, vdupq_n_s32(b)); }
    static I iand(I a, int32_t b) { return vandq_s32(a, vdupq_n_s32(b)); }
    static I ior(I a, int32_t b) { return vorrq_s32(a, vdupq_n_s32(b)); }
    static I shr(I a, int n) {
      return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(-n)));
    }
    static I shl(I a, int n) {
      return vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(a), vdupq_n_s32(n)));
    }
    static F lt_select(F x, F y, F a, F b) { return vbslq_f32(vcltq_f32(x, y), a, b); }
    static F gt_select(F x, F y, F a, F b) { return vbslq_f32(vcgtq_f32(x, y), a, b); }
    static F nan_select(F x, F a) { return vbslq_f32(vceqq_f32(x, x), a, x); }
  };
};
#endif

// 16 virtual lanes: kParts vectors of W lanes.
constexpr int kParts = 16 / Vec::W;

}  // namespace CW_NS
}  // namespace chunkwise

#endif  // CHUNKWISE_CPU_KERNELS_VEC_H_
