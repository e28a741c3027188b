// What every kernel translation unit shares: the problem a matmul call
// describes, the thread interface, the table of one instruction set's
// kernels, and the definitions written once for any lane type (exp, log,
// the int16 rounding of activations).
//
// The kernels are compiled once per instruction set (kernels.cc with
// CW_ISA_AVX2, CW_ISA_AVX512, ...; portable.cc for the plain loops that
// define every result) and chosen at run time (dispatch.cc). Nothing here
// includes XLA: selftest.cc runs the same kernels without it (the AArch64
// build under qemu).
//
// Functions here have internal linkage (an unnamed namespace) or are
// always inlined: each instruction set's build is a shared object of its
// own (build.py), and no code compiled for one set may be reached from
// another's.

#ifndef CHUNKWISE_CPU_KERNELS_COMMON_H_
#define CHUNKWISE_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#define CW_INLINE inline __attribute__((always_inline))

namespace chunkwise {

using i64 = int64_t;

// body(0 .. total - 1), each index once, by the calling thread and helpers.
class Parallel {
 public:
  virtual ~Parallel() = default;
  virtual int threads() const = 0;
  virtual void run(i64 total, const std::function<void(i64)>& body) = 0;
};

// kU4: 4-bit codes (0..15) two to a byte along K (input k even in the low
// nibble, k + 1 in the high one): [K / 2, N] k-major, [N, K / 2] n-major
// (`models.blocks`, GGUF's Q4 formats); scaled like int8.
enum class Weight { kF32, kBF16, kI8, kU4 };

// One matmul call (invariant.py's `invariant_matmul`):
//
//   x: f32 [G, M, K]; w: f32, bf16 or int8, [Gw, K, N] ("k-major") or
//   [Gw, N, K] ("n-major"), Gw = 1 (one weight for every g) or G;
//   scale: f32 [Gw, K / group, N] or [Gw, N, K / group] (int8, u4 only);
//   offset: like scale, or nullptr (int8, u4: w = code * scale + offset);
//   acc: f32 [G, M, N'] (nullptr: +0); shift: f32 [G, M] (float weights:
//   x[g, m, k] enters as exp(x[g, m, k] - shift[g, m]); nullptr: none);
//   out: f32 [G, M, N'] with N' = N + ones (a last column of weight 1,
//   k-major float only).
//
// What each output is, bit for bit, is defined by portable.cc.
struct Problem {
  const float* x = nullptr;
  const void* w = nullptr;
  const float* s = nullptr;    // int8 scales, else nullptr
  const float* o = nullptr;    // int8 / u4 offsets per group, or nullptr
  // The same as f16 (then s and o are nullptr; one shared weight): each
  // block of outputs widens its own (run_int8), the portable path all.
  const uint16_t* s16 = nullptr;
  const uint16_t* o16 = nullptr;
  const float* acc = nullptr;  // nullptr: chains start at +0
  // A float weight's x enters as exp(x - shift[g * M + m]) (attention's
  // weights from its logits and their max); nullptr: as it is.
  const float* shift = nullptr;
  float* out = nullptr;
  Weight type = Weight::kF32;
  bool nmajor = false;
  i64 G = 0, M = 0, K = 0, N = 0, groups = 1, group = 0;
  bool w_shared = true, ones = false;
  // int8 and u4 weights: activations rounded to int8 per block of
  // act_block() inputs (below) instead of int16 per group.
  bool act8 = false;
  // A window of `count` of w's `heads` (its second dim) from `first`:
  // batch g reads w's [g / count, first + g % count]; count 0: none.
  i64 heads = 0, count = 0, first = 0;
  // An attention cache [lead, heads, S, D] read in place (nullptr: none).
  // Batch g belongs to the cache's logical row r = g / per (per: the
  // window's count, else the cache's heads). `rows`: row r reads the
  // cache's row rows[r] (clamped into [0, lead)) instead of row r.
  // `valid`: only the first valid[r] keys of row r enter (clamped into
  // [0, S]): a k-major product's chains stop after input valid[r] - 1, an
  // n-major product's outputs from column valid[r] on are their starts
  // (acc or +0). Past a row's length every key is masked, and a masked
  // key's weight exp(-1e30 - top) is exactly 0, so the chains that stop
  // early hold what the longer ones would (invariant_attention.py).
  const int32_t* rows = nullptr;
  const int32_t* valid = nullptr;
  i64 per = 1, lead = 0;

  CW_INLINE i64 cols() const { return N + (ones ? 1 : 0); }
  CW_INLINE i64 lead_row(i64 r) const {
    if (rows == nullptr) return r;
    const i64 x = rows[r];
    return x < 0 ? 0 : x >= lead ? lead - 1 : x;
  }
  CW_INLINE i64 w_index(i64 g) const {
    if (w_shared) return 0;
    if (count) return lead_row(g / count) * heads + first + g % count;
    if (rows) return lead_row(g / per) * per + g % per;
    return g;
  }
  CW_INLINE i64 limit(i64 g, i64 n) const {
    if (valid == nullptr) return n;
    const i64 v = valid[g / per];
    return v < 0 ? 0 : v > n ? n : v;
  }
  // Inputs that enter batch g's chains (k-major: up to its valid keys).
  CW_INLINE i64 k_end(i64 g) const { return nmajor ? K : limit(g, K); }
  // Columns of batch g that are computed (n-major: its valid keys).
  CW_INLINE i64 n_end(i64 g) const { return nmajor ? limit(g, N) : cols(); }
  template <class W>
  CW_INLINE const W* weight(i64 g) const {
    return static_cast<const W*>(w) + w_index(g) * K * N;
  }
  CW_INLINE const float* scale(i64 g) const {
    return s == nullptr ? nullptr : s + w_index(g) * groups * N;
  }
  CW_INLINE const float* offset(i64 g) const {
    return o == nullptr ? nullptr : o + w_index(g) * groups * N;
  }
  CW_INLINE bool u4() const { return type == Weight::kU4; }
  // act8: inputs per activation block (common.h's definition below).
  CW_INLINE i64 act_block() const { return group % 32 == 0 ? 32 : group; }
  CW_INLINE i64 act_blocks() const { return K / act_block(); }
  // Byte of a u4 weight's codes (k, n) (its k's parity picks the nibble).
  CW_INLINE i64 u4_byte(i64 k, i64 n) const { return nmajor ? n * (K / 2) + k / 2 : k / 2 * N + n; }
  CW_INLINE const float* xrow(i64 g, i64 m) const { return x + (g * M + m) * K; }
  CW_INLINE float* orow(i64 g, i64 m) const { return out + (g * M + m) * cols(); }
  CW_INLINE const float* arow(i64 g, i64 m) const {
    return acc == nullptr ? nullptr : acc + (g * M + m) * cols();
  }
};

namespace {  // internal to each build (module doc)

inline float as_float(float v) { return v; }
inline float as_float(int8_t v) { return static_cast<float>(v); }
inline float as_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The fixed tree over 16 lanes: (l, l + 8), (l, l + 4), (l, l + 2),
// (l, l + 1).
inline float tree16(const float* a) {
  float t[8], u[4], v[2];
  for (int l = 0; l < 8; ++l) t[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
  for (int l = 0; l < 2; ++l) v[l] = u[l] + u[l + 2];
  return v[0] + v[1];
}

// ---- int8 weights: activations rounded to int16 ---------------------------
//
// Row m's inputs in weight group g (group = K / groups consecutive inputs)
// become int16 q = nearbyint(x * (32767 / max |x| over the group)), and
// the group's scale sx = max / 32767 (each one f32 operation). A group
// with a non-finite input has sx = NaN (its outputs are NaN, as in f32
// math); a group whose max is below kTiny is zeros with sx = 0 (32767 /
// max would overflow). Within a group, chunks of kChunk inputs are summed
// exactly in int32 (|q w| <= 32767 * 128 < 2^22, 256 of them < 2^30), in
// any order; the output is then one f32 chain over the chunks in order:
//   a <- fma(float(isum), s_w(g, n) * sx(m, g), a)
// from acc (or +0).
constexpr i64 kChunk = 256;
constexpr float kTiny = 1e-30f;

// A grow-only buffer whose data starts on a 64-byte line: a vector load
// of a row whose bytes are a multiple of 64 then never straddles two lines
// (a split load costs about two; unaligned panels cost the packed products
// ~10%). get(n) keeps the contents only while n does not grow.
template <class T>
class LineBuffer {
 public:
  T* get(size_t n) {
    constexpr size_t pad = 64 / sizeof(T);
    if (raw_.size() < n + pad) raw_.resize(n + pad);
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t{63});
  }

 private:
  std::vector<T> raw_;
};

// Row-major [M, groups, P] int16 (P = group rounded up to 32; the padding
// is zeros) and [M, groups] scales.
struct QuantizedX {
  std::vector<int16_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum;  // [M, groups], with offsets only
  i64 M = 0, groups = 0, group = 0, P = 0;

  CW_INLINE const int16_t* at(i64 m, i64 g) const { return q.data() + (m * groups + g) * P; }
  CW_INLINE float scale_of(i64 m, i64 g) const { return scale[m * groups + g]; }
};

// The offsets' chain (above) for row m of batch g, outputs [n0, n1),
// after every chunk: the same scalar operations on every path. `blocks`
// (qsum's and sx's entries: the groups, or act8's blocks) over the groups.
inline void add_offsets(const Problem& p, const int32_t* qsum, const float* sx, i64 blocks,
                        i64 g, i64 m, i64 n0, i64 n1) {
  const float* o = p.offset(g);
  float* out = p.orow(g, m);
  for (i64 b = 0; b < blocks; ++b) {
    const i64 gr = b * p.groups / blocks;
    const float q = static_cast<float>(qsum[b]);
    const float x = sx[b];
    if (p.nmajor) {
      for (i64 n = n0; n < n1; ++n) out[n] = std::fma(q, o[n * p.groups + gr] * x, out[n]);
    } else {
      const float* og = o + gr * p.N;
      for (i64 n = n0; n < n1; ++n) out[n] = std::fma(q, og[n] * x, out[n]);
    }
  }
}

// An IEEE half (its bits) as f32: exact, so every path's value.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 31u, man = h & 1023u, bits;
  if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 1024u)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 1023u) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// A u4 weight's code at (k, n) (Problem::u4_byte).
inline int8_t u4_code(const Problem& p, const uint8_t* w, i64 k, i64 n) {
  const uint8_t b = w[p.u4_byte(k, n)];
  return static_cast<int8_t>((k & 1) ? b >> 4 : b & 15);
}

// The per-group factor and whether the group is rounded at all (module
// doc): sets *sx and *inv from the group's max |x| and finiteness.
// `top`: the largest code, 32767 (int16) or 127 (int8, below).
inline bool group_scale(float mx, bool finite, float* sx, float* inv, float top = 32767.f) {
  if (!finite) {
    *sx = std::numeric_limits<float>::quiet_NaN();
    return false;
  }
  if (!(mx >= kTiny)) {
    *sx = 0.f;
    return false;
  }
  *sx = mx / top;
  *inv = top / mx;
  return true;
}

inline int16_t round_i16(float v) {
  const float r = std::nearbyint(v);
  return static_cast<int16_t>(std::max(-32767.f, std::min(32767.f, r)));
}

// ---- int8 and u4 weights: activations rounded to int8 (Problem::act8) ------
//
// llama.cpp's Q8_0 activations, invariant: row m's inputs in blocks of A
// = act_block() consecutive inputs (32 where the weight group is a
// multiple of 32, so GGUF's blocks of 32 and our int8 weights' groups;
// else the whole group, e.g. Q6_K's 16) become int8 q = nearbyint(x *
// (127 / max |x| over the block)), clamped to +-127, and the block's scale
// sx = max / 127, non-finite and tiny blocks as above. A block's products
// are summed exactly in int32 (|q w| <= 127 * 128: blocks up to 2^17
// inputs), in any order; the output is then one f32 chain over the blocks
// in order,
//   a <- fma(float(isum), s_w(gr, n) * sx(m, b), a)      (gr: b's group)
// from acc (or +0), then, with offsets, over the blocks again:
//   a <- fma(float(qsum(m, b)), o(gr, n) * sx(m, b), a)
// with qsum the block's sum of q. Half the bytes of int16 inputs, and
// four products per 32-bit lane in one instruction (VNNI's vpdpbusd,
// AVX2's vpmaddubsw + vpmaddwd, NEON's sdot).
constexpr i64 kMaxActBlock = i64{1} << 17;

inline int8_t round_i8(float v) {
  const float r = std::nearbyint(v);
  return static_cast<int8_t>(std::max(-127.f, std::min(127.f, r)));
}

// Rows of x rounded to int8 (above): q [M, blocks, P] (P = A rounded up
// to 4; a kernel may store each block's inputs in its own order, the sums
// being exact), sx and qsum [M, blocks].
struct QuantizedX8 {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> qsum;
  i64 M = 0, blocks = 0, A = 0, P = 0;

  CW_INLINE const int8_t* at(i64 m, i64 b) const { return q.data() + (m * blocks + b) * P; }
  CW_INLINE float scale_of(i64 m, i64 b) const { return scale[m * blocks + b]; }
  CW_INLINE int32_t sum_of(i64 m, i64 b) const { return qsum[m * blocks + b]; }
};

// Block b of row `row` (x's f32 row, A inputs at xb) rounded into q (its
// P entries, zeros past A, input t at q[order(t)]), *sx, *qsum: the same
// values on every path (the max is exact in any order).
template <class Order>
inline void quantize_block8(const float* xb, i64 A, i64 P, int8_t* q, float* sx, int32_t* qsum,
                            Order order) {
  float mx = 0.f;
  bool finite = true;
  for (i64 t = 0; t < A; ++t) {
    finite &= std::isfinite(xb[t]);
    mx = std::max(mx, std::fabs(xb[t]));
  }
  if (P > 0) std::fill(q, q + P, int8_t{0});
  float inv = 0.f;
  int32_t sum = 0;
  if (group_scale(mx, finite, sx, &inv, 127.f))
    for (i64 t = 0; t < A; ++t) {
      const int8_t v = round_i8(xb[t] * inv);
      q[order(t)] = v;
      sum += v;
    }
  *qsum = sum;
}

// ---- exp and log, the same operations in every lane ------------------------
//
// XLA:CPU computes exp and log with a vector routine in a loop's vector
// body and another in its scalar remainder, so an element's value depended
// on the array's shape (e.g. 7 elements vs 16). These are Cephes'
// single-precision polynomials (about 1 ulp), written once for a lane: `L`
// is `Scalar` (the definition) or a vector whose every operation rounds as
// the scalar one does. exp flushes results below 2^-126 to 0 (x < -87.33)
// and overflows to inf above 88.72; log(0) = -inf (and of subnormals,
// which XLA:CPU flushes to 0), log(x < 0) = NaN.

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
  static F lt_select(F x, F y, F a, F b) { return x < y ? a : b; }  // x < y ? a : b
  static F gt_select(F x, F y, F a, F b) { return x > y ? a : b; }
  static F nan_select(F x, F a) { return x != x ? x : a; }          // NaN x passes
};

// exp(x) = y * 2^n: n = round(x / ln 2) and y the polynomial of the rest.
template <class L>
typename L::F exp_poly(typename L::F x, typename L::F* n_out) {
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
  *n_out = n;
  return L::add(L::fma(p, L::mul(r, r), r), L::set(1.f));
}

template <class L>
typename L::F exp_lanes(typename L::F x) {
  using F = typename L::F;
  F n;
  const F y = exp_poly<L>(x, &n);
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

// exp_lanes of x in [kExpLow, 0] (attention's logit minus its max): the
// same operations less those that leave such an x's result as it is (n is
// in [-126, 0]: the clamp, the factor 2 for n = 128 and the out-of-range
// selects), so the same bits.
constexpr float kExpLow = -87.33654022216797f;

template <class L>
typename L::F exp_lanes_nonpositive(typename L::F x) {
  typename L::F n;
  const typename L::F y = exp_poly<L>(x, &n);
  return L::mul(y, L::from_bits(L::shl(L::iadd(L::to_int(n), 127), 23)));
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
  out = L::gt_select(x, L::set(3.40282347e+38f), x, out);                  // inf
  out = L::lt_select(x, L::set(1.17549435e-38f), L::set(-INFINITY), out);  // 0
  out = L::lt_select(x, L::set(0.f), L::set(NAN), out);                    // x < 0
  return L::nan_select(x, out);
}

}  // namespace

enum Unary : int64_t { kExp = 0, kLog = 1 };

// Attention under invariant numerics in one call (`attend`): the
// operations of models/invariant_attention.py's chain, each query's
// logits, their max and the weighted values kept in cache instead of
// written out between kernel calls. One piece of keys and values (a
// prefix's, or the chunk's own), read in place.
struct AttendPiece {
  const void* k = nullptr;  // [b, heads, S, D] f32 or bf16, as v
  const void* v = nullptr;
  bool bf16 = false;
  i64 b = 1, heads = 1, first = 0, S = 0;
  // Keys a query sees: mask[mb][mr][mt][ms] (bool bytes), each dim 1
  // (broadcast) or full: b, B / b, the chunk's T, S.
  const uint8_t* mask = nullptr;
  i64 mb = 1, mr = 1, mt = 1, ms = 1;

  // Row `s` of head h's keys (values) for query batch row bq of B.
  CW_INLINE i64 row(i64 B, i64 bq, i64 h, i64 s) const {
    return ((bq / (B / b)) * heads + first + h) * S + s;
  }
  // Rows [row, row + n) of k or v (`base`) as f32 rows of D: f32 read in
  // place, bf16 widened into buf (n * D floats).
  CW_INLINE const float* rows_f32(const void* base, i64 row, i64 n, i64 D, float* buf) const {
    if (!bf16) return static_cast<const float*>(base) + row * D;
    const uint16_t* h = static_cast<const uint16_t*>(base) + row * D;
    for (i64 i = 0; i < n * D; ++i) buf[i] = as_float(h[i]);
    return buf;
  }
  // The mask over this piece's keys for batch row bq and token t: `at(s)`.
  struct Seen {
    const uint8_t* m;
    i64 step;
    CW_INLINE bool at(i64 s) const { return m[s * step] != 0; }
  };
  CW_INLINE Seen seen(i64 B, i64 bq, i64 t) const {
    const i64 r = B / b;
    const i64 i = ((mb > 1 ? bq / r : 0) * mr + (mr > 1 ? bq % r : 0)) * mt + (mt > 1 ? t : 0);
    return {mask + i * ms, ms > 1 ? 1 : 0};
  }
};

// q [B, kv, T * group, D] (rows t * group + g, pre-scaled); out [B, kv,
// T * group, D + 1]: for each query row, the weighted values' chains and
// the weights' sum (the last column), as invariant_attention.py's kernels
// compute them: logit = one FMA chain over D from +0 (key by key, piece
// after piece), masked logits -1e30, top = their max, then per output one
// FMA chain of exp(logit - top) x value over the keys in order (the sum:
// x 1), from +0.
struct Attend {
  const float* q = nullptr;
  float* out = nullptr;
  i64 B = 0, kv = 0, T = 0, group = 1, D = 0;
  const AttendPiece* piece = nullptr;
  i64 pieces = 0;
  CW_INLINE i64 rows() const { return T * group; }
  CW_INLINE i64 keys() const {
    i64 n = 0;
    for (i64 p = 0; p < pieces; ++p) n += piece[p].S;
    return n;
  }
};

constexpr float kMasked = -1e30f;  // invariant_attention._MASKED

// One instruction set's kernels (portable.cc, kernels.cc).
struct Table {
  const char* name;
  // out (and the problem's every other field) as Problem describes.
  void (*matmul)(const Problem& p, Parallel& par);
  // out[i] = exp or log (op) of x[i], i < n.
  void (*unary)(const float* x, float* out, i64 n, int64_t op, Parallel& par);
  // out[m] = the 16-lane row sum (portable.cc) of x[m, :], or with
  // `shift` (else nullptr) of exp(x[m, :] - shift[m]).
  void (*row_sum)(const float* x, const float* shift, float* out, i64 M, i64 K,
                  Parallel& par);
  // Attend's out.
  void (*attend)(const Attend& a, Parallel& par);
  // out[i] = the IEEE half in[i] as f32 (exact), i < n.
  void (*half_to_float)(const uint16_t* in, float* out, i64 n);
};

// The instruction sets, as dispatch.cc and invariant.py number them.
// Within an architecture, a later set is preferred where the CPU has it.
enum Isa : int64_t {
  kAuto = 0,
  kPortable = 1,
  kAvx2 = 2,
  kAvx2Vnni = 3,
  kAvx512 = 4,
  kAvx512Vnni = 5,
  kNeon = 6,
  kNeonDot = 7,
  kIsaCount = 8,
};

}  // namespace chunkwise

#endif  // CHUNKWISE_CPU_KERNELS_COMMON_H_
