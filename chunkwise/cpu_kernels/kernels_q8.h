// int8 and u4 weights x int8 activations (Problem::act8), included by
// kernels.cc inside its namespace after kernels_int8.h. What each output
// is: common.h (x rounded to int8 per block of A inputs, int32 sums per
// block, one f32 chain over the blocks); portable.cc's int8_row_act8 is
// its plain form.
//
// Four products a 32-bit lane: each lane holds 4 inputs of one column, so
// the weight's bytes are regrouped into quads in registers. The block's
// sums are exact whatever the inputs' order in a quad, so each layout
// takes the order its shuffles give, and `quantize8` stores x's blocks in
// that order (`x_order`).
//
// x86: k-major tiles read 4 weight rows (int8) or 2 byte rows (u4) of 64
// (AVX-512) or 32 (AVX2) columns and interleave them within each 128-bit
// lane, so vector q's lane chunk L holds columns 16 L + 4 q .. + 3: the
// int32 sums and their f32 chains stay in that order for a whole tile,
// the scales are put in it once per group and the chains back in order at
// the tile's end (a 4 x 4, or 2 x 2, transpose of 128-bit chunks).
// A prefill's tiles (8 rows or more) read each strip's quads from a copy
// made once a call (`strip_quads`), a decode's from the rows themselves.
// Products: VNNI's vpdpbusd, AVX-512's or AVX-VNNI's (unsigned x signed
// bytes: u4 codes as they are, int8 codes + 128, the block's 128 x sum(q)
// taken back in int32), else vpmaddubsw + vpmaddwd (int8 codes as |w|
// times x with w's sign: no pair sum reaches the int16 saturation). n-major
// weights (a tied table) are packed 16 (AVX-512) or 8 (AVX2) table rows at
// a time into quads in L1 (a transpose of 32-bit words) and multiplied like
// k-major tiles. The offsets' chain runs in the tiles too, after the
// blocks'. NEON: k-major quads from zips (columns in order); n-major table
// rows read as they are, each block's lanes summed across (exact); `sdot`
// where the build has the dot-product extension, else widening multiplies,
// and the offsets in a pass of their own.

// Where input t of a block (t < A) sits in x's rounded block, for the
// layout these tiles read (every layout keeps each quad's 4 inputs
// together: the tiles broadcast a quad of x as one 32-bit word).
struct XOrder {
  int kind;  // 0: as is; 1: (0, 2, 1, 3) in each quad; 2: evens, then odds
  CW_INLINE i64 operator()(i64 t) const {
    if (kind == 1) return (t & ~i64{3}) | ((t & 1) << 1) | ((t >> 1) & 1);
    if (kind == 2) return (t & 1) ? 16 + t / 2 : t / 2;
    return t;
  }
};

// k-major u4: a column's quad holds (k, k + 2, k + 1, k + 3) (two byte
// rows' low nibbles, then high ones); n-major u4: a block of 32 as its 16
// low nibbles (even inputs), then its 16 high ones (ffi.cc sends other
// u4 blocks to the portable loops).
inline XOrder x_order(const Problem& p) { return {!p.u4() ? 0 : p.nmajor ? 2 : 1}; }

// The sum of n int8 (exact).
CW_INLINE int32_t sum_bytes(const int8_t* q, i64 n) {
  int32_t sum = 0;
  i64 t = 0;
#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
  for (; t + 16 <= n; t += 16) {  // |q| + 128 as unsigned bytes, summed by psadbw
    const __m128i v = _mm_xor_si128(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + t)),
                                    _mm_set1_epi8(-128));
    const __m128i s = _mm_sad_epu8(v, _mm_setzero_si128());
    sum += _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4) - 128 * 16;
  }
#elif defined(CW_ISA_NEON)
  for (; t + 16 <= n; t += 16) sum += vaddlvq_s8(vld1q_s8(q + t));
#endif
  for (; t < n; ++t) sum += q[t];
  return sum;
}

// A block's n inputs (natural order, from `in`) in the order the tiles
// read (`XOrder`, kind 1 or 2) into q.
CW_INLINE void reorder(const int8_t* in, int8_t* q, i64 n, XOrder order) {
  i64 t = 0;
#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
  if (order.kind == 1) {  // (0, 2, 1, 3) in each quad
    const __m128i swap = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
    for (; t + 16 <= n; t += 16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + t),
                       _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + t)), swap));
  } else if (n == 32) {  // evens, then odds
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i v = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in)), split);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permute4x64_epi64(v, 0xD8));
    return;
  }
#elif defined(CW_ISA_NEON)
  if (order.kind == 1) {
    const uint8x16_t swap = {0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15};
    for (; t + 16 <= n; t += 16) vst1q_s8(q + t, vqtbl1q_s8(vld1q_s8(in + t), swap));
  } else if (n == 32) {
    const int8x16_t lo = vld1q_s8(in), hi = vld1q_s8(in + 16);
    vst1q_s8(q, vuzp1q_s8(lo, hi));
    vst1q_s8(q + 16, vuzp2q_s8(lo, hi));
    return;
  }
#endif
  for (; t < n; ++t) q[order(t)] = in[t];
}

// Every row of x rounded per block (common.h): the same values as
// quantize_block8's, the max and the rounding in vectors.
void quantize8(const Problem& p, QuantizedX8& xq) {
  xq.M = p.G * p.M;
  xq.A = p.act_block();
  xq.blocks = p.act_blocks();
  xq.P = (xq.A + 3) / 4 * 4;
  xq.q.resize(xq.M * xq.blocks * xq.P);
  xq.scale.resize(xq.M * xq.blocks);
  xq.qsum.resize(xq.M * xq.blocks);
  const XOrder order = x_order(p);
  const i64 A = xq.A;
  std::vector<int8_t> buf(A + W);
  for (i64 row = 0; row < xq.M; ++row)
    for (i64 b = 0; b < xq.blocks; ++b) {
      const i64 i = row * xq.blocks + b;
      const float* xb = p.x + row * p.K + b * A;
      int8_t* q = xq.q.data() + i * xq.P;
      if (A % W != 0) {  // (a block of 4 .. 12: the scalar form)
        quantize_block8(xb, A, xq.P, q, &xq.scale[i], &xq.qsum[i], order);
        continue;
      }
      V mv = Vec::zero();
      bool finite = true;
      for (i64 k = 0; k < A; k += W) {
        const V v = Vec::load(xb + k);
        finite &= Vec::finite(v);
        mv = Vec::max(mv, Vec::abs(v));
      }
      float inv = 0.f;
      std::fill(q, q + xq.P, int8_t{0});
      xq.qsum[i] = 0;
      if (!group_scale(Vec::hmax(mv), finite, &xq.scale[i], &inv, 127.f)) continue;
      const V iv = Vec::set1(inv);
      int8_t* out = order.kind == 0 ? q : buf.data();
      for (i64 k = 0; k < A; k += W) Vec::store_i8(out + k, Vec::mul(Vec::load(xb + k), iv));
      xq.qsum[i] = sum_bytes(out, A);
      if (order.kind != 0) reorder(out, q, A, order);
    }
}

CW_INLINE int32_t quad_bits(const int8_t* q) {  // 4 int8 as one int32
  int32_t v;
  std::memcpy(&v, q, sizeof(v));
  return v;
}

// x86 prefills (at least kQuadRows rows) shuffle each strip's weights into
// the tiles' quads once (`strip_quads`, a thread's copy in L2), and every
// row tile reads them from there; a decode's one row reads the weights
// where they are. The same quads either way: the same bits.
constexpr i64 kQuadRows = 8;
inline bool pack_strips(const Problem& p) { return p.M >= kQuadRows; }

// `pack(out)` fills a thread's copy of K / 4 x 4 vectors Q (64-byte
// aligned), which it returns.
template <class Q, class Pack>
const Q* strip_quads(const Problem& p, Pack pack) {
  thread_local LineBuffer<int8_t> buf;
  Q* out = reinterpret_cast<Q*>(buf.get(static_cast<size_t>(p.K) * sizeof(Q)));
  pack(out);
  return out;
}

#if defined(CW_ISA_AVX512)
// ---- AVX-512 -------------------------------------------------------------------

constexpr int kMR8a = 4;  // x rows per act8 register tile

// int8 codes enter VNNI's unsigned operand as code + 128 (`kBias`).
#ifdef __AVX512VNNI__
constexpr bool kBias = true;
#else
constexpr bool kBias = false;
#endif

// acc += the 4-byte dot products of w's quads with x's (u4: w unsigned;
// int8: w + 128 under VNNI, else as |w| times x with w's sign).
template <bool U4>
CW_INLINE __m512i dp8(__m512i acc, __m512i w, __m512i x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, w, x);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if (U4) return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
  const __mmask64 neg = _mm512_movepi8_mask(w);
  const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
  return _mm512_add_epi32(acc,
                          _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs), ones));
#endif
}

// 4 x 4 transpose of 128-bit chunks: natural columns <-> the tiles' order.
CW_INLINE void chunks4x4(__m512* v) {
  const __m512 t0 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);
  const __m512 t1 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 t2 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 t3 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
  v[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
  v[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
  v[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
}

// 64 f32 at p (the first `cols` read, else 0) in the tiles' order.
CW_INLINE void load_permuted(const float* p, i64 cols, __m512* v) {
  for (int q = 0; q < 4; ++q) v[q] = Vec::loadn(p + 16 * q, cols - 16 * q);
  chunks4x4(v);
}

CW_INLINE void load_permuted(const uint16_t* p, i64 cols, __m512* v) {
  for (int q = 0; q < 4; ++q)
    v[q] = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(Vec::mask(cols - 16 * q), p + 16 * q));
  chunks4x4(v);
}

// Inputs k .. k + 3 of columns [n, n + 64) (those past `bm` zero) as the
// tiles' quads: byte rows k / 2 and k / 2 + 1 (u4) or rows k .. k + 3
// (int8, + 128 under VNNI) interleaved within each 128-bit lane.
template <bool U4>
CW_INLINE void kmajor_quads(const Problem& p, const int8_t* w, i64 k, i64 n, __mmask64 bm,
                            bool ahead, __m512i* wq) {
  const __m512i nib = _mm512_set1_epi8(15), bias = _mm512_set1_epi8(-128);
  const i64 N = p.N;
  if (U4) {
    const int8_t* r = w + k / 2 * N + n;
    if (ahead) {  // these rows' next lines, for the next strip
      prefetch(r + 64);
      prefetch(r + N + 64);
    }
    const __m512i a = _mm512_maskz_loadu_epi8(bm, r), c = _mm512_maskz_loadu_epi8(bm, r + N);
    const __m512i l = _mm512_unpacklo_epi8(a, c), h = _mm512_unpackhi_epi8(a, c);
    const __m512i l0 = _mm512_and_si512(l, nib), l1 = _mm512_and_si512(_mm512_srli_epi16(l, 4), nib);
    const __m512i h0 = _mm512_and_si512(h, nib), h1 = _mm512_and_si512(_mm512_srli_epi16(h, 4), nib);
    wq[0] = _mm512_unpacklo_epi16(l0, l1);
    wq[1] = _mm512_unpackhi_epi16(l0, l1);
    wq[2] = _mm512_unpacklo_epi16(h0, h1);
    wq[3] = _mm512_unpackhi_epi16(h0, h1);
    return;
  }
  const int8_t* r = w + k * N + n;
  if (ahead)
    for (int i = 0; i < 4; ++i) prefetch(r + i * N + 64);
  __m512i a[4];
  for (int i = 0; i < 4; ++i) a[i] = _mm512_maskz_loadu_epi8(bm, r + i * N);
  const __m512i l01 = _mm512_unpacklo_epi8(a[0], a[1]), h01 = _mm512_unpackhi_epi8(a[0], a[1]);
  const __m512i l23 = _mm512_unpacklo_epi8(a[2], a[3]), h23 = _mm512_unpackhi_epi8(a[2], a[3]);
  wq[0] = _mm512_unpacklo_epi16(l01, l23);
  wq[1] = _mm512_unpackhi_epi16(l01, l23);
  wq[2] = _mm512_unpacklo_epi16(h01, h23);
  wq[3] = _mm512_unpackhi_epi16(h01, h23);
  if (kBias)
    for (int q = 0; q < 4; ++q) wq[q] = _mm512_xor_si512(wq[q], bias);
}

using Quads = __m512i;

// A strip's quads, every input's, in `packed` (K / 4 x 4 vectors): a
// prefill's row tiles then read them, not the rows and their shuffles.
void kmajor_pack_q8(const Problem& p, const int8_t* w, i64 n, i64 cols, Quads* packed) {
  const __mmask64 bm = cols >= 64 ? ~__mmask64{0} : (__mmask64{1} << cols) - 1;
  for (i64 k = 0; k < p.K; k += 4)
    p.u4() ? kmajor_quads<true>(p, w, k, n, bm, true, packed + k)
           : kmajor_quads<false>(p, w, k, n, bm, true, packed + k);
}

// k-major: rows [m0, m0 + MR) x columns [n, n + cols) (cols <= 64; a
// narrower tail read under a mask) of batch g, from their chains in `out`
// and back; the weights' quads from `packed` (`kmajor_pack_q8`) unless
// it is null.
template <int MR, bool U4>
void kmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 cols,
                    const Quads* packed) {
  const __mmask64 bm = cols >= 64 ? ~__mmask64{0} : (__mmask64{1} << cols) - 1;
  const i64 N = p.N, A = xq.A;
  __m512 chain[MR][4], sc[4];
  for (int m = 0; m < MR; ++m) load_permuted(p.orow(g, m0 + m) + n, cols, chain[m]);
  i64 group = -1;
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A;
    if (k0 / p.group != group) {  // this group's scales, in the tiles' order
      group = k0 / p.group;
      if (s.f) load_permuted(s.f + group * N + n, cols, sc);
      else load_permuted(s.h + group * N + n, cols, sc);
      if (group + 2 < p.groups) {  // a later group's: a load that misses stalls the tile
        const char* ahead = s.f ? reinterpret_cast<const char*>(s.f + (group + 2) * N + n)
                                : reinterpret_cast<const char*>(s.h + (group + 2) * N + n);
        for (int l = 0; l < (s.f ? 4 : 2); ++l) prefetch(ahead + 64 * l);
      }
    }
    const int8_t* xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = xq.at(g * p.M + m0 + m, b);
    __m512i acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int q = 0; q < 4; ++q) acc[m][q] = _mm512_setzero_si512();
    for (i64 t = 0; t < A; t += 4) {
      const i64 k = k0 + t;
      __m512i wq[4];
      if (packed != nullptr) {
        for (int q = 0; q < 4; ++q) wq[q] = _mm512_load_si512(packed + k + q);
      } else {
        kmajor_quads<U4>(p, w, k, n, bm, (n & 63) == 0, wq);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = _mm512_set1_epi32(quad_bits(xb[m] + t));
        for (int q = 0; q < 4; ++q) acc[m][q] = dp8<U4>(acc[m][q], wq[q], xv);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const i64 row = g * p.M + m0 + m;
      const __m512 xs = _mm512_set1_ps(xq.scale_of(row, b));
      const __m512i back = _mm512_set1_epi32(128 * xq.sum_of(row, b));
      for (int q = 0; q < 4; ++q) {
        const __m512i sum = !U4 && kBias ? _mm512_sub_epi32(acc[m][q], back) : acc[m][q];
        chain[m][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(sc[q], xs), chain[m][q]);
      }
    }
  }
  if (o.f || o.h) {  // the offsets' chain (common.h), in the tiles' order too
    group = -1;
    for (i64 b = 0; b < xq.blocks; ++b) {
      if (b * A / p.group != group) {
        group = b * A / p.group;
        if (o.f) load_permuted(o.f + group * N + n, cols, sc);
        else load_permuted(o.h + group * N + n, cols, sc);
      }
      for (int m = 0; m < MR; ++m) {
        const i64 row = g * p.M + m0 + m;
        const __m512 qs = _mm512_set1_ps(static_cast<float>(xq.sum_of(row, b)));
        const __m512 xs = _mm512_set1_ps(xq.scale_of(row, b));
        for (int q = 0; q < 4; ++q) chain[m][q] = _mm512_fmadd_ps(qs, _mm512_mul_ps(sc[q], xs), chain[m][q]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    chunks4x4(chain[m]);
    float* out = p.orow(g, m0 + m) + n;
    for (int q = 0; q < 4; ++q) Vec::storen(out + 16 * q, chain[m][q], cols - 16 * q);
  }
}

template <int MR>
void kmajor_rows_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 cols,
                    const Quads* packed) {
  if (p.u4()) kmajor_tile_q8<MR, true>(p, xq, g, w, s, o, m0, n, cols, packed);
  else kmajor_tile_q8<MR, false>(p, xq, g, w, s, o, m0, n, cols, packed);
}

// k-major: columns [n0, n1) of batch g, every row: strips of 64 columns,
// row tiles inside (a strip's weights read from memory once).
void kmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16}, o{p.offset(g), p.o16};
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  const Quads* packed = nullptr;
  for (i64 n = n0; n < n1; n += 64) {
    const i64 cols = std::min<i64>(64, n1 - n);
    if (pack_strips(p))
      packed = strip_quads<Quads>(p, [&](Quads* out) { kmajor_pack_q8(p, w, n, cols, out); });
    i64 m = 0;
    for (; m + kMR8a <= p.M; m += kMR8a) kmajor_rows_q8<kMR8a>(p, xq, g, w, s, o, m, n, cols, packed);
    switch (p.M - m) {
      case 3: kmajor_rows_q8<3>(p, xq, g, w, s, o, m, n, cols, packed); break;
      case 2: kmajor_rows_q8<2>(p, xq, g, w, s, o, m, n, cols, packed); break;
      case 1: kmajor_rows_q8<1>(p, xq, g, w, s, o, m, n, cols, packed); break;
      default: break;
    }
  }
}

// n-major: table rows [n, n + rows) (rows <= 16) as quads in `buf`: quad
// j (inputs 4 j .. 4 j + 3; u4: x_order's) of row r at buf + 16 j + r
// (32-bit words; rows past `rows` zero; int8 codes + 128 under VNNI).
void nmajor_pack_q8(const Problem& p, const int8_t* w, int32_t* buf, i64 n, i64 rows) {
  const bool u4 = p.u4();
  const i64 bytes = u4 ? p.K / 2 : p.K;  // a table row's
  const __m512i bias = _mm512_set1_epi8(-128);
  for (i64 c = 0; c < p.K; c += 64) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      __m512i v = _mm512_setzero_si512();
      if (i < rows) {
        const int8_t* row = w + (n + i) * bytes;
        if (n + 16 + i < p.N && (!u4 || c % 128 == 0))  // the next block's line
          prefetch(row + 16 * bytes + (u4 ? c / 2 : c));
        if (u4) {  // 32 bytes: [low nibbles, high nibbles] per 16
          const i64 left = std::min<i64>(32, bytes - c / 2);
          const __m256i b = _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1ull << left) - 1),
                                                    row + c / 2);
          const __m512i wide = _mm512_cvtepu8_epi16(b);  // byte i in word i
          const __m512i lo = _mm512_and_si512(wide, _mm512_set1_epi16(15));
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(wide, 4), _mm512_set1_epi16(15));
          // words -> bytes: [lo 0-15, hi 0-15, lo 16-31, hi 16-31]
          const __m256i l = _mm512_cvtepi16_epi8(lo), h = _mm512_cvtepi16_epi8(hi);
          const __m256i a = _mm256_permute2x128_si256(l, h, 0x20);
          const __m256i d = _mm256_permute2x128_si256(l, h, 0x31);
          v = _mm512_inserti64x4(_mm512_castsi256_si512(a), d, 1);
        } else {
          const i64 left = std::min<i64>(64, bytes - c);
          v = _mm512_maskz_loadu_epi8(left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1,
                                      row + c);
          if (kBias) v = _mm512_xor_si512(v, bias);
        }
      } else if (!u4 && kBias) {
        v = bias;  // a zero code, biased
      }
      r[i] = _mm512_castsi512_ps(v);
    }
    Vec::transpose(r);
    const i64 quads = std::min<i64>(16, (p.K - c + 3) / 4);
    for (i64 j = 0; j < quads; ++j)
      _mm512_store_si512(buf + (c / 4 + j) * 16, _mm512_castps_si512(r[j]));
  }
}

// n-major: the scales (or offsets) of table rows [n, n + rows), a vector
// a group, in `out` (kernels_int8.h's `nmajor_scales`, every group once).
void nmajor_scales_q8(const Problem& p, const Scales& s, i64 n, i64 rows, __m512* out) {
  for (i64 gr = 0; gr < p.groups; ++gr) out[gr] = nmajor_scales(p, s, n, rows, gr);
}

// n-major: out[m0 .. m0 + MR, n .. n + rows) from a packed block and its
// scales (`sv`, one vector a group). With few rows a block's quads go to
// two sums in turn (independent chains), added at its end (exact).
template <int MR, bool U4>
void nmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int32_t* buf,
                    const __m512* sv, const __m512* ov, i64 m0, i64 n, i64 rows) {
  const __mmask16 rm = static_cast<__mmask16>((1u << rows) - 1);
  const i64 A = xq.A;
  __m512 total[MR];
  for (int m = 0; m < MR; ++m) total[m] = _mm512_maskz_loadu_ps(rm, p.orow(g, m0 + m) + n);
  constexpr int H = MR <= 2 ? 2 : 1;
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A;
    __m512i acc[MR][H];
    for (int m = 0; m < MR; ++m)
      for (int h = 0; h < H; ++h) acc[m][h] = _mm512_setzero_si512();
    const int8_t* xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = xq.at(g * p.M + m0 + m, b);
    for (i64 t = 0; t < A; t += 4) {
      const __m512i wv = _mm512_load_si512(buf + (k0 + t) / 4 * 16);
      const int h = H == 2 ? static_cast<int>(t / 4 & 1) : 0;
      for (int m = 0; m < MR; ++m)
        acc[m][h] = dp8<U4>(acc[m][h], wv, _mm512_set1_epi32(quad_bits(xb[m] + t)));
    }
    const __m512 scale = sv[k0 / p.group];
    for (int m = 0; m < MR; ++m) {
      const i64 row = g * p.M + m0 + m;
      __m512i sum = acc[m][0];
      if (H == 2) sum = _mm512_add_epi32(sum, acc[m][H - 1]);
      if (!U4 && kBias) sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(128 * xq.sum_of(row, b)));
      total[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                 _mm512_mul_ps(scale, _mm512_set1_ps(xq.scale_of(row, b))), total[m]);
    }
  }
  if (ov != nullptr)  // the offsets' chain (common.h)
    for (i64 b = 0; b < xq.blocks; ++b)
      for (int m = 0; m < MR; ++m) {
        const i64 row = g * p.M + m0 + m;
        const __m512 qs = _mm512_set1_ps(static_cast<float>(xq.sum_of(row, b)));
        total[m] = _mm512_fmadd_ps(
            qs, _mm512_mul_ps(ov[b * A / p.group], _mm512_set1_ps(xq.scale_of(row, b))), total[m]);
      }
  for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(p.orow(g, m0 + m) + n, rm, total[m]);
}

template <int MR>
void nmajor_rows_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int32_t* buf,
                    const __m512* sv, const __m512* ov, i64 m0, i64 n, i64 rows) {
  if (p.u4()) nmajor_tile_q8<MR, true>(p, xq, g, buf, sv, ov, m0, n, rows);
  else nmajor_tile_q8<MR, false>(p, xq, g, buf, sv, ov, m0, n, rows);
}

// n-major: table rows [n0, n1) of batch g, all rows, 16 table rows a block.
void nmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16};
  thread_local LineBuffer<int32_t> lines;
  int32_t* buf = lines.get((p.K + 63) / 64 * 16 * 16);
  const Scales o{p.offset(g), p.o16};
  thread_local LineBuffer<float> scales, offsets;
  __m512* sv = reinterpret_cast<__m512*>(scales.get(16 * p.groups));
  __m512* ov = o.f || o.h ? reinterpret_cast<__m512*>(offsets.get(16 * p.groups)) : nullptr;
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 16) {
    const i64 rows = std::min<i64>(16, n1 - n);
    nmajor_pack_q8(p, w, buf, n, rows);
    nmajor_scales_q8(p, s, n, rows, sv);
    if (ov != nullptr) nmajor_scales_q8(p, o, n, rows, ov);
    i64 m = 0;
    for (; m + 8 <= p.M; m += 8) nmajor_rows_q8<8>(p, xq, g, buf, sv, ov, m, n, rows);
    switch (p.M - m) {
#define CW_CASE(r) \
  case r: nmajor_rows_q8<r>(p, xq, g, buf, sv, ov, m, n, rows); break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4) CW_CASE(5) CW_CASE(6) CW_CASE(7)
#undef CW_CASE
      default: break;
    }
  }
}

#elif defined(CW_ISA_AVX2)
// ---- AVX2 ---------------------------------------------------------------------

constexpr int kMR8a = 2;  // x rows per act8 register tile (16 registers)

// acc += the 4-byte dot products of w's quads with x's: vpmaddubsw's
// pairs (u4 codes unsigned as they are; int8 codes as |w| times x with
// w's sign: a pair sum is at most 2 x 128 x 127, below int16's
// saturation), then vpmaddwd's quads.
// With AVX-VNNI (the avx2_vnni build) one vpdpbusd instead, as AVX-512
// VNNI's: int8 codes biased by 128 (`kBias`), taken back per block.
#ifdef __AVXVNNI__
constexpr bool kBias = true;
#else
constexpr bool kBias = false;
#endif

template <bool U4>
CW_INLINE __m256i dp8(__m256i acc, __m256i w, __m256i wabs, __m256i x) {
#ifdef __AVXVNNI__
  (void)wabs;
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i pairs = U4 ? _mm256_maddubs_epi16(w, x)
                           : _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(x, w));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
#endif
}

// u4 codes (at most 15) times x (|x| <= 127): a vpmaddubsw pair sum is at
// most 3810, so a block of up to 32 inputs (8 steps of quads) sums them
// in int16 exactly (at most 30480) and widens them once, with one
// vpmaddwd, at its end: two instructions a step, not three.

// 32 columns as 4 x 8: natural (v[q]: columns 8 q ..) <-> the tiles'
// order (v[q]'s 128-bit lane L: columns 16 L + 4 q ..).
CW_INLINE void to_tiles(__m256* v) {
  const __m256 a = _mm256_permute2f128_ps(v[0], v[2], 0x20), b = _mm256_permute2f128_ps(v[0], v[2], 0x31);
  const __m256 c = _mm256_permute2f128_ps(v[1], v[3], 0x20), d = _mm256_permute2f128_ps(v[1], v[3], 0x31);
  v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

CW_INLINE void from_tiles(__m256* v) {
  const __m256 a = _mm256_permute2f128_ps(v[0], v[1], 0x20), c = _mm256_permute2f128_ps(v[0], v[1], 0x31);
  const __m256 b = _mm256_permute2f128_ps(v[2], v[3], 0x20), d = _mm256_permute2f128_ps(v[2], v[3], 0x31);
  v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

// `rows` weight rows of 32 bytes from r (rows `stride` apart), `cols` of
// them valid: read in place, or through a zeroed copy for a tail.
CW_INLINE void load_rows(const int8_t* r, i64 stride, int rows, i64 cols, __m256i* out) {
  if (cols >= 32) {
    for (int i = 0; i < rows; ++i)
      out[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i * stride));
    return;
  }
  alignas(32) int8_t buf[32];
  for (int i = 0; i < rows; ++i) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, r + i * stride, static_cast<size_t>(cols));
    out[i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
  }
}

// Inputs k .. k + 3 of columns [n, n + cols) (cols <= 32; the rest zero)
// as the tiles' quads: byte rows k / 2 and k / 2 + 1 (u4) or rows k ..
// k + 3 (int8, + 128 under AVX-VNNI) interleaved within each 128-bit lane.
template <bool U4>
CW_INLINE void kmajor_quads(const Problem& p, const int8_t* w, i64 k, i64 n, i64 cols, bool ahead,
                            __m256i* wq) {
  const __m256i nib = _mm256_set1_epi8(15);
  const i64 N = p.N;
  if (U4) {
    __m256i a[2];
    const int8_t* r = w + k / 2 * N + n;
    if (ahead) {  // these rows' next lines, for the next strip
      prefetch(r + 64);
      prefetch(r + N + 64);
    }
    load_rows(r, N, 2, cols, a);
    const __m256i l = _mm256_unpacklo_epi8(a[0], a[1]), h = _mm256_unpackhi_epi8(a[0], a[1]);
    const __m256i l0 = _mm256_and_si256(l, nib), l1 = _mm256_and_si256(_mm256_srli_epi16(l, 4), nib);
    const __m256i h0 = _mm256_and_si256(h, nib), h1 = _mm256_and_si256(_mm256_srli_epi16(h, 4), nib);
    wq[0] = _mm256_unpacklo_epi16(l0, l1);
    wq[1] = _mm256_unpackhi_epi16(l0, l1);
    wq[2] = _mm256_unpacklo_epi16(h0, h1);
    wq[3] = _mm256_unpackhi_epi16(h0, h1);
    return;
  }
  __m256i a[4];
  const int8_t* r = w + k * N + n;
  if (ahead)
    for (int i = 0; i < 4; ++i) prefetch(r + i * N + 64);
  load_rows(r, N, 4, cols, a);
  const __m256i l01 = _mm256_unpacklo_epi8(a[0], a[1]), h01 = _mm256_unpackhi_epi8(a[0], a[1]);
  const __m256i l23 = _mm256_unpacklo_epi8(a[2], a[3]), h23 = _mm256_unpackhi_epi8(a[2], a[3]);
  wq[0] = _mm256_unpacklo_epi16(l01, l23);
  wq[1] = _mm256_unpackhi_epi16(l01, l23);
  wq[2] = _mm256_unpacklo_epi16(h01, h23);
  wq[3] = _mm256_unpackhi_epi16(h01, h23);
  if (kBias)
    for (int q = 0; q < 4; ++q) wq[q] = _mm256_xor_si256(wq[q], _mm256_set1_epi8(-128));
}

using Quads = __m256i;

// A strip's quads, every input's, in `packed` (K / 4 x 4 vectors).
void kmajor_pack_q8(const Problem& p, const int8_t* w, i64 n, i64 cols, Quads* packed) {
  for (i64 k = 0; k < p.K; k += 4)
    p.u4() ? kmajor_quads<true>(p, w, k, n, cols, true, packed + k)
           : kmajor_quads<false>(p, w, k, n, cols, true, packed + k);
}

// k-major: rows [m0, m0 + MR) x columns [n, n + cols) (cols <= 32) of
// batch g, from their chains in `out` and back; the weights' quads from
// `packed` (`kmajor_pack_q8`) unless it is null.
template <int MR, bool U4>
void kmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 cols,
                    const Quads* packed) {
  const i64 N = p.N, A = xq.A;
  __m256 chain[MR][4], sc[4];
  for (int m = 0; m < MR; ++m) {
    for (int q = 0; q < 4; ++q) chain[m][q] = Vec::loadn(p.orow(g, m0 + m) + n + 8 * q, cols - 8 * q);
    to_tiles(chain[m]);
  }
  i64 group = -1;
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A;
    if (k0 / p.group != group) {
      group = k0 / p.group;
      for (int q = 0; q < 4; ++q)
        sc[q] = s.f ? Vec::loadn(s.f + group * N + n + 8 * q, cols - 8 * q)
                    : Vec::loadn_half(s.h + group * N + n + 8 * q, cols - 8 * q);
      to_tiles(sc);
      if (group + 2 < p.groups && (n & 63) == 0) {  // a later group's (see AVX-512)
        const char* ahead = s.f ? reinterpret_cast<const char*>(s.f + (group + 2) * N + n)
                                : reinterpret_cast<const char*>(s.h + (group + 2) * N + n);
        for (int l = 0; l < (s.f ? 4 : 2); ++l) prefetch(ahead + 64 * l);
      }
    }
    const int8_t* xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = xq.at(g * p.M + m0 + m, b);
    __m256i acc[MR][4];
    for (int m = 0; m < MR; ++m)
      for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_setzero_si256();
    for (i64 t = 0; t < A; t += 4) {
      const i64 k = k0 + t;
      __m256i wq[4], wabs[4];
      if (packed != nullptr) {
        for (int q = 0; q < 4; ++q) wq[q] = _mm256_load_si256(packed + k + q);
      } else {
        kmajor_quads<U4>(p, w, k, n, cols, (n & 63) == 0, wq);
      }
      if (!U4 && !kBias)
        for (int q = 0; q < 4; ++q) wabs[q] = _mm256_abs_epi8(wq[q]);
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_set1_epi32(quad_bits(xb[m] + t));
        if (U4 && !kBias && A <= 32) {  // int16 pair sums, widened once a block (above)
          for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_add_epi16(acc[m][q], _mm256_maddubs_epi16(wq[q], xv));
        } else {
          for (int q = 0; q < 4; ++q) acc[m][q] = dp8<U4>(acc[m][q], wq[q], wabs[q], xv);
        }
      }
    }
    if (U4 && !kBias && A <= 32)
      for (int m = 0; m < MR; ++m)
        for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_madd_epi16(acc[m][q], _mm256_set1_epi16(1));
    if (!U4 && kBias)
      for (int m = 0; m < MR; ++m) {
        const __m256i back = _mm256_set1_epi32(128 * xq.sum_of(g * p.M + m0 + m, b));
        for (int q = 0; q < 4; ++q) acc[m][q] = _mm256_sub_epi32(acc[m][q], back);
      }
    for (int m = 0; m < MR; ++m) {
      const __m256 xs = _mm256_set1_ps(xq.scale_of(g * p.M + m0 + m, b));
      for (int q = 0; q < 4; ++q)
        chain[m][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m][q]), _mm256_mul_ps(sc[q], xs), chain[m][q]);
    }
  }
  if (o.f || o.h) {  // the offsets' chain (common.h), in the tiles' order too
    group = -1;
    for (i64 b = 0; b < xq.blocks; ++b) {
      if (b * A / p.group != group) {
        group = b * A / p.group;
        for (int q = 0; q < 4; ++q)
          sc[q] = o.f ? Vec::loadn(o.f + group * N + n + 8 * q, cols - 8 * q)
                      : Vec::loadn_half(o.h + group * N + n + 8 * q, cols - 8 * q);
        to_tiles(sc);
      }
      for (int m = 0; m < MR; ++m) {
        const i64 row = g * p.M + m0 + m;
        const __m256 qs = _mm256_set1_ps(static_cast<float>(xq.sum_of(row, b)));
        const __m256 xs = _mm256_set1_ps(xq.scale_of(row, b));
        for (int q = 0; q < 4; ++q) chain[m][q] = _mm256_fmadd_ps(qs, _mm256_mul_ps(sc[q], xs), chain[m][q]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) {
    from_tiles(chain[m]);
    float* out = p.orow(g, m0 + m) + n;
    for (int q = 0; q < 4; ++q) Vec::storen(out + 8 * q, chain[m][q], cols - 8 * q);
  }
}

template <int MR>
void kmajor_rows_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 cols,
                    const Quads* packed) {
  if (p.u4()) kmajor_tile_q8<MR, true>(p, xq, g, w, s, o, m0, n, cols, packed);
  else kmajor_tile_q8<MR, false>(p, xq, g, w, s, o, m0, n, cols, packed);
}

// k-major: columns [n0, n1) of batch g, every row: strips of 64 columns
// (two tiles), row tiles inside.
void kmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16}, o{p.offset(g), p.o16};
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  if (pack_strips(p)) {  // a strip of 32 columns a copy (48 KiB at K = 1536)
    for (i64 c = n0; c < n1; c += 32) {
      const i64 cols = std::min<i64>(32, n1 - c);
      const Quads* packed =
          strip_quads<Quads>(p, [&](Quads* out) { kmajor_pack_q8(p, w, c, cols, out); });
      i64 m = 0;
      // 3 rows a tile: the quads come from L1, so registers go to sums
      for (; m + 3 <= p.M; m += 3) kmajor_rows_q8<3>(p, xq, g, w, s, o, m, c, cols, packed);
      for (; m < p.M; ++m) kmajor_rows_q8<1>(p, xq, g, w, s, o, m, c, cols, packed);
    }
    return;
  }
  for (i64 n = n0; n < n1; n += 64) {
    const i64 e = std::min(n1, n + 64);
    i64 m = 0;
    for (; m + kMR8a <= p.M; m += kMR8a)
      for (i64 c = n; c < e; c += 32)
        kmajor_rows_q8<kMR8a>(p, xq, g, w, s, o, m, c, std::min<i64>(32, e - c), nullptr);
    if (m < p.M)
      for (i64 c = n; c < e; c += 32) kmajor_rows_q8<1>(p, xq, g, w, s, o, m, c, std::min<i64>(32, e - c), nullptr);
  }
}

// n-major: table rows [n, n + rows) (rows <= 8) as quads in `buf`: quad j
// (inputs 4 j .. 4 j + 3; u4: x_order's) of row r at buf + 8 j + r (32-bit
// words; rows past `rows` zero).
void nmajor_pack_q8(const Problem& p, const int8_t* w, int32_t* buf, i64 n, i64 rows) {
  const bool u4 = p.u4();
  const i64 bytes = u4 ? p.K / 2 : p.K;  // a table row's
  const __m128i nib = _mm_set1_epi8(15);
  for (i64 c = 0; c < p.K; c += 32) {
    __m256 r[8];
    for (int i = 0; i < 8; ++i) {
      __m256i v = _mm256_setzero_si256();
      if (i < rows) {
        const int8_t* row = w + (n + i) * bytes;
        if (u4) {  // 16 bytes: [low nibbles, high nibbles]
          const i64 left = std::min<i64>(16, bytes - c / 2);
          __m128i b;
          if (left == 16) {
            b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
          } else {
            alignas(16) int8_t tmp[16] = {};
            std::memcpy(tmp, row + c / 2, static_cast<size_t>(left));
            b = _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
          }
          v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), nib), _mm_and_si128(b, nib));
        } else {
          load_rows(row + c, 0, 1, std::min<i64>(32, bytes - c), &v);
        }
      }
      r[i] = _mm256_castsi256_ps(v);
    }
    Vec::transpose(r);
    const i64 quads = std::min<i64>(8, (p.K - c + 3) / 4);
    for (i64 j = 0; j < quads; ++j)
      _mm256_store_si256(reinterpret_cast<__m256i*>(buf + (c / 4 + j) * 8), _mm256_castps_si256(r[j]));
  }
}

// n-major: out[m0 .. m0 + MR, n .. n + rows) from a packed block.
// 8 table rows' scales or offsets of group gr, f32 (rows past `rows` 0).
CW_INLINE __m256 nmajor_gather(const Problem& p, const Scales& s, i64 n, i64 rows, i64 gr) {
  alignas(32) float v[8] = {};
  for (i64 r = 0; r < rows; ++r)
    v[r] = s.f ? s.f[(n + r) * p.groups + gr] : half_bits_to_float(s.h[(n + r) * p.groups + gr]);
  return _mm256_load_ps(v);
}

template <int MR, bool U4>
void nmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int32_t* buf,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 rows) {
  const i64 A = xq.A;
  __m256 total[MR];
  for (int m = 0; m < MR; ++m) total[m] = Vec::loadn(p.orow(g, m0 + m) + n, rows);
  i64 group = -1;
  __m256 sv = _mm256_setzero_ps();
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A;
    if (k0 / p.group != group) {
      group = k0 / p.group;
      sv = nmajor_gather(p, s, n, rows, group);
    }
    __m256i acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_si256();
    const int8_t* xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = xq.at(g * p.M + m0 + m, b);
    for (i64 t = 0; t < A; t += 4) {
      __m256i wv = _mm256_load_si256(reinterpret_cast<const __m256i*>(buf + (k0 + t) / 4 * 8));
      const __m256i wa = U4 || kBias ? wv : _mm256_abs_epi8(wv);
      if (!U4 && kBias) wv = _mm256_xor_si256(wv, _mm256_set1_epi8(-128));
      for (int m = 0; m < MR; ++m) {
        const __m256i xv = _mm256_set1_epi32(quad_bits(xb[m] + t));
        if (U4 && !kBias && A <= 32) acc[m] = _mm256_add_epi16(acc[m], _mm256_maddubs_epi16(wv, xv));
        else acc[m] = dp8<U4>(acc[m], wv, wa, xv);
      }
    }
    if (U4 && !kBias && A <= 32)
      for (int m = 0; m < MR; ++m) acc[m] = _mm256_madd_epi16(acc[m], _mm256_set1_epi16(1));
    if (!U4 && kBias)
      for (int m = 0; m < MR; ++m)
        acc[m] = _mm256_sub_epi32(acc[m], _mm256_set1_epi32(128 * xq.sum_of(g * p.M + m0 + m, b)));
    for (int m = 0; m < MR; ++m)
      total[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[m]),
                                 _mm256_mul_ps(sv, _mm256_set1_ps(xq.scale_of(g * p.M + m0 + m, b))),
                                 total[m]);
  }
  if (o.f || o.h) {  // the offsets' chain (common.h)
    group = -1;
    for (i64 b = 0; b < xq.blocks; ++b) {
      if (b * A / p.group != group) {
        group = b * A / p.group;
        sv = nmajor_gather(p, o, n, rows, group);
      }
      for (int m = 0; m < MR; ++m) {
        const i64 row = g * p.M + m0 + m;
        const __m256 qs = _mm256_set1_ps(static_cast<float>(xq.sum_of(row, b)));
        total[m] = _mm256_fmadd_ps(qs, _mm256_mul_ps(sv, _mm256_set1_ps(xq.scale_of(row, b))), total[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) Vec::storen(p.orow(g, m0 + m) + n, total[m], rows);
}

template <int MR>
void nmajor_rows_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int32_t* buf,
                    const Scales& s, const Scales& o, i64 m0, i64 n, i64 rows) {
  if (p.u4()) nmajor_tile_q8<MR, true>(p, xq, g, buf, s, o, m0, n, rows);
  else nmajor_tile_q8<MR, false>(p, xq, g, buf, s, o, m0, n, rows);
}

// n-major: table rows [n0, n1) of batch g, all rows, 8 table rows a block.
void nmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const Scales s{p.scale(g), p.s16}, o{p.offset(g), p.o16};
  thread_local LineBuffer<int32_t> lines;
  int32_t* buf = lines.get((p.K + 31) / 32 * 8 * 8);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 8) {
    const i64 rows = std::min<i64>(8, n1 - n);
    nmajor_pack_q8(p, w, buf, n, rows);
    i64 m = 0;
    for (; m + 4 <= p.M; m += 4) nmajor_rows_q8<4>(p, xq, g, buf, s, o, m, n, rows);
    switch (p.M - m) {
      case 3: nmajor_rows_q8<3>(p, xq, g, buf, s, o, m, n, rows); break;
      case 2: nmajor_rows_q8<2>(p, xq, g, buf, s, o, m, n, rows); break;
      case 1: nmajor_rows_q8<1>(p, xq, g, buf, s, o, m, n, rows); break;
      default: break;
    }
  }
}

#elif defined(CW_ISA_NEON)
// ---- NEON ---------------------------------------------------------------------

// acc (4 lanes, or with widening multiplies 2 lanes a column: `narrow`
// pairs them up) += the dot products of w's and x's 4-byte quads.
#ifdef __ARM_FEATURE_DOTPROD
struct Dot {
  int32x4_t a = vdupq_n_s32(0);
  CW_INLINE void add(int8x16_t w, int8x16_t x) { a = vdotq_s32(a, w, x); }
  CW_INLINE int32x4_t sums() const { return a; }  // a quad's lane each
};
#else
struct Dot {  // products in int16 (|w x| <= 128 x 128), pairs into int32
  int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
  CW_INLINE void add(int8x16_t w, int8x16_t x) {
    lo = vpadalq_s16(lo, vmull_s8(vget_low_s8(w), vget_low_s8(x)));
    hi = vpadalq_s16(hi, vmull_high_s8(w, x));
  }
  CW_INLINE int32x4_t sums() const { return vpaddq_s32(lo, hi); }
};
#endif

// `rows` weight rows of 16 bytes from r (rows `stride` apart), `cols`
// valid: in place, or through a zeroed copy for a tail.
CW_INLINE void load_rows(const int8_t* r, i64 stride, int rows, i64 cols, int8x16_t* out) {
  for (int i = 0; i < rows; ++i) {
    if (cols >= 16) {
      out[i] = vld1q_s8(r + i * stride);
    } else {
      int8_t buf[16] = {};
      std::memcpy(buf, r + i * stride, static_cast<size_t>(cols));
      out[i] = vld1q_s8(buf);
    }
  }
}

// k-major: rows [m0, m0 + MR) x columns [n, n + cols) (cols <= 16) of
// batch g: quads from zips (columns in order), from their chains in `out`
// and back.
template <int MR>
void kmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const float* s, i64 m0, i64 n, i64 cols) {
  const bool u4 = p.u4();
  const i64 N = p.N, A = xq.A;
  float32x4_t chain[MR][4], sc[4];
  auto loadn = [](const float* q, i64 c) {
    if (c >= 4) return vld1q_f32(q);
    float buf[4] = {};
    for (i64 i = 0; i < c; ++i) buf[i] = q[i];
    return vld1q_f32(buf);
  };
  for (int m = 0; m < MR; ++m)
    for (int q = 0; q < 4; ++q) chain[m][q] = loadn(p.orow(g, m0 + m) + n + 4 * q, cols - 4 * q);
  i64 group = -1;
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A;
    if (k0 / p.group != group) {
      group = k0 / p.group;
      for (int q = 0; q < 4; ++q) sc[q] = loadn(s + group * N + n + 4 * q, cols - 4 * q);
    }
    const int8_t* xb[MR];
    for (int m = 0; m < MR; ++m) xb[m] = xq.at(g * p.M + m0 + m, b);
    Dot acc[MR][4];
    for (i64 t = 0; t < A; t += 4) {
      const i64 k = k0 + t;
      int8x16_t wq[4];
      if (u4) {  // byte rows k / 2 and k / 2 + 1: quads (k, k + 2, k + 1, k + 3)
        int8x16_t a[2];
        load_rows(w + k / 2 * N + n, N, 2, cols, a);
        const uint8x16x2_t z = vzipq_u8(vreinterpretq_u8_s8(a[0]), vreinterpretq_u8_s8(a[1]));
        const uint8x16_t nib = vdupq_n_u8(15);
        for (int h = 0; h < 2; ++h) {
          const uint16x8x2_t q = vzipq_u16(vreinterpretq_u16_u8(vandq_u8(z.val[h], nib)),
                                           vreinterpretq_u16_u8(vshrq_n_u8(z.val[h], 4)));
          wq[2 * h] = vreinterpretq_s8_u16(q.val[0]);
          wq[2 * h + 1] = vreinterpretq_s8_u16(q.val[1]);
        }
      } else {
        int8x16_t a[4];
        load_rows(w + k * N + n, N, 4, cols, a);
        const int8x16x2_t z01 = vzipq_s8(a[0], a[1]), z23 = vzipq_s8(a[2], a[3]);
        for (int h = 0; h < 2; ++h) {
          const int16x8x2_t q = vzipq_s16(vreinterpretq_s16_s8(z01.val[h]), vreinterpretq_s16_s8(z23.val[h]));
          wq[2 * h] = vreinterpretq_s8_s16(q.val[0]);
          wq[2 * h + 1] = vreinterpretq_s8_s16(q.val[1]);
        }
      }
      for (int m = 0; m < MR; ++m) {
        const int8x16_t xv = vreinterpretq_s8_s32(vdupq_n_s32(quad_bits(xb[m] + t)));
        for (int q = 0; q < 4; ++q) acc[m][q].add(wq[q], xv);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const float xs = xq.scale_of(g * p.M + m0 + m, b);
      for (int q = 0; q < 4; ++q)
        chain[m][q] = vfmaq_f32(chain[m][q], vcvtq_f32_s32(acc[m][q].sums()), vmulq_n_f32(sc[q], xs));
    }
  }
  for (int m = 0; m < MR; ++m) {
    float* out = p.orow(g, m0 + m) + n;
    for (int q = 0; q < 4; ++q) {
      const i64 c = cols - 4 * q;
      if (c >= 4) {
        vst1q_f32(out + 4 * q, chain[m][q]);
      } else if (c > 0) {
        float buf[4];
        vst1q_f32(buf, chain[m][q]);
        for (i64 i = 0; i < c; ++i) out[4 * q + i] = buf[i];
      }
    }
  }
}

void kmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const float* s = p.scale(g);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 64) {
    const i64 e = std::min(n1, n + 64);
    i64 m = 0;
    for (; m + 2 <= p.M; m += 2)
      for (i64 c = n; c < e; c += 16) kmajor_tile_q8<2>(p, xq, g, w, s, m, c, std::min<i64>(16, e - c));
    if (m < p.M)
      for (i64 c = n; c < e; c += 16) kmajor_tile_q8<1>(p, xq, g, w, s, m, c, std::min<i64>(16, e - c));
  }
}

// n-major: table rows [n, n + 4) (`rows` valid) x rows [m0, m0 + MR): each
// table row's bytes as they are against x's (u4: low nibbles against a
// block's even inputs, high ones against its odd: x_order), a block's
// lanes summed across (exact) before its f32 step.
template <int MR>
void nmajor_tile_q8(const Problem& p, const QuantizedX8& xq, i64 g, const int8_t* w,
                    const float* s, i64 m0, i64 n, i64 rows) {
  const bool u4 = p.u4();
  const i64 A = xq.A, bytes = u4 ? p.K / 2 : p.K;
  float32x4_t total[MR];
  for (int m = 0; m < MR; ++m) {
    float buf[4] = {};
    for (i64 r = 0; r < rows; ++r) buf[r] = p.orow(g, m0 + m)[n + r];
    total[m] = vld1q_f32(buf);
  }
  for (i64 b = 0; b < xq.blocks; ++b) {
    const i64 k0 = b * A, gr = k0 / p.group;
    float sw[4] = {};
    for (i64 r = 0; r < rows; ++r) sw[r] = s[(n + r) * p.groups + gr];
    const float32x4_t sv = vld1q_f32(sw);
    int32_t isum[MR][4] = {};
    for (i64 r = 0; r < rows; ++r) {
      const int8_t* row = w + (n + r) * bytes;
      Dot acc[MR];
      if (u4) {  // A == 32 (ffi.cc): 16 bytes
        const uint8x16_t c = vld1q_u8(reinterpret_cast<const uint8_t*>(row + k0 / 2));
        const int8x16_t lo = vreinterpretq_s8_u8(vandq_u8(c, vdupq_n_u8(15)));
        const int8x16_t hi = vreinterpretq_s8_u8(vshrq_n_u8(c, 4));
        for (int m = 0; m < MR; ++m) {
          const int8_t* x = xq.at(g * p.M + m0 + m, b);
          acc[m].add(lo, vld1q_s8(x));
          acc[m].add(hi, vld1q_s8(x + 16));
        }
      } else {
        i64 t = 0;
        for (; t + 16 <= A; t += 16) {
          const int8x16_t wv = vld1q_s8(row + k0 + t);
          for (int m = 0; m < MR; ++m) acc[m].add(wv, vld1q_s8(xq.at(g * p.M + m0 + m, b) + t));
        }
        if (t < A) {  // a block of 4 .. 12 more: through zeroed copies
          int8_t wb[16] = {};
          std::memcpy(wb, row + k0 + t, static_cast<size_t>(A - t));
          for (int m = 0; m < MR; ++m) {
            int8_t xbuf[16] = {};
            std::memcpy(xbuf, xq.at(g * p.M + m0 + m, b) + t, static_cast<size_t>(A - t));
            acc[m].add(vld1q_s8(wb), vld1q_s8(xbuf));
          }
        }
      }
      for (int m = 0; m < MR; ++m) isum[m][r] = vaddvq_s32(acc[m].sums());
    }
    for (int m = 0; m < MR; ++m)
      total[m] = vfmaq_f32(total[m], vcvtq_f32_s32(vld1q_s32(isum[m])),
                           vmulq_n_f32(sv, xq.scale_of(g * p.M + m0 + m, b)));
  }
  for (int m = 0; m < MR; ++m) {
    float buf[4];
    vst1q_f32(buf, total[m]);
    for (i64 r = 0; r < rows; ++r) p.orow(g, m0 + m)[n + r] = buf[r];
  }
}

void nmajor_q8(const Problem& p, const QuantizedX8& xq, i64 g, i64 n0, i64 n1) {
  const int8_t* w = p.weight<int8_t>(g);
  const float* s = p.scale(g);
  for (i64 m = 0; m < p.M; ++m) int8_start(p, g, m, n0, n1);
  for (i64 n = n0; n < n1; n += 4) {
    const i64 rows = std::min<i64>(4, n1 - n);
    i64 m = 0;
    for (; m + 2 <= p.M; m += 2) nmajor_tile_q8<2>(p, xq, g, w, s, m, n, rows);
    if (m < p.M) nmajor_tile_q8<1>(p, xq, g, w, s, m, n, rows);
  }
}
#endif

// x86's tiles chain the offsets themselves, reading them as they are (f32
// or f16); NEON's outputs take them in a pass of their own after.
#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
constexpr bool kOffsetsInTiles = true;
#else
constexpr bool kOffsetsInTiles = false;
#endif

// kernels_int8.h's blocks of outputs.
void run_act8(const Problem& p, const QuantizedX8& xq, Parallel& par) {
  run_blocks(
      p, par,
      [&](const Problem& q, i64 g, i64 n0, i64 n1) {
        if (q.nmajor) nmajor_q8(q, xq, g, n0, n1);
        else kmajor_q8(q, xq, g, n0, n1);
        if (!kOffsetsInTiles && q.o != nullptr)
          add_offsets_rows(q, xq.qsum.data(), xq.scale.data(), xq.blocks, g, n0, n1);
      },
      kOffsetsInTiles);
}
