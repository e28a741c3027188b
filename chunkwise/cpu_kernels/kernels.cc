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
// instruction set), either order:
// - many rows: `packed_block` packs a block's weight columns (bf16
//   widened, the ones column set, zero past the last; an n-major weight's
//   W x W blocks transposed) into panels of NR columns x KC inputs and runs
//   MR x NR register tiles over them, KC inputs at a time (the chains
//   stored into `out` and reloaded between).
// - few rows (decode): `kmajor_stream` reads four weight rows a step
//   straight from the weight, every row's accumulators in L1;
//   `nmajor_stream` reads W table rows x W inputs and transposes them in
//   registers.
// Row sums (`row_sum`: norms, a log-softmax's total) are 16 lane chains
// (16 / W vectors) and the fixed tree.
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
constexpr int kMR = 6, kNV = 4;  // register tile: 6 rows x 64 columns
constexpr int kStreamV = 4;      // decode: 64 columns a sub-block
#elif defined(CW_ISA_AVX2)
constexpr int kMR = 6, kNV = 2;  // 6 x 16
constexpr int kStreamV = 2;      // 16 columns
#else                            // NEON
constexpr int kMR = 6, kNV = 4;  // 6 x 16
constexpr int kStreamV = 4;      // 16 columns
#endif
constexpr int kNR = kNV * W;  // columns per register tile
// Packed products: columns per block (whole tiles), inputs per panel.
constexpr i64 kNB = 64 > kNR ? 64 : kNR;
constexpr i64 kKC = 256;
// Rows at or above which a block packs panels (else streams the weight),
// most rows per block (a band), and multiply-adds below which a call runs
// on the calling thread alone.
constexpr i64 kPackRows = 32;
constexpr i64 kBandRows = 512;
constexpr i64 kInline = 1 << 18;
// Weight rows read ahead (the hardware prefetchers miss short segments of
// rows N apart).
constexpr i64 kAhead = 8;

// ---- float: packing --------------------------------------------------------

// Rows [m0, m1) of batch g's x as they enter the product: x itself, or
// with a shift exp(x - shift) (as `unary` computes it) into `buf` (its
// first `K` inputs, those that enter); row m at the result + (m - m0) * K.
inline const float* x_rows(const Problem& p, i64 g, i64 m0, i64 m1, std::vector<float>& buf,
                           i64 K) {
  if (!p.shift) return p.xrow(g, m0);
  if (buf.size() < static_cast<size_t>((m1 - m0) * p.K)) buf.resize((m1 - m0) * p.K);
  for (i64 m = m0; m < m1; ++m) {
    const float* x = p.xrow(g, m);
    float* e = buf.data() + (m - m0) * p.K;
    const V sh = Vec::set1(p.shift[g * p.M + m]);
    for (i64 k = 0; k < K; k += W) {
      const i64 left = K - k;
      const V v = exp_lanes<Vec::L>(Vec::L::sub(left >= W ? Vec::load(x + k) : Vec::loadn(x + k, left), sh));
      if (left >= W) Vec::store(e + k, v);
      else Vec::storen(e + k, v, left);
    }
  }
  return buf.data();
}

// W weights of k-major row k from column c as f32: bf16 widened, the ones
// column set, zero past the last column.
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

// W consecutive inputs k.. of n-major row n as f32 (n past N, or inputs
// past `left`, zero).
template <class T>
inline V nmajor_weights(const Problem& p, const T* w, i64 n, i64 k, i64 left) {
  if (n >= p.N || left <= 0) return Vec::zero();
  const T* row = w + n * p.K + k;
  return left >= W ? Vec::load(row) : Vec::loadn(row, left);
}

// The panel of columns [c0, c0 + NR) and inputs [k0, k0 + kc) as f32,
// [kc][NR]: a k-major weight's rows copied, an n-major one's W x W blocks
// transposed.
template <class T>
void pack_panel(const Problem& p, const T* w, i64 k0, i64 kc, i64 c0, float* pp) {
  if (!p.nmajor) {
    for (i64 k = 0; k < kc; ++k) {
      if (k0 + k + kAhead < p.K)  // rows N apart: the prefetchers miss them
        for (i64 c = 0; c < kNR && c0 + c < p.N; c += 64 / static_cast<i64>(sizeof(T)))
          prefetch(w + (k0 + k + kAhead) * p.N + c0 + c);
      for (int j = 0; j < kNV; ++j)
        Vec::store(pp + k * kNR + j * W, kmajor_weights(p, w, k0 + k, c0 + j * W));
    }
    return;
  }
  for (int j = 0; j < kNV; ++j)
    for (i64 k = 0; k < kc; k += W) {
      V r[W];
      const i64 n = c0 + j * W;
      if (k + W <= kc && n + W <= p.N) {
        const T* row = w + n * p.K + k0 + k;
        for (int i = 0; i < W; ++i) r[i] = Vec::load(row + i * p.K);
      } else {
        for (int i = 0; i < W; ++i) r[i] = nmajor_weights(p, w, n + i, k0 + k, kc - k);
      }
      Vec::transpose(r);
      for (int i = 0; i < W; ++i)  // (a fixed count keeps r in registers)
        if (k + i < kc) Vec::store(pp + (k + i) * kNR + j * W, r[i]);
    }
}

// ---- float: register tiles over panels --------------------------------------

// MR rows x NV vectors of a panel ([kc][NR]) from the chains in `start`
// (row r at start + r * ls; nullptr: +0), into out (row r at out + r * lo),
// `ncols` of the columns valid.
template <int MR, int NV>
inline void tile(const float* x, i64 lx, const float* pp, i64 kc, const float* start, i64 ls,
                 float* out, i64 lo, i64 ncols) {
  V a[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NV; ++j)
      a[r][j] = start ? Vec::loadn(start + r * ls + j * W, ncols - j * W) : Vec::zero();
  for (i64 k = 0; k < kc; ++k) {
    V wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Vec::load(pp + k * kNR + j * W);
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

// Rows [m0, m1) of one panel: tiles of kMR rows (then 2, 1), NV vectors;
// xs: row m0's x (rows K apart).
template <int NV>
void panel_rows(const Problem& p, i64 g, i64 m0, i64 m1, i64 k0, i64 kc, const float* xs,
                const float* pp, i64 c0, i64 ncols) {
  const i64 cols = p.cols();
  auto at = [&](i64 m, const float** x, const float** start, float** out) {
    *x = xs + (m - m0) * p.K + k0;
    *out = p.orow(g, m) + c0;
    *start = k0 > 0 ? *out : (p.acc ? p.arow(g, m) + c0 : nullptr);
  };
  const float* x;
  const float* start;
  float* out;
  i64 m = m0;
  for (; m + kMR <= m1; m += kMR) {
    at(m, &x, &start, &out);
    tile<kMR, NV>(x, p.K, pp, kc, start, cols, out, cols, ncols);
  }
  for (; m + 2 <= m1; m += 2) {
    at(m, &x, &start, &out);
    tile<2, NV>(x, p.K, pp, kc, start, cols, out, cols, ncols);
  }
  if (m < m1) {
    at(m, &x, &start, &out);
    tile<1, NV>(x, p.K, pp, kc, start, cols, out, cols, ncols);
  }
}

// Rows [m0, m1) x columns [n0, n1) (n1 - n0 <= kNB) of batch g, a panel of
// KC inputs at a time (the chains stored into `out` between).
template <class T>
void packed_block(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  const T* w = p.weight<T>(g);
  const i64 tiles = (n1 - n0 + kNR - 1) / kNR;
  thread_local LineBuffer<float> panels;
  thread_local std::vector<float> ebuf;
  float* panel = panels.get(tiles * kKC * kNR);
  const i64 K = p.k_end(g);
  const float* xs = x_rows(p, g, m0, m1, ebuf, K);
  for (i64 k0 = 0; k0 < K; k0 += kKC) {
    const i64 kc = std::min(kKC, K - k0);
    for (i64 t = 0; t < tiles; ++t)
      pack_panel<T>(p, w, k0, kc, n0 + t * kNR, panel + t * kKC * kNR);
    for (i64 t = 0; t < tiles; ++t) {
      const float* pp = panel + t * kKC * kNR;
      const i64 c0 = n0 + t * kNR, ncols = std::min<i64>(kNR, n1 - c0);
      switch ((ncols + W - 1) / W) {  // a narrower last tile
#define CW_CASE(v) \
  case v: if constexpr (v <= kNV) panel_rows<v>(p, g, m0, m1, k0, kc, xs, pp, c0, ncols); break;
        CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4)
#undef CW_CASE
        default: break;
      }
    }
  }
}

// ---- float: few rows (decode), the weight read once --------------------------

// Accumulators of rows [m0, m1) x columns [n0, n1) in L1 (`stride` floats
// a row, from acc or +0), and written out at the end.
struct Rows {
  float* A;
  i64 stride;
};

inline Rows rows_begin(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1, i64 unit) {
  const i64 stride = (n1 - n0 + unit - 1) / unit * unit;
  thread_local LineBuffer<float> lines;
  float* buf = lines.get((m1 - m0) * stride);
  for (i64 m = 0; m < m1 - m0; ++m) {
    const float* acc = p.arow(g, m0 + m);
    for (i64 c = 0; c < stride; c += W)
      Vec::store(buf + m * stride + c, acc ? Vec::loadn(acc + n0 + c, n1 - n0 - c) : Vec::zero());
  }
  return {buf, stride};
}

inline void rows_end(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1, Rows a) {
  for (i64 m = 0; m < m1 - m0; ++m) {
    float* out = p.orow(g, m0 + m);
    for (i64 c = 0; c < n1 - n0; c += W) {
      const i64 n = n1 - n0 - c;
      if (n >= W) Vec::store(out + n0 + c, Vec::load(a.A + m * a.stride + c));
      else Vec::storen(out + n0 + c, Vec::load(a.A + m * a.stride + c), n);
    }
  }
}

// k-major: rows [m0, m1) x columns [n0, n1), in sub-blocks of S =
// kStreamV * W columns, four weight rows a step: each weight vector is
// loaded once for every row and a step reads (n1 - n0) contiguous columns
// of four rows.
template <class T>
void kmajor_stream(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  constexpr i64 kSub = kStreamV * W;
  const T* w = p.weight<T>(g);
  const i64 rows = m1 - m0;
  const i64 subs = (n1 - n0 + kSub - 1) / kSub;
  thread_local std::vector<float> ebuf;
  const i64 K = p.k_end(g);
  const float* xs = x_rows(p, g, m0, m1, ebuf, K);
  const Rows acc = rows_begin(p, g, m0, m1, n0, n1, kSub);
  float* A = acc.A;
  const i64 stride = acc.stride;
  i64 k = 0;
  for (; k + 4 <= K; k += 4)
    for (i64 sb = 0; sb < subs; ++sb) {
      const i64 c0 = n0 + sb * kSub;
      if (k + kAhead + 4 <= K)  // every line of the sub-block's rows
        for (int i = 0; i < 4; ++i)
          for (i64 c = c0; c < std::min(c0 + kSub, n1); c += 64 / static_cast<i64>(sizeof(T)))
            prefetch(w + (k + kAhead + i) * p.N + c);
      V wv[4][kStreamV];
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < kStreamV; ++j) wv[i][j] = kmajor_weights(p, w, k + i, c0 + j * W);
      for (i64 m = 0; m < rows; ++m) {
        const float* xm = xs + m * p.K + k;
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
  for (; k < K; ++k)
    for (i64 c = 0; c < stride; c += W) {
      const V wv = kmajor_weights(p, w, k, n0 + c);
      for (i64 m = 0; m < rows; ++m) {
        const V xb = Vec::set1(xs[m * p.K + k]);
        float* a = A + m * stride + c;
        Vec::store(a, Vec::fma(xb, wv, Vec::load(a)));
      }
    }
  rows_end(p, g, m0, m1, n0, n1, acc);
}

// n-major: rows [m0, m1) x table rows [n0, n1): W table rows x W inputs
// read and transposed in registers, then each input's column multiplied
// into every row's chains, input after input. kGroups groups of W table
// rows take turns at each block of inputs, so as many chains per row are
// independent (one group's chain of W FMAs would wait on itself).
template <class T>
void nmajor_stream(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  constexpr int kGroups = 4;
  const T* w = p.weight<T>(g);
  const i64 rows = m1 - m0, K = p.K;
  thread_local std::vector<float> ebuf;
  const float* xs = x_rows(p, g, m0, m1, ebuf, K);
  const Rows acc = rows_begin(p, g, m0, m1, n0, n1, W);
  for (i64 c0 = 0; c0 < n1 - n0; c0 += kGroups * W) {
    const i64 groups = std::min<i64>(kGroups, (n1 - n0 - c0 + W - 1) / W);
    for (i64 k = 0; k < K; k += W) {
      const bool whole = k + W <= K;
      if ((k * static_cast<i64>(sizeof(T))) % 64 == 0)  // these rows' lines 4 ahead
        for (i64 i = 0; i < groups * W && n0 + c0 + i < p.N; ++i)
          prefetch(w + (n0 + c0 + i) * K + k + 256 / static_cast<i64>(sizeof(T)));
      for (i64 q = 0; q < groups; ++q) {
        const i64 c = c0 + q * W;
        V r[W];
        if (whole && n0 + c + W <= p.N) {
          const T* row = w + (n0 + c) * K + k;
          for (int i = 0; i < W; ++i) r[i] = Vec::load(row + i * K);
        } else {
          for (int i = 0; i < W; ++i) r[i] = nmajor_weights(p, w, n0 + c + i, k, K - k);
        }
        Vec::transpose(r);
        for (i64 m = 0; m < rows; ++m) {
          const float* xm = xs + m * K + k;
          float* a = acc.A + m * acc.stride + c;
          V v = Vec::load(a);
          if (whole) {  // (a fixed count keeps r in registers)
            for (int i = 0; i < W; ++i) v = Vec::fma(Vec::set1(xm[i]), r[i], v);
          } else {
            for (int i = 0; i < W; ++i)
              if (k + i < K) v = Vec::fma(Vec::set1(xm[i]), r[i], v);
          }
          Vec::store(a, v);
        }
      }
    }
  }
  rows_end(p, g, m0, m1, n0, n1, acc);
}

// Outputs [m0, m1) x [n0, n1) of batch g that no input enters: their
// chains' starts (acc, or +0).
inline void starts(const Problem& p, i64 g, i64 m0, i64 m1, i64 n0, i64 n1) {
  for (i64 m = m0; m < m1; ++m) {
    const float* acc = p.arow(g, m);
    float* out = p.orow(g, m);
    for (i64 n = n0; n < n1; ++n) out[n] = acc ? acc[n] : 0.f;
  }
}

template <class T>
void run_float(const Problem& p, Parallel& par) {
  const i64 width = p.cols();
  const bool stream = p.M < kPackRows;
  const i64 threads = std::max(1, par.threads());
  // Few rows: blocks of whole lines (k-major: four weight rows a step; n-
  // major: table rows), two per thread, in multiples of 64 columns.
  const i64 wide = std::max<i64>(64, (width + 2 * threads - 1) / (2 * threads) + 63) / 64 * 64;
  // (a product up to 80 columns wide, attention's values and the ones
  // column, is one block: x, or its exp, read once per band)
  const i64 nblock = stream ? std::min<i64>(wide, 512) : width <= 80 ? width : kNB;
  const i64 nblocks = (width + nblock - 1) / nblock;
  // Bands: as few as leave each thread about 8 blocks (each band packs
  // the weight again), of at most kBandRows rows, whole tiles.
  i64 band = p.M;
  if (!stream) {
    const i64 want = (8 * threads + p.G * nblocks - 1) / (p.G * nblocks);
    band = std::min(kBandRows, (p.M + want - 1) / want);
    band = std::max<i64>(kMR, (band + kMR - 1) / kMR * kMR);
  }
  const i64 bands = (p.M + band - 1) / band;
  const i64 total = p.G * bands * nblocks;
  auto body = [&](i64 b) {
    const i64 g = b / (bands * nblocks);
    const i64 m0 = b / nblocks % bands * band, m1 = std::min(p.M, m0 + band);
    const i64 n0 = b % nblocks * nblock, n1 = std::min(width, n0 + nblock);
    // A cache's row past its valid keys (common.h): n-major columns there
    // are their starts; a k-major block with no input is its starts.
    const i64 n_end = std::min(n1, p.n_end(g));
    if (n_end < n1) starts(p, g, m0, m1, std::max(n0, n_end), n1);
    if (n_end <= n0 || p.k_end(g) == 0) {
      if (n0 < n_end) starts(p, g, m0, m1, n0, n_end);
      return;
    }
    if (!stream) packed_block<T>(p, g, m0, m1, n0, n_end);
    else if (p.nmajor) nmajor_stream<T>(p, g, m0, m1, n0, n_end);
    else kmajor_stream<T>(p, g, m0, m1, n0, n_end);
  };
  // Small products (a decode step's attention: a few rows against a short
  // cache) run on the calling thread: waking a pool thread cost more.
  if (p.G * p.M * p.K * width < kInline) {
    for (i64 b = 0; b < total; ++b) body(b);
    return;
  }
  par.run(total, body);
}

// ---- row sums: 16 lanes and the fixed tree -----------------------------------

// out[m] = the 16-lane row sum (portable.cc) of x[m, :] or, with `shift`,
// of exp(x[m, :] - shift[m]) (a log-softmax's total, without writing
// exp(x - shift) out).
void row_sum(const float* x, const float* shift, float* out, i64 M, i64 K, Parallel& par) {
  const i64 per = std::max<i64>(1, (1 << 16) / std::max<i64>(K, 1));
  const i64 blocks = (M + per - 1) / per;
  auto value = [shift](const float* p, i64 left, V sh) {
    const V v = left >= W ? Vec::load(p) : Vec::loadn(p, left);
    return shift ? exp_lanes<Vec::L>(Vec::L::sub(v, sh)) : v;
  };
  auto body = [=](i64 b) {
    for (i64 m = b * per; m < std::min(M, (b + 1) * per); ++m) {
      const float* xm = x + m * K;
      const V sh = Vec::set1(shift ? shift[m] : 0.f);
      V a[kParts];
      for (int q = 0; q < kParts; ++q) a[q] = Vec::zero();
      const V one = Vec::set1(1.f);
      i64 k = 0;
      for (; k + 16 <= K; k += 16)
        for (int q = 0; q < kParts; ++q) a[q] = Vec::fma(value(xm + k + q * W, W, sh), one, a[q]);
      if (k < K)  // lanes past K take fma(0, 0, a)
        for (int q = 0; q < kParts; ++q) {
          const i64 left = K - k - q * W;
          if (left <= 0) {
            a[q] = Vec::fma(Vec::zero(), Vec::zero(), a[q]);
          } else if (left >= W) {
            a[q] = Vec::fma(value(xm + k + q * W, W, sh), one, a[q]);
          } else {
            float e[W], ones[W];
            Vec::store(e, value(xm + k + q * W, left, sh));
            for (int l = 0; l < W; ++l) {
              e[l] = l < left ? e[l] : 0.f;
              ones[l] = l < left ? 1.f : 0.f;
            }
            a[q] = Vec::fma(Vec::load(e), Vec::load(ones), a[q]);
          }
        }
      out[m] = Vec::tree16(a);
    }
  };
  if (blocks == 1) body(0);
  else par.run(blocks, body);
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
  if (p.o == nullptr && p.o16 == nullptr) return;
  xq.qsum.assign(xq.M * xq.groups, 0);
  for (i64 row = 0; row < xq.M; ++row)
    for (i64 gr = 0; gr < p.groups; ++gr) {
      const int16_t* q = xq.at(row, gr);
      int32_t sum = 0;
      for (i64 k = 0; k < p.group; ++k) sum += q[k];
      xq.qsum[row * xq.groups + gr] = sum;
    }
}

// IEEE halves to f32 (exact; int8 and u4 weights' f16 scales).
void half_to_float(const uint16_t* in, float* out, i64 n) {
  i64 i = 0;
#if defined(CW_ISA_AVX512) || defined(CW_ISA_AVX2)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#elif defined(CW_ISA_NEON)
  for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(in + i))));
#endif
  for (; i < n; ++i) out[i] = half_bits_to_float(in[i]);
}

#include "kernels_int8.h"
#include "kernels_q8.h"
#include "kernels_attend.h"

void matmul(const Problem& p, Parallel& par) {
  switch (p.type) {
    case Weight::kF32: run_float<float>(p, par); break;
    case Weight::kBF16: run_float<uint16_t>(p, par); break;
    case Weight::kI8:
    case Weight::kU4: {
      if (p.act8) {
        QuantizedX8 xq;
        quantize8(p, xq);
        run_act8(p, xq, par);
        break;
      }
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

}  // namespace

extern const Table kTable;
const Table kTable = {CW_STR(CW_NS), matmul, unary, row_sum, attend, half_to_float};

}  // namespace CW_NS
}  // namespace chunkwise

// This build's table: the one symbol its shared object exports (build.py
// hands it to ffi.cc's ChunkwiseRegisterIsa).
extern "C" __attribute__((visibility("default"))) const chunkwise::Table*
ChunkwiseKernelTable() {
  return &chunkwise::CW_NS::kTable;
}
