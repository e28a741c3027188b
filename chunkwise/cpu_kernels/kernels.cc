// The vector paths of the invariant kernels, compiled once per instruction
// set (build.py: -DCW_ISA_AVX2, -DCW_ISA_AVX512 with or without VNNI,
// -DCW_ISA_NEON, each with -DCW_NS naming its namespace). Each computes
// exactly portable.cc's operations: tiles (rows x columns per register
// block), blocks that threads claim, and cache blocking of the inputs
// change only which outputs are computed together and when a chain's
// running value is stored and reloaded (exactly), never an output's
// operations or their order.
//
// Float weights (templates over vec.h's `Vec`, one source for every
// instruction set):
// - k-major, many rows: `kmajor_block` packs a block's weight columns
//   (bf16 widened, the ones column set, zero past the last) into panels of
//   NR columns x KC inputs and runs MR x NR register tiles over them,
//   KC inputs at a time (the chains stored into `out` between).
// - k-major, few rows (decode): `kmajor_stream` reads four weight rows a
//   step straight from the weight, every row's accumulators in L1.
// - n-major: `nmajor_tile`, RR weight rows x MR x rows of 16-lane chains
//   (16 / W vectors each), then the fixed trees.
// int8 weights (common.h's definition): the activations rounded to int16
// once per call (`quantize`), int32 sums per chunk in register tiles
// (x86: pairs of inputs with madd / VNNI's dpwssd; NEON: widening
// multiply-adds), one f32 FMA per chunk and output.

#include "vec.h"

#ifndef CW_NS
#error "kernels.cc is built with -DCW_NS=<namespace>"
#endif
#define CW_STR2(x) #x
#define CW_STR(x) CW_STR2(x)

namespace chunkwise {
namespace CW_NS {
namespace {

using V = Vec::V;
constexpr int W = Vec::W;

// ---- tile sizes per instruction set -----------------------------------------
#if defined(CW_ISA_AVX512)
constexpr int kMR = 6, kNV = 4;        // k-major tile: 6 rows x 64 columns
constexpr int kStreamV = 4;            // decode: 64 columns a sub-block
constexpr int kRR = 4, kRM = 4;        // n-major tile: 4 weight rows x 4 rows
constexpr int kRRFew = 8;              // n-major, < 4 rows
#elif defined(CW_ISA_AVX2)
constexpr int kMR = 6, kNV = 2;        // 6 x 16
constexpr int kStreamV = 2;            // 16 columns
constexpr int kRR = 2, kRM = 2;
constexpr int kRRFew = 4;
#else  // NEON
constexpr int kMR = 6, kNV = 4;        // 6 x 16
constexpr int kStreamV = 4;            // 16 columns
constexpr int kRR = 2, kRM = 2;
constexpr int kRRFew = 4;
#endif
constexpr int kNR = kNV * W;           // columns per k-major tile
// k-major blocks: columns per block (whole tiles), inputs per panel.
constexpr i64 kNB = 64 > kNR ? 64 : kNR;
constexpr i64 kKC = 256;
// Rows at or above which a k-major block packs panels (else streams), rows
// per block (a band), and multiply-adds below which a call runs on the
// calling thread alone.
constexpr i64 kPackRows = 32;
constexpr i64 kBandRows = 96;
constexpr i64 kInline = 1 << 18;
// Weight rows read ahead (the hardware prefetchers miss short segments of
// rows N apart).
constexpr i64 kAhead = 8;

// ---- float, k-major --------------------------------------------------------

// W weights of k-major row k from column c (< cols) as f32: bf16 widened,
// the ones column set, zero past the last column.
template <class T>
inline V kmajor_weights(const Problem& p, const T* w, i64 k, i64 c) {
  const T* row = w + k * p.N + c;
  V v;
  if (c + W <= p.N) v = Vec::load(row);
  else if (c < p.N) v = Vec::loadn(row, p.N - c);
  else v = Vec::zero();
  const i64 at = p.N - c;  // the ones column's lane
  if (p.ones && at >= 0 && at < W) v = Vec::set_lane(v, static_cast<int>(at), 1.f);
  return v;
}

// MR rows x NV vectors of one panel ([kc][NR]) from the chains in `start`
// (row r at start + r * ls; nullptr: +0), into out (row r at out + r * lo),
// `ncols` of the NR columns valid.
template <int MR, int NV>
inline void kmajor_tile(const float* x, i64 lx, const float* pp, i64 kc,
                        const float* start, i64 ls, float* out, i64 lo, i64 ncols) {
  V a[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j)
      a[r][j] = start ? Vec::loadn(start + r * ls + j * W, ncols - j * W) : Vec::zero();
  for (i64 k = 0; k < kc; ++k) {
    V wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Vec::load(pp + k * (NV * W) + j * W);
    for (int r = 0; r < MR; ++r) {
      const V xb = Vec::set1(x[r * lx + k]);
      for (int j = 0; j < NV; ++j) a[r][j] = Vec::fma(xb, wv[j], a[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j) {
      const i64 n = ncols - j * W;
      if (n >= W) Vec::store(out + r * lo + j * W, a[r][j]);
      else if (n > 0) Vec::storen(out + r * lo + j * W, a[r][j], n);
    }
}

template <int MR>
inline void kmajor_rows(const Problem& p, i64 g, i64 m, i64 k0, i64 kc, const float* pp,
                        i64 c0, i64 ncols) {
  const i64 cols = p.cols();
  const float* x = p.xrow(g, m) + k0;
  float* out = p.orow(g, m) + c0;
  const float* start = k0 > 0 ? out : (p.acc ? p.arow(g, m) + c0 : nullptr);
  kmajor_tile<MR, kNV>(x, p.K, pp, kc, start, cols, out, cols, ncols);
}

// Rows [m0, m1) x columns [n0, n1) (n1 - n0 <= kNB) of batch g, from
// panels of KC inputs.
template <class T>
void kmajor_block(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const T* w = p.weight<T>(g);
  const i64 tiles = (n1 - n0 + kNR - 1) / kNR;
  thread_local std::vector<float> panel;
  if (panel.size() < static_cast<size_t>(tiles * kKC * kNR)) panel.resize(tiles * kKC * kNR);
  for (i64 k0 = 0; k0 < p.K; k0 += kKC) {
    const i64 kc = std::min(kKC, p.K - k0);
    for (i64 t = 0; t < tiles; ++t) {  // panel t: [kc][NR]
      float* pp = panel.data() + t * kKC * kNR;
      for (i64 k = 0; k < kc; ++k)
        for (int j = 0; j < kNV; ++j)
          Vec::store(pp + k * kNR + j * W, kmajor_weights(p, w, k0 + k, n0 + t * kNR + j * W));
    }
    for (i64 t = 0; t < tiles; ++t) {
      const float* pp = panel.data() + t * kKC * kNR;
      const i64 c0 = n0 + t * kNR, ncols = std::min<i64>(kNR, n1 - c0);
      i64 m = m0;
      for (; m + kMR <= m1; m += kMR) kmajor_rows<kMR>(p, g, m, k0, kc, pp, c0, ncols);
      for (; m + 2 <= m1; m += 2) kmajor_rows<2>(p, g, m, k0, kc, pp, c0, ncols);
      if (m < m1) kmajor_rows<1>(p, g, m, k0, kc, pp, c0, ncols);
    }
  }
}

// k-major, few rows (decode): rows [m0, m1) x columns [n0, n1), in
// sub-blocks of S = kStreamV * W columns, four weight rows a step: each
// weight vector is loaded once for every row and a step reads (n1 - n0)
// contiguous columns of four rows; the accumulators stay in L1.
template <class T>
void kmajor_stream(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  constexpr i64 kSub = kStreamV * W;
  const T* w = p.weight<T>(g);
  const i64 rows = m1 - m0;
  const i64 subs = (n1 - n0 + kSub - 1) / kSub;
  const i64 stride = subs * kSub;  // floats per accumulator row
  thread_local std::vector<float> buf;
  if (buf.size() < static_cast<size_t>(rows * stride)) buf.resize(rows * stride);
  float* A = buf.data();
  for (i64 m = 0; m < rows; ++m) {
    const float* acc = p.arow(g, m0 + m);
    for (i64 c = 0; c < stride; c += W)
      Vec::store(A + m * stride + c,
                 acc ? Vec::loadn(acc + n0 + c, std::min(n1, p.cols()) - n0 - c) : Vec::zero());
  }
  i64 k = 0;
  for (; k + 4 <= p.K; k += 4)
    for (i64 sb = 0; sb < subs; ++sb) {
      const i64 c0 = n0 + sb * kSub;
      if (((c0 * static_cast<i64>(sizeof(T))) & 63) == 0 && k + kAhead + 4 <= p.K)
        for (int i = 0; i < 4; ++i) prefetch(w + (k + kAhead + i) * p.N + c0);
      V wv[4][kStreamV];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < kStreamV; ++j) wv[i][j] = kmajor_weights(p, w, k + i, c0 + j * W);
      for (i64 m = 0; m < rows; ++m) {
        const float* xm = p.xrow(g, m0 + m) + k;
        const V x0 = Vec::set1(xm[0]), x1 = Vec::set1(xm[1]);
        const V x2 = Vec::set1(xm[2]), x3 = Vec::set1(xm[3]);
        for (int j = 0; j < kStreamV; ++j) {
          float* a = A + m * stride + sb * kSub + j * W;
          V t = Vec::fma(x0, wv[0][j], Vec::load(a));
          t = Vec::fma(x1, wv[1][j], t);
          t = Vec::fma(x2, wv[2][j], t);
          Vec::store(a, Vec::fma(x3, wv[3][j], t));
        }
      }
    }
  for (; k < p.K; ++k)
    for (i64 c = 0; c < stride; c += W) {
      const V wv = kmajor_weights(p, w, k, n0 + c);
      for (i64 m = 0; m < rows; ++m) {
        const V xb = Vec::set1(p.xrow(g, m0 + m)[k]);
        float* a = A + m * stride + c;
        Vec::store(a, Vec::fma(xb, wv, Vec::load(a)));
      }
    }
  for (i64 m = 0; m < rows; ++m) {
    float* out = p.orow(g, m0 + m);
    for (i64 c = 0; c < n1 - n0; c += W) {
      const i64 n = n1 - n0 - c;
      if (n >= W) Vec::store(out + n0 + c, Vec::load(A + m * stride + c));
      else Vec::storen(out + n0 + c, Vec::load(A + m * stride + c), n);
    }
  }
}

// ---- float, n-major ---------------------------------------------------------

// 16 inputs (kParts vectors) from k, n (< 16) of them past the end zero.
template <class T>
inline void load16(const T* p, i64 n, V* v) {
  for (int q = 0; q < kParts; ++q) {
    const i64 left = n - q * W;
    v[q] = left >= W ? Vec::load(p + q * W) : left > 0 ? Vec::loadn(p + q * W, left) : Vec::zero();
  }
}

// RR weight rows [n, n + RR) x MR rows [m, m + MR) of batch g; w: row n's
// first element.
template <int RR, int MR, class T>
inline void nmajor_tile(const Problem& p, i64 g, const T* w, i64 m, i64 n) {
  const float* x[MR];
  for (int r = 0; r < MR; ++r) x[r] = p.xrow(g, m + r);
  V a[RR][MR][kParts];
  for (int i = 0; i < RR; ++i)
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < kParts; ++q) a[i][r][q] = Vec::zero();
  i64 k = 0;
  for (; k + 16 <= p.K; k += 16) {
    V xv[MR][kParts];
    for (int r = 0; r < MR; ++r)
      for (int q = 0; q < kParts; ++q) xv[r][q] = Vec::load(x[r] + k + q * W);
    for (int i = 0; i < RR; ++i)
      for (int q = 0; q < kParts; ++q) {
        const V wv = Vec::load(w + i * p.K + k + q * W);
        for (int r = 0; r < MR; ++r) a[i][r][q] = Vec::fma(xv[r][q], wv, a[i][r][q]);
      }
  }
  if (k < p.K) {  // the last, partial step
    V xv[MR][kParts];
    for (int r = 0; r < MR; ++r) load16(x[r] + k, p.K - k, xv[r]);
    for (int i = 0; i < RR; ++i) {
      V wv[kParts];
      load16(w + i * p.K + k, p.K - k, wv);
      for (int r = 0; r < MR; ++r)
        for (int q = 0; q < kParts; ++q) a[i][r][q] = Vec::fma(xv[r][q], wv[q], a[i][r][q]);
    }
  }
  if constexpr (RR * MR == 16) {  // all 16 trees at once
    V v[16 * kParts];
    for (int r = 0; r < MR; ++r)
      for (int i = 0; i < RR; ++i)
        for (int q = 0; q < kParts; ++q) v[(r * RR + i) * kParts + q] = a[i][r][q];
    float sums[16];
    Vec::trees16(v, sums);
    for (int r = 0; r < MR; ++r)
      std::memcpy(p.orow(g, m + r) + n, sums + r * RR, RR * sizeof(float));
  } else {
    for (int i = 0; i < RR; ++i)
      for (int r = 0; r < MR; ++r) p.orow(g, m + r)[n + i] = Vec::tree16(a[i][r]);
  }
}

template <int RR, class T>
inline void nmajor_rows(const Problem& p, i64 g, const T* w, i64 m0, i64 m1, i64 n) {
  i64 m = m0;
  for (; m + kRM <= m1; m += kRM) nmajor_tile<RR, kRM>(p, g, w, m, n);
  for (; m < m1; ++m) nmajor_tile<RR, 1>(p, g, w, m, n);
}

// Weight rows [n0, n1), rows [m0, m1).
template <class T>
void nmajor_block(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const T* w = p.weight<T>(g);
  i64 n = n0;
  if (m1 - m0 < kRM)  // few x rows: more weight rows for independent chains
    for (; n + kRRFew <= n1; n += kRRFew) nmajor_rows<kRRFew>(p, g, w + n * p.K, m0, m1, n);
  for (; n + kRR <= n1; n += kRR) nmajor_rows<kRR>(p, g, w + n * p.K, m0, m1, n);
  for (; n < n1; ++n) nmajor_rows<1>(p, g, w + n * p.K, m0, m1, n);
}

template <class T>
void run_float(const Problem& p, Parallel& par) {
  const i64 width = p.nmajor ? p.N : p.cols();
  // Few rows (k-major): wider blocks (whole lines of four weight rows a
  // step), two per thread, in multiples of 64 columns.
  const bool stream = !p.nmajor && p.M < kPackRows;
  const i64 threads = std::max(1, par.threads());
  const i64 wide = std::max<i64>(64, (width + 2 * threads - 1) / (2 * threads) + 63) / 64 * 64;
  const i64 nblock = stream ? std::min<i64>(wide, 512) : p.nmajor ? 64 : kNB;
  const i64 nblocks = (width + nblock - 1) / nblock;
  const i64 bands = (p.M + kBandRows - 1) / kBandRows;
  const i64 total = p.G * bands * nblocks;
  auto body = [&](i64 b) {
    const i64 g = b / (bands * nblocks);
    const i64 band = b / nblocks % bands;
    const i64 n0 = b % nblocks * nblock, n1 = std::min(width, n0 + nblock);
    const i64 m0 = band * kBandRows, m1 = std::min(p.M, m0 + kBandRows);
    if (p.nmajor) nmajor_block<T>(p, g, m0, m1, n0, n1);
    else if (stream) kmajor_stream<T>(p, g, m0, m1, n0, n1);
    else kmajor_block<T>(p, g, m0, m1, n0, n1);
  };
  // Small products (a decode step's attention: a few rows against a short
  // cache) run on the calling thread: waking a pool thread cost more.
  if (p.G * p.M * p.K * width < kInline) {
    for (i64 b = 0; b < total; ++b) body(b);
    return;
  }
  par.run(total, body);
}

// ---- int8: activations rounded to int16 -------------------------------------

// Every row of x rounded per weight group (common.h): the same values as
// portable.cc's quantize_row.
void quantize(const Problem& p, QuantizedX& xq) {
  xq.M = p.G * p.M;
  xq.groups = p.groups;
  xq.group = p.group;
  xq.P = (p.group + 31) / 32 * 32;
  xq.q.assign(xq.M * xq.groups * xq.P, 0);
  xq.scale.resize(xq.M * xq.groups);
  for (i64 row = 0; row < xq.M; ++row)
    for (i64 gr = 0; gr < p.groups; ++gr) {
      const float* xg = p.x + row * p.K + gr * p.group;
      V mv = Vec::zero();
      bool finite = true;
      i64 k = 0;
      for (; k + W <= p.group; k += W) {
        const V v = Vec::load(xg + k);
        finite &= Vec::finite(v);
        mv = Vec::max(mv, Vec::abs(v));
      }
      float mx = Vec::hmax(mv);
      for (; k < p.group; ++k) {
        finite &= std::isfinite(xg[k]);
        mx = std::max(mx, std::fabs(xg[k]));
      }
      float inv = 0.f;
      int16_t* q = xq.q.data() + (row * xq.groups + gr) * xq.P;
      if (!group_scale(mx, finite, &xq.scale[row * xq.groups + gr], &inv)) continue;
      const V iv = Vec::set1(inv);
      k = 0;
      for (; k + W <= p.group; k += W) Vec::store_i16(q + k, Vec::mul(Vec::load(xg + k), iv));
      for (; k < p.group; ++k) q[k] = round_i16(xg[k] * inv);
    }
}

#include "kernels_int8.h"

void matmul(const Problem& p, Parallel& par) {
  switch (p.type) {
    case Weight::kF32: run_float<float>(p, par); break;
    case Weight::kBF16: run_float<uint16_t>(p, par); break;
    case Weight::kI8: {
      QuantizedX xq;
      quantize(p, xq);
      run_int8(p, xq, par);
      break;
    }
  }
}

// ---- exp and log -------------------------------------------------------------

void unary(const float* x, float* out, i64 n, int64_t op, Parallel& par) {
  constexpr i64 kBlock = 1 << 14;
  const i64 blocks = (n + kBlock - 1) / kBlock;
  auto body = [=](i64 b) {
    const i64 i1 = std::min(n, (b + 1) * kBlock);
    for (i64 i = b * kBlock; i < i1; i += W) {
      const i64 left = i1 - i;
      const V v = left >= W ? Vec::load(x + i) : Vec::loadn(x + i, left);
      const V e = op == kExp ? exp_lanes<Vec::L>(v) : log_lanes<Vec::L>(v);
      if (left >= W) Vec::store(out + i, e);
      else Vec::storen(out + i, e, left);
    }
  };
  if (blocks == 1) body(0);
  else par.run(blocks, body);
}

// out[m] = the 16-lane row sum of exp(x[m, k] - shift[m]) (portable.cc):
// bit for bit the n-major product of exp(x - shift) with ones, without
// writing exp(x - shift) out (a log-softmax's total).
void exp_sum(const float* x, const float* shift, float* out, i64 M, i64 K, Parallel& par) {
  const i64 per = std::max<i64>(1, (1 << 16) / std::max<i64>(K, 1));
  const i64 blocks = (M + per - 1) / per;
  auto body = [=](i64 b) {
    for (i64 m = b * per; m < std::min(M, (b + 1) * per); ++m) {
      const float* xm = x + m * K;
      const V sh = Vec::set1(shift[m]);
      V a[kParts];
      for (int q = 0; q < kParts; ++q) a[q] = Vec::zero();
      i64 k = 0;
      for (; k + 16 <= K; k += 16)
        for (int q = 0; q < kParts; ++q) {
          const V e = exp_lanes<Vec::L>(Vec::L::sub(Vec::load(xm + k + q * W), sh));
          a[q] = Vec::fma(e, Vec::set1(1.f), a[q]);
        }
      if (k < K) {  // lanes past K take fma(0, 0, a)
        for (int q = 0; q < kParts; ++q) {
          const i64 left = K - k - q * W;
          if (left >= W) {
            const V e = exp_lanes<Vec::L>(Vec::L::sub(Vec::load(xm + k + q * W), sh));
            a[q] = Vec::fma(e, Vec::set1(1.f), a[q]);
          } else {
            float e[W], one[W];
            for (int l = 0; l < W; ++l) {
              const bool in = l < left;
              e[l] = in ? exp_lanes<Scalar>(xm[k + q * W + l] - shift[m]) : 0.f;
              one[l] = in ? 1.f : 0.f;
            }
            a[q] = Vec::fma(Vec::load(e), Vec::load(one), a[q]);
          }
        }
      }
      out[m] = Vec::tree16(a);
    }
  };
  if (blocks == 1) body(0);
  else par.run(blocks, body);
}

}  // namespace

extern const Table kTable;
const Table kTable = {CW_STR(CW_NS), matmul, unary, exp_sum};

}  // namespace CW_NS
}  // namespace chunkwise

// This build's table: the one symbol its shared object exports (build.py
// hands it to ffi.cc's ChunkwiseRegisterIsa).
extern "C" __attribute__((visibility("default"))) const chunkwise::Table*
ChunkwiseKernelTable() {
  return &chunkwise::CW_NS::kTable;
}
