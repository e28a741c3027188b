// int8 weights x int16 activations, included by kernels.cc inside its
// namespace (one build per instruction set). What each output is: common.h
// (int32 sums per chunk of a weight group, exact in any order, then one
// f32 chain over the chunks); portable.cc's int8_row is its plain form.
//
// k-major weights are read in place, a tile's int32 sums in registers:
// x86 widens two weight rows' bytes into int16 pairs that multiply a pair
// of inputs (madd; VNNI's dpwssd where built), NEON widens one row and
// multiply-adds it by one input per step. n-major weights (a tied
// embedding table unembedding) are, on x86, transposed 16 table rows at a
// time into that pair form in an L1 buffer; on NEON read as rows, each
// chunk's sum reduced across lanes (exact) before its f32 step.

// Each output row's chain starts from acc (or +0); the kernels then add
// one chunk at a time into `out`.
inline void int8_start(const Problem& p, i64 g, i64 m, i64 n0, i64 n1) {
  const float* acc = p.arow(g, m);
  float* out = p.orow(g, m);
  for (i64 n = n0; n < n1; ++n) out[n] = acc ? acc[n] : 0.f;
}

// The factor of chunks of group gr for output n: s_w * sx (one rounding).
inline float int8_scale(const Problem& p, const float* s, i64 gr, i64 n) {
  return p.nmajor ? s[n * p.groups + gr] : s[gr * p.N + n];
}

#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)

// n-major pack: table rows [n, n + rows) (rows <= 16) as k-major int16
// pairs in `buf`: pair j of group gr (inputs 2j, 2j + 1 of the group; past
// the group's end 0) of the 16 rows at buf + 32 (gr * Pp + j), row r's
// pair at lanes 2r, 2r + 1; rows past `rows` zero. Pp = (group + 1) / 2.
inline void nmajor_pack_scalar(const Problem& p, const int8_t* w, int16_t* buf, i64 n,
                               i64 rows) {
  const i64 pp = (p.group + 1) / 2;
  for (i64 gr = 0; gr < p.groups; ++gr)
    for (i64 j = 0; j < pp; ++j) {
      int16_t* out = buf + 32 * (gr * pp + j);
      for (int r = 0; r < 16; ++r)
        for (int h = 0; h < 2; ++h) {
          const i64 t = 2 * j + h;
          const i64 k = gr * p.group + t;
          const uint8_t* w4 = reinterpret_cast<const uint8_t*>(w);
          out[2 * r + h] = r < rows && t < p.group
                               ? (p.u4() ? u4_code(p, w4, k, n + r) : w[(n + r) * p.K + k])
                               : int16_t{0};
        }
    }
}

// The same for even groups (a pair never straddles two), 32 inputs at a
// time: a 16 x 16 transpose of 16-bit words (pairs of int8 inputs), then
// widened.
inline void nmajor_pack(const Problem& p, const int8_t* w, int16_t* buf, i64 n, i64 rows) {
  if (p.group % 2 || p.u4()) return nmajor_pack_scalar(p, w, buf, n, rows);
  const i64 K = p.K;
  for (i64 k = 0; k < K; k += 32) {
    alignas(32) int8_t tail[16][32];
    __m256i a[16];
    for (int j = 0; j < 16; ++j) {
      if (j >= rows) {
        a[j] = _mm256_setzero_si256();
      } else if (K - k >= 32) {
        a[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n + j) * K + k));
      } else {
        std::memset(tail[j], 0, 32);
        std::memcpy(tail[j], w + (n + j) * K + k, K - k);
        a[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail[j]));
      }
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
      if (v < pairs) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v * 32),
                            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(lo)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + v * 32 + 16),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(lo, 1)));
      }
      if (v + 8 < pairs) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (v + 8) * 32),
                            _mm256_cvtepi8_epi16(_mm256_castsi256_si128(hi)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (v + 8) * 32 + 16),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(hi, 1)));
      }
    }
  }
}

// A weight's per-group scales as the tiles read them: f32 (`f`),
// or GGUF's f16 (`h`, one shared weight) converted in the tile, exactly:
// no pass widening them first.
struct Scales {
  const float* f;
  const uint16_t* h;
};

inline int32_t pair_bits(const int16_t* x) {  // (x[0], x[1]) as one int32
  int32_t v;
  std::memcpy(&v, x, sizeof(v));
  return v;
}
#endif

#if defined(CW_ISA_AVX512)
// ---- AVX-512 -------------------------------------------------------------------

constexpr int kMR8 = 8;  // x rows per int8 register tile

// acc += a . b over int16 pairs (VNNI `vpdpwssd` where built for it).
inline __m512i dp16(__m512i acc, __m512i a, __m512i b) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

// k-major: columns [n, n + cols) (cols <= 32; fewer read and written under
// a mask) of rows [m0, m0 + MR) of batch g, into their chains in `out`.
// Two weight rows a step: their 32 columns' bytes interleaved and widened
// to int16 pairs, columns {0-7, 16-23} in `lo`, {8-15, 24-31} in `hi` (put
// back in order once a chunk). A step's second row past the chunk reads
// `zeros`.
template <int MR, bool MASKED, bool U4>
void kmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const Scales& s, const int8_t* zeros, i64 m0, i64 n, i64 cols) {
  const __m256i nib = _mm256_set1_epi8(15);
  const __mmask32 bmask = MASKED ? static_cast<__mmask32>((1ull << cols) - 1) : ~0u;
  const __mmask16 f0 = static_cast<__mmask16>(bmask), f1 = static_cast<__mmask16>(bmask >> 16);
  const i64 N = p.N;
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const i64 k0 = gr * p.group;
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    const i64 at = gr * N + n;
    const __m512 s0 = s.f ? _mm512_maskz_loadu_ps(f0, s.f + at)
                          : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(f0, s.h + at));
    const __m512 s1 = s.f ? _mm512_maskz_loadu_ps(f1, s.f + at + 16)
                          : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(f1, s.h + at + 16));
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      __m512i lo[MR], hi[MR];
      for (int m = 0; m < MR; ++m) lo[m] = hi[m] = _mm512_setzero_si512();
      for (i64 t = c0; t < c1; t += 2) {
        const int8_t* r0 = U4 ? w + (k0 + t) / 2 * N + n : w + (k0 + t) * N + n;
        const int8_t* r1 = U4 ? r0 : t + 1 < c1 ? r0 + N : zeros + n;
        if ((n & 63) == 0) {  // this row's next line, for the next tiles
          prefetch(r0 + 64);
          if (!U4) prefetch(r1 + 64);
        }
        __m256i a, b;
        if (U4) {  // both rows in one: even k low nibble, odd k high
          const __m256i c = MASKED ? _mm256_maskz_loadu_epi8(bmask, r0)
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
          a = _mm256_and_si256(c, nib);
          b = _mm256_and_si256(_mm256_srli_epi16(c, 4), nib);
        } else if (MASKED) {
          a = _mm256_maskz_loadu_epi8(bmask, r0);
          b = _mm256_maskz_loadu_epi8(bmask, r1);
        } else {
          a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0));
          b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1));
        }
        const __m512i wl = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
        const __m512i wh = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
        for (int m = 0; m < MR; ++m) {
          const __m512i xp = _mm512_set1_epi32(pair_bits(xg[m] + t));
          lo[m] = dp16(lo[m], wl, xp);
          hi[m] = dp16(hi[m], wh, xp);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m512 xs = _mm512_set1_ps(xq.scale_of(g * p.M + m0 + m, gr));
        const __m512 v0 = _mm512_cvtepi32_ps(_mm512_shuffle_i64x2(lo[m], hi[m], 0x44));
        const __m512 v1 = _mm512_cvtepi32_ps(_mm512_shuffle_i64x2(lo[m], hi[m], 0xEE));
        float* a = p.orow(g, m0 + m) + n;
        _mm512_mask_storeu_ps(a, f0, _mm512_fmadd_ps(v0, _mm512_mul_ps(s0, xs),
                                                    _mm512_maskz_loadu_ps(f0, a)));
        _mm512_mask_storeu_ps(a + 16, f1, _mm512_fmadd_ps(v1, _mm512_mul_ps(s1, xs),
                                                         _mm512_maskz_loadu_ps(f1, a + 16)));
      }
    }
  }
}

template <int MR, bool U4>
void kmajor_cols_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const Scales& s, const int8_t* zeros, i64 m0, i64 n0, i64 n1) {
  i64 n = n0;
  for (; n + 32 <= n1; n += 32) kmajor_tile_i8<MR, false, U4>(p, xq, g, w, s, zeros, m0, n, 32);
  if (n < n1) kmajor_tile_i8<MR, true, U4>(p, xq, g, w, s, zeros, m0, n, n1 - n);
}

template <int MR>
void kmajor_cols_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const Scales& s, const int8_t* zeros, i64 m0, i64 n0, i64 n1) {
  if (p.u4()) kmajor_cols_i8<MR, true>(p, xq, g, w, s, zeros, m0, n0, n1);
  else kmajor_cols_i8<MR, false>(p, xq, g, w, s, zeros, m0, n0, n1);
}

// k-major: columns [n0, n1), every row of batch g. Column strips of 64 (a
// cache line is two tiles), row tiles inside: a strip's weight lines are
// read from memory once, then from cache for every further row tile.
void kmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* zeros, i64 n0,
               i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16};
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 64) {
    const i64 e = std::min(n1, n + 64);
    i64 m = 0;
    for (; m + kMR8 <= p.M; m += kMR8) kmajor_cols_i8<kMR8>(p, xq, g, w, s, zeros, m, n, e);
    switch (p.M - m) {
#define CW_CASE(r) \
  case r: kmajor_cols_i8<r>(p, xq, g, w, s, zeros, m, n, e); break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4) CW_CASE(5) CW_CASE(6) CW_CASE(7)
#undef CW_CASE
      default: break;
    }
  }
}

// n-major: group gr's scales (or offsets) of table rows [n, n + rows)
// (rows <= 16) as f32 (rows past `rows` 0): gathered, f16 converted in one
// step.
inline __m512 nmajor_scales(const Problem& p, const Scales& s, i64 n, i64 rows, i64 gr) {
  if (s.f) {
    alignas(64) float sw[16] = {};
    for (i64 r = 0; r < rows; ++r) sw[r] = s.f[(n + r) * p.groups + gr];
    return _mm512_load_ps(sw);
  }
  alignas(32) uint16_t hw[16] = {};
  for (i64 r = 0; r < rows; ++r) hw[r] = s.h[(n + r) * p.groups + gr];
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(hw)));
}

// n-major: out[m0 .. m0 + MR, n .. n + rows) from a packed block. Prefetches
// `lines` cache lines from `ahead` (the next block), spread over the groups.
template <int MR>
void nmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int16_t* buf,
                    const Scales& s, i64 m0, i64 n, i64 rows, const char* ahead, i64 lines) {
  const i64 pp = (p.group + 1) / 2;
  const __mmask16 rm = static_cast<__mmask16>((1u << rows) - 1);
  __m512 total[MR];
  for (int m = 0; m < MR; ++m) total[m] = _mm512_maskz_loadu_ps(rm, p.orow(g, m0 + m) + n);
  for (i64 gr = 0; gr < p.groups; ++gr) {
    for (i64 l = lines * gr / p.groups; l < lines * (gr + 1) / p.groups; ++l)
      prefetch(ahead + 64 * l);
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    const __m512 sv = nmajor_scales(p, s, n, rows, gr);
    const int16_t* bg = buf + 32 * gr * pp;
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      __m512i part[MR];
      for (int m = 0; m < MR; ++m) part[m] = _mm512_setzero_si512();
      for (i64 t = c0; t < c1; t += 2) {
        const __m512i wv = _mm512_loadu_si512(bg + t * 16);
        for (int m = 0; m < MR; ++m)
          part[m] = dp16(part[m], wv, _mm512_set1_epi32(pair_bits(xg[m] + t)));
      }
      for (int m = 0; m < MR; ++m)
        total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[m]),
                                   _mm512_mul_ps(sv, _mm512_set1_ps(xq.scale_of(g * p.M + m0 + m, gr))),
                                   total[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(p.orow(g, m0 + m) + n, rm, total[m]);
}

// n-major: table rows [n0, n1) of batch g, all rows, 16 table rows a block.
void nmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16};
  const i64 pp = (p.group + 1) / 2;
  thread_local LineBuffer<int16_t> lines;
  int16_t* buf = lines.get(32 * pp * p.groups);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 16) {
    const i64 rows = std::min<i64>(16, n1 - n);
    // the next block (contiguous rows), prefetched by the first row tile
    const char* next = reinterpret_cast<const char*>(w + (n + 16) * p.K);
    i64 lines = (std::min<i64>(16, std::max<i64>(0, n1 - n - 16)) * p.K + 63) / 64;
    nmajor_pack(p, w, buf, n, rows);
    i64 m = 0;
    for (; m + kMR8 <= p.M; m += kMR8, lines = 0)
      nmajor_tile_i8<kMR8>(p, xq, g, buf, s, m, n, rows, next, lines);
    switch (p.M - m) {
#define CW_CASE(r) \
  case r: nmajor_tile_i8<r>(p, xq, g, buf, s, m, n, rows, next, lines); break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4) CW_CASE(5) CW_CASE(6) CW_CASE(7)
#undef CW_CASE
      default: break;
    }
  }
}

#elif defined(CW_ISA_AVX2)
// ---- AVX2 ---------------------------------------------------------------------

// k-major: rows [m0, m0 + MR) x columns [n, n + 16 H) of batch g (`cols`
// of them valid: a narrower tail reads its bytes through a zeroed copy),
// into their chains in `out`. Two weight rows a step, widened into int16
// pairs: columns [16h, 16h + 8) in lo[h], [16h + 8, 16h + 16) in hi[h].
template <int MR, int H>
void kmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const Scales& s, i64 m0, i64 n, i64 cols) {
  const i64 N = p.N;
  const bool tail = cols < 16 * H;
  const bool u4 = p.u4();
  const __m128i nib = _mm_set1_epi8(15);
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const i64 k0 = gr * p.group;
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      __m256i lo[MR][H], hi[MR][H];
      for (int m = 0; m < MR; ++m)
        for (int h = 0; h < H; ++h) lo[m][h] = hi[m][h] = _mm256_setzero_si256();
      for (i64 t = c0; t < c1; t += 2) {
        const int8_t* r0 = u4 ? w + (k0 + t) / 2 * N + n : w + (k0 + t) * N + n;
        const bool two = u4 || t + 1 < c1;
        if ((n & 63) == 0 && k0 + t + kAhead + 2 <= p.K) {
          prefetch(r0 + (u4 ? kAhead / 2 : kAhead) * N);
          if (!u4) prefetch(r0 + (kAhead + 1) * N);
        }
        alignas(32) int8_t buf[2][32];
        const int8_t *a0 = r0, *a1 = u4 ? r0 : r0 + N;
        if (tail || !two) {
          std::memset(buf, 0, sizeof(buf));
          std::memcpy(buf[0], r0, std::min<i64>(cols, 16 * H));
          if (two && !u4) std::memcpy(buf[1], r0 + N, std::min<i64>(cols, 16 * H));
          a0 = buf[0];
          a1 = u4 ? buf[0] : buf[1];
        }
        __m256i wl[H], wh[H];
        for (int h = 0; h < H; ++h) {
          __m128i va = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a0 + 16 * h));
          __m128i vb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a1 + 16 * h));
          if (u4) {  // both rows in one: even k low nibble, odd k high
            vb = _mm_and_si128(_mm_srli_epi16(va, 4), nib);
            va = _mm_and_si128(va, nib);
          }
          wl[h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(va, vb));
          wh[h] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(va, vb));
        }
        for (int m = 0; m < MR; ++m) {
          const __m256i xp = _mm256_set1_epi32(pair_bits(xg[m] + t));
          for (int h = 0; h < H; ++h) {
            lo[m][h] = _mm256_add_epi32(lo[m][h], _mm256_madd_epi16(wl[h], xp));
            hi[m][h] = _mm256_add_epi32(hi[m][h], _mm256_madd_epi16(wh[h], xp));
          }
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 xs = _mm256_set1_ps(xq.scale_of(g * p.M + m0 + m, gr));
        float* a = p.orow(g, m0 + m) + n;
        for (int h = 0; h < H; ++h)
          for (int half = 0; half < 2; ++half) {
            const i64 c = 16 * h + 8 * half;
            const i64 left = cols - c;
            if (left <= 0) continue;
            const __m256 sum = _mm256_cvtepi32_ps(half ? hi[m][h] : lo[m][h]);
            const i64 at = gr * N + n + c;
            const __m256 sv = s.f ? Vec::loadn(s.f + at, left) : Vec::loadn_half(s.h + at, left);
            const __m256 f = _mm256_mul_ps(sv, xs);
            if (left >= 8) _mm256_storeu_ps(a + c, _mm256_fmadd_ps(sum, f, _mm256_loadu_ps(a + c)));
            else Vec::storen(a + c, _mm256_fmadd_ps(sum, f, Vec::loadn(a + c, left)), left);
          }
      }
    }
  }
}

template <int MR, int H>
void kmajor_cols_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const Scales& s, i64 m0, i64 n0, i64 n1) {
  i64 n = n0;
  for (; n + 16 * H <= n1; n += 16 * H) kmajor_tile_i8<MR, H>(p, xq, g, w, s, m0, n, 16 * H);
  for (; n < n1; n += 16) kmajor_tile_i8<MR, 1>(p, xq, g, w, s, m0, n, std::min<i64>(16, n1 - n));
}

void kmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t*, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16};
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 64) {
    const i64 e = std::min(n1, n + 64);
    i64 m = 0;
    for (; m + 4 <= p.M; m += 4) kmajor_cols_i8<4, 1>(p, xq, g, w, s, m, n, e);
    for (; m + 2 <= p.M; m += 2) kmajor_cols_i8<2, 2>(p, xq, g, w, s, m, n, e);
    if (m < p.M) kmajor_cols_i8<1, 2>(p, xq, g, w, s, m, n, e);
  }
}

// n-major: out[m0 .. m0 + MR, n .. n + rows) from a packed block (16 table
// rows as 2 x 8 int32 lanes).
template <int MR>
void nmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int16_t* buf,
                    const Scales& s, i64 m0, i64 n, i64 rows) {
  const i64 pp = (p.group + 1) / 2;
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    alignas(32) float sw[16] = {};
    if (s.f) {
      for (i64 r = 0; r < rows; ++r) sw[r] = s.f[(n + r) * p.groups + gr];
    } else {  // f16 (GGUF's): gathered, converted 8 at a time
      alignas(16) uint16_t hw[16] = {};
      for (i64 r = 0; r < rows; ++r) hw[r] = s.h[(n + r) * p.groups + gr];
      for (int h = 0; h < 2; ++h)
        _mm256_store_ps(sw + 8 * h,
                        _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(hw + 8 * h))));
    }
    const int16_t* bg = buf + 32 * gr * pp;
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      __m256i part[MR][2];
      for (int m = 0; m < MR; ++m) part[m][0] = part[m][1] = _mm256_setzero_si256();
      for (i64 t = c0; t < c1; t += 2) {
        const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + t * 16));
        const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bg + t * 16 + 16));
        for (int m = 0; m < MR; ++m) {
          const __m256i xp = _mm256_set1_epi32(pair_bits(xg[m] + t));
          part[m][0] = _mm256_add_epi32(part[m][0], _mm256_madd_epi16(w0, xp));
          part[m][1] = _mm256_add_epi32(part[m][1], _mm256_madd_epi16(w1, xp));
        }
      }
      for (int m = 0; m < MR; ++m) {
        const __m256 xs = _mm256_set1_ps(xq.scale_of(g * p.M + m0 + m, gr));
        float* a = p.orow(g, m0 + m) + n;
        for (int h = 0; h < 2; ++h) {
          const i64 left = rows - 8 * h;
          if (left <= 0) continue;
          const __m256 f = _mm256_mul_ps(_mm256_load_ps(sw + 8 * h), xs);
          const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part[m][h]), f,
                                           Vec::loadn(a + 8 * h, left));
          if (left >= 8) _mm256_storeu_ps(a + 8 * h, v);
          else Vec::storen(a + 8 * h, v, left);
        }
      }
    }
  }
}

void nmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16};
  const i64 pp = (p.group + 1) / 2;
  thread_local LineBuffer<int16_t> lines;
  int16_t* buf = lines.get(32 * pp * p.groups);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 16) {
    const i64 rows = std::min<i64>(16, n1 - n);
    for (i64 r = 16; r < 32 && n + r < n1; r += 2)  // the next block
      for (i64 k = 0; k < p.K; k += 64) prefetch(w + (n + r) * p.K + k);
    nmajor_pack(p, w, buf, n, rows);
    i64 m = 0;
    for (; m + 4 <= p.M; m += 4) nmajor_tile_i8<4>(p, xq, g, buf, s, m, n, rows);
    for (; m < p.M; ++m) nmajor_tile_i8<1>(p, xq, g, buf, s, m, n, rows);
  }
}

#else
// ---- NEON ---------------------------------------------------------------------

// k-major: rows [m0, m0 + MR) x 16 columns from n (`cols` valid: a
// narrower tail reads through a zeroed copy), one weight row a step
// widened to int16 and multiplied by each row's input into 4 x 4 int32.
template <int MR>
void kmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const float* s, i64 m0, i64 n, i64 cols) {
  const i64 N = p.N;
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const i64 k0 = gr * p.group;
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      int32x4_t acc[MR][4];
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < 4; ++j) acc[m][j] = vdupq_n_s32(0);
      for (i64 t = c0; t < c1; ++t) {
        const int8_t* r = p.u4() ? w + (k0 + t) / 2 * N + n : w + (k0 + t) * N + n;
        int8x16_t v;
        if (cols >= 16) {
          v = vld1q_s8(r);
        } else {
          int8_t buf[16] = {};
          std::memcpy(buf, r, cols);
          v = vld1q_s8(buf);
        }
        if (p.u4()) {  // even k: low nibbles; odd k: high
          const uint8x16_t c = vreinterpretq_u8_s8(v);
          v = vreinterpretq_s8_u8((k0 + t) & 1 ? vshrq_n_u8(c, 4) : vandq_u8(c, vdupq_n_u8(15)));
        }
        const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
        for (int m = 0; m < MR; ++m) {
          const int16_t xk = xg[m][t];
          acc[m][0] = vmlal_n_s16(acc[m][0], vget_low_s16(lo), xk);
          acc[m][1] = vmlal_high_n_s16(acc[m][1], lo, xk);
          acc[m][2] = vmlal_n_s16(acc[m][2], vget_low_s16(hi), xk);
          acc[m][3] = vmlal_high_n_s16(acc[m][3], hi, xk);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const float32x4_t xs = vdupq_n_f32(xq.scale_of(g * p.M + m0 + m, gr));
        float* a = p.orow(g, m0 + m) + n;
        for (int j = 0; j < 4; ++j) {
          const i64 left = cols - 4 * j;
          if (left <= 0) continue;
          const float32x4_t f = vmulq_f32(Vec::loadn(s + gr * N + n + 4 * j, left), xs);
          const float32x4_t v = vfmaq_f32(Vec::loadn(a + 4 * j, left), vcvtq_f32_s32(acc[m][j]), f);
          Vec::storen(a + 4 * j, v, left);
        }
      }
    }
  }
}

void kmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t*, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const float* s = p.scale(g);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 16) {
    const i64 cols = std::min<i64>(16, n1 - n);
    i64 m = 0;
    for (; m + 4 <= p.M; m += 4) kmajor_tile_i8<4>(p, xq, g, w, s, m, n, cols);
    for (; m < p.M; ++m) kmajor_tile_i8<1>(p, xq, g, w, s, m, n, cols);
  }
}

// n-major: RR table rows x MR rows, 8 inputs a step; each chunk's int32
// lanes summed across (exact) before its f32 step.
template <int RR, int MR>
void nmajor_tile_i8(const Problem& p, const QuantizedX& xq, i64 g, const int8_t* w,
                    const float* s, i64 m0, i64 n) {
  float total[RR][MR];
  for (int i = 0; i < RR; ++i)
    for (int m = 0; m < MR; ++m) total[i][m] = p.orow(g, m0 + m)[n + i];
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const i64 k0 = gr * p.group;
    const int16_t* xg[MR];
    for (int m = 0; m < MR; ++m) xg[m] = xq.at(g * p.M + m0 + m, gr);
    for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
      const i64 c1 = std::min(p.group, c0 + kChunk);
      int32x4_t acc[RR][MR];
      for (int i = 0; i < RR; ++i)
        for (int m = 0; m < MR; ++m) acc[i][m] = vdupq_n_s32(0);
      for (i64 t = c0; t < c1; t += 8) {
        int16x8_t xv[MR];
        for (int m = 0; m < MR; ++m) xv[m] = vld1q_s16(xg[m] + t);  // zeros past the group
        for (int i = 0; i < RR; ++i) {
          const int8_t* r = w + (n + i) * p.K + k0 + t;
          int8x8_t b;
          if (p.u4()) {
            int8_t buf[8] = {};
            for (i64 j = 0; j < 8 && k0 + t + j < p.K; ++j)
              buf[j] = u4_code(p, reinterpret_cast<const uint8_t*>(w), k0 + t + j, n + i);
            b = vld1_s8(buf);
          } else if (k0 + t + 8 <= p.K) {
            b = vld1_s8(r);
          } else {
            int8_t buf[8] = {};
            std::memcpy(buf, r, p.K - k0 - t);
            b = vld1_s8(buf);
          }
          const int16x8_t wv = vmovl_s8(b);  // past the group: times zero x
          for (int m = 0; m < MR; ++m) {
            acc[i][m] = vmlal_s16(acc[i][m], vget_low_s16(wv), vget_low_s16(xv[m]));
            acc[i][m] = vmlal_high_s16(acc[i][m], wv, xv[m]);
          }
        }
      }
      for (int i = 0; i < RR; ++i)
        for (int m = 0; m < MR; ++m) {
          const float f = s[(n + i) * p.groups + gr] * xq.scale_of(g * p.M + m0 + m, gr);
          total[i][m] = std::fma(static_cast<float>(vaddvq_s32(acc[i][m])), f, total[i][m]);
        }
    }
  }
  for (int i = 0; i < RR; ++i)
    for (int m = 0; m < MR; ++m) p.orow(g, m0 + m)[n + i] = total[i][m];
}

void nmajor_i8(const Problem& p, const QuantizedX& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const float* s = p.scale(g);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  i64 n = n0;
  for (; n + 4 <= n1; n += 4) {
    i64 m = 0;
    for (; m + 2 <= p.M; m += 2) nmajor_tile_i8<4, 2>(p, xq, g, w, s, m, n);
    if (m < p.M) nmajor_tile_i8<4, 1>(p, xq, g, w, s, m, n);
  }
  for (; n < n1; ++n)
    for (i64 m = 0; m < p.M; ++m) nmajor_tile_i8<1, 1>(p, xq, g, w, s, m, n);
}
#endif

// x86's tiles read f16 scales as they are (`Scales`).
#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
constexpr bool kHalfScalesInTiles = true;
#else
constexpr bool kHalfScalesInTiles = false;
#endif

// f16 offsets (unless `offsets_in_tiles`: the tiles read them too), and
// scales unless the tiles read them (`kHalfScalesInTiles`), of outputs
// [n0, n1) widened into this thread's buffers, at the same indices
// (`wide` then reads them as f32 ones).
inline void widen_block(const Problem& p, i64 n0, i64 n1, Problem* wide,
                        bool offsets_in_tiles = false) {
  thread_local LineBuffer<float> scales, offsets;
  const bool in_tiles = kHalfScalesInTiles;
  const uint16_t* in[2] = {in_tiles ? nullptr : p.s16, offsets_in_tiles ? nullptr : p.o16};
  float* out[2] = {nullptr, nullptr};
  for (int f = 0; f < 2; ++f) {
    if (in[f] == nullptr) continue;
    out[f] = (f ? offsets : scales).get(p.groups * p.N);
    if (p.nmajor) {
      half_to_float(in[f] + n0 * p.groups, out[f] + n0 * p.groups, (n1 - n0) * p.groups);
    } else {
      for (i64 gr = 0; gr < p.groups; ++gr)
        half_to_float(in[f] + gr * p.N + n0, out[f] + gr * p.N + n0, n1 - n0);
    }
  }
  wide->s = out[0];
  wide->o = offsets_in_tiles ? nullptr : out[1];
  wide->s16 = in_tiles ? p.s16 : nullptr;
  wide->o16 = offsets_in_tiles ? p.o16 : nullptr;
}

// Column (k-major) or table-row (n-major) blocks of every batch, claimed
// by threads: body(q, g, n0, n1) for outputs [n0, n1) of batch g, q the
// problem with that block's f16 scales and offsets widened (`widen_block`;
// with `offsets_in_tiles`, f16 offsets left to the tiles).
// Blocks are whole units (64 columns k-major, a line of every weight row;
// 16 table rows n-major), two a thread, of units as even as they divide
// (9 units on 2 threads: 2, 2, 2, 3, not 3, 3, 3).
template <class Body>
void run_blocks(const Problem& p, Parallel& par, Body body, bool offsets_in_tiles = false) {
  const i64 threads = std::max(1, par.threads());
  const i64 unit = p.nmajor ? 16 : 64;
  const i64 units = (p.N + unit - 1) / unit;
  const i64 nblocks = std::min(units, 2 * threads);
  auto run = [&](i64 b) {
    const i64 g = b / nblocks, i = b % nblocks;
    const i64 n0 = i * units / nblocks * unit, n1 = std::min(p.N, (i + 1) * units / nblocks * unit);
    Problem q = p;
    if (p.s16 != nullptr) widen_block(p, n0, n1, &q, offsets_in_tiles);
    body(q, g, n0, n1);
  };
  if (p.G * p.M * p.K * p.N < kInline) {
    for (i64 b = 0; b < p.G * nblocks; ++b) run(b);
    return;
  }
  par.run(p.G * nblocks, run);
}

// add_offsets for every row of batch g, outputs [n0, n1): qsum and sx hold
// `blocks` entries a row (QuantizedX's groups, QuantizedX8's blocks).
inline void add_offsets_rows(const Problem& q, const int32_t* qsum, const float* sx, i64 blocks,
                             i64 g, i64 n0, i64 n1) {
  for (i64 m = 0; m < q.M; ++m) {
    const i64 row = g * q.M + m;
    add_offsets(q, qsum + row * blocks, sx + row * blocks, blocks, g, m, n0, n1);
  }
}

void run_int8(const Problem& p, const QuantizedX& xq, Parallel& par) {
  std::vector<int8_t> zeros(p.nmajor ? 0 : p.N + 64, 0);
  const int8_t* z = zeros.data();
  run_blocks(p, par, [&, z](const Problem& q, i64 g, i64 n0, i64 n1) {
    if (q.nmajor) nmajor_i8(q, xq, g, n0, n1);
    else kmajor_i8(q, xq, g, z, n0, n1);
    if (q.o != nullptr)
      add_offsets_rows(q, xq.qsum.data(), xq.scale.data(), q.groups, g, n0, n1);
  });
}
