// The definition of every invariant kernel's result, as plain loops: the
// vector paths (kernels.cc, one build per instruction set) compute the
// same operations in the same order, and the tests compare them with
// these bit for bit. This is also the path a CPU without one of those
// instruction sets runs.
//
// A float weight element enters as f32 (bf16 widened). Each output of a
// float weight, k-major (w[k, n]) or n-major (w[n, k]) alike, is the chain
//   a <- fma(x[k], w(k, n), a) over k = 0 .. K-1 in order,
// from a = acc (or +0); with `shift`, x[k] is exp(x[k] - shift) first (as
// `unary` computes it). With `ones`, column N has weight 1 everywhere (the
// chained sum of the row's x). An int8 weight's (either order): x rounded
// to int16 per row and weight group, int32 sums per chunk, one f32 chain
// over the chunks, then over the groups' offsets where there are (common.h);
// with act8, x rounded to int8 per block of 32 inputs instead, int32 sums
// per block, one f32 chain over the blocks (`int8_row_act8`); a u4
// weight's codes enter as int8 ones. A row sum (norms, a log-softmax's total) is
// 16 lanes: lane l chains v = x[k] (or exp(x[k] - shift)) for k = 16 j + l
// as a <- fma(v, 1, a) from +0 (past K, a lane takes fma(0, 0, a)), then
// the lanes are added as the fixed tree of common.h's tree16. exp and log
// are common.h's exp_lanes / log_lanes of `Scalar`. An attention cache
// read with `valid` (common.h's Problem) has shorter chains: over its
// row's valid keys only.

#include "common.h"

namespace chunkwise {
namespace portable {
namespace {

template <class W>
float weight(const Problem& p, const W* w, i64 k, i64 n) {
  if (n == p.N) return 1.f;  // the ones column
  return as_float(p.nmajor ? w[n * p.K + k] : w[k * p.N + n]);
}

template <class W>
void float_row(const Problem& p, i64 g, i64 m) {
  const W* w = p.weight<W>(g);
  std::vector<float> x(p.xrow(g, m), p.xrow(g, m) + p.K);
  if (p.shift)
    for (float& v : x) v = exp_lanes<Scalar>(v - p.shift[g * p.M + m]);
  const float* acc = p.arow(g, m);
  float* out = p.orow(g, m);
  const i64 K = p.k_end(g), N = p.n_end(g);
  for (i64 n = 0; n < p.cols(); ++n) {
    float a = acc ? acc[n] : 0.f;
    if (n < N)
      for (i64 k = 0; k < K; ++k) a = std::fma(x[k], weight(p, w, k, n), a);
    out[n] = a;
  }
}

// Row m of batch g rounded to int16 (common.h): q [groups, P], sx [groups].
void quantize_row(const Problem& p, i64 g, i64 m, int16_t* q, float* sx, i64 P) {
  const float* x = p.xrow(g, m);
  for (i64 gr = 0; gr < p.groups; ++gr) {
    const float* xg = x + gr * p.group;
    float mx = 0.f;
    bool finite = true;
    for (i64 k = 0; k < p.group; ++k) {
      finite &= std::isfinite(xg[k]);
      mx = std::max(mx, std::fabs(xg[k]));
    }
    float inv = 0.f;
    int16_t* qg = q + gr * P;
    std::fill(qg, qg + P, int16_t{0});
    if (group_scale(mx, finite, &sx[gr], &inv))
      for (i64 k = 0; k < p.group; ++k) qg[k] = round_i16(xg[k] * inv);
  }
}

void int8_row(const Problem& p, i64 g, i64 m) {
  const int8_t* w = p.weight<int8_t>(g);
  const uint8_t* w4 = static_cast<const uint8_t*>(p.w);  // u4: w_shared
  const float* s = p.scale(g);
  const i64 P = (p.group + 31) / 32 * 32;
  std::vector<int16_t> q(p.groups * P);
  std::vector<float> sx(p.groups);
  quantize_row(p, g, m, q.data(), sx.data(), P);
  const float* acc = p.arow(g, m);
  float* out = p.orow(g, m);
  for (i64 n = 0; n < p.N; ++n) {
    float a = acc ? acc[n] : 0.f;
    for (i64 gr = 0; gr < p.groups; ++gr) {
      const float sw = p.nmajor ? s[n * p.groups + gr] : s[gr * p.N + n];
      const float f = sw * sx[gr];
      for (i64 c0 = 0; c0 < p.group; c0 += kChunk) {
        int32_t isum = 0;
        for (i64 t = c0; t < std::min(p.group, c0 + kChunk); ++t) {
          const i64 k = gr * p.group + t;
          const int8_t wv = p.u4() ? u4_code(p, w4, k, n) : p.nmajor ? w[n * p.K + k] : w[k * p.N + n];
          isum += static_cast<int32_t>(q[gr * P + t]) * wv;
        }
        a = std::fma(static_cast<float>(isum), f, a);
      }
    }
    out[n] = a;
  }
  if (p.o != nullptr) {
    std::vector<int32_t> qsum(p.groups, 0);
    for (i64 gr = 0; gr < p.groups; ++gr)
      for (i64 t = 0; t < p.group; ++t) qsum[gr] += q[gr * P + t];
    add_offsets(p, qsum.data(), sx.data(), p.groups, g, m, 0, p.N);
  }
}

// The act8 form (common.h): x rounded to int8 per block of A inputs.
void int8_row_act8(const Problem& p, i64 g, i64 m) {
  const int8_t* w = p.weight<int8_t>(g);
  const uint8_t* w4 = static_cast<const uint8_t*>(p.w);  // u4: w_shared
  const float* s = p.scale(g);
  const i64 A = p.act_block(), blocks = p.act_blocks();
  std::vector<int8_t> q(blocks * A);
  std::vector<float> sx(blocks);
  std::vector<int32_t> qsum(blocks);
  for (i64 b = 0; b < blocks; ++b)
    quantize_block8(p.xrow(g, m) + b * A, A, A, q.data() + b * A, &sx[b], &qsum[b],
                    [](i64 t) { return t; });
  const float* acc = p.arow(g, m);
  float* out = p.orow(g, m);
  for (i64 n = 0; n < p.N; ++n) {
    float a = acc ? acc[n] : 0.f;
    for (i64 b = 0; b < blocks; ++b) {
      const i64 gr = b * A / p.group;
      const float sw = p.nmajor ? s[n * p.groups + gr] : s[gr * p.N + n];
      int32_t isum = 0;
      for (i64 t = 0; t < A; ++t) {
        const i64 k = b * A + t;
        const int8_t wv = p.u4() ? u4_code(p, w4, k, n) : p.nmajor ? w[n * p.K + k] : w[k * p.N + n];
        isum += static_cast<int32_t>(q[k]) * wv;
      }
      a = std::fma(static_cast<float>(isum), sw * sx[b], a);
    }
    out[n] = a;
  }
  if (p.o != nullptr) add_offsets(p, qsum.data(), sx.data(), blocks, g, m, 0, p.N);
}

void half_to_float(const uint16_t* in, float* out, i64 n) {
  for (i64 i = 0; i < n; ++i) out[i] = half_bits_to_float(in[i]);
}

void matmul(const Problem& given, Parallel& par) {
  Problem p = given;  // f16 scales and offsets widened whole
  std::vector<float> scales, offsets;
  if (given.s16 != nullptr) {
    scales.resize(p.groups * p.N);
    half_to_float(given.s16, scales.data(), static_cast<i64>(scales.size()));
    p.s = scales.data();
    if (given.o16 != nullptr) {
      offsets.resize(scales.size());
      half_to_float(given.o16, offsets.data(), static_cast<i64>(offsets.size()));
      p.o = offsets.data();
    }
    p.s16 = p.o16 = nullptr;
  }
  par.run(p.G * p.M, [&](i64 b) {
    const i64 g = b / p.M, m = b % p.M;
    switch (p.type) {
      case Weight::kI8:
      case Weight::kU4:
        if (p.act8) int8_row_act8(p, g, m);
        else int8_row(p, g, m);
        break;
      case Weight::kBF16: float_row<uint16_t>(p, g, m); break;
      case Weight::kF32: float_row<float>(p, g, m); break;
    }
  });
}

void unary(const float* x, float* out, i64 n, int64_t op, Parallel& par) {
  constexpr i64 kBlock = 1 << 14;
  par.run((n + kBlock - 1) / kBlock, [=](i64 b) {
    for (i64 i = b * kBlock; i < std::min(n, (b + 1) * kBlock); ++i)
      out[i] = op == kExp ? exp_lanes<Scalar>(x[i]) : log_lanes<Scalar>(x[i]);
  });
}

void row_sum(const float* x, const float* shift, float* out, i64 M, i64 K, Parallel& par) {
  par.run(M, [=](i64 m) {
    const float* xm = x + m * K;
    float a[16] = {};
    for (i64 k = 0; k < K; k += 16)
      for (int l = 0; l < 16; ++l) {
        const bool in = k + l < K;
        float v = 0.f;
        if (in) v = shift ? exp_lanes<Scalar>(xm[k + l] - shift[m]) : xm[k + l];
        a[l] = std::fma(v, in ? 1.f : 0.f, a[l]);
      }
    out[m] = tree16(a);
  });
}

void attend(const Attend& a, Parallel& par) {
  const i64 R = a.rows(), D = a.D;
  par.run(a.B * a.kv * R, [&](i64 i) {
    const i64 bq = i / (a.kv * R), h = i / R % a.kv, t = i % R / a.group;
    const float* q = a.q + i * D;
    std::vector<float> logit, buf(D);
    for (i64 p = 0; p < a.pieces; ++p) {
      const AttendPiece& pc = a.piece[p];
      const auto seen = pc.seen(a.B, bq, t);
      for (i64 s = 0; s < pc.S; ++s) {
        const float* k = pc.rows_f32(pc.k, pc.row(a.B, bq, h, s), 1, D, buf.data());
        float l = 0.f;
        for (i64 d = 0; d < D; ++d) l = std::fma(q[d], k[d], l);
        logit.push_back(seen.at(s) ? l : kMasked);
      }
    }
    float top = -INFINITY;
    for (float l : logit) top = l > top ? l : top;
    float* out = a.out + i * (D + 1);
    std::fill(out, out + D + 1, 0.f);
    i64 j = 0;
    for (i64 p = 0; p < a.pieces; ++p) {
      const AttendPiece& pc = a.piece[p];
      for (i64 s = 0; s < pc.S; ++s) {
        const float e = exp_lanes<Scalar>(logit[j++] - top);
        const float* v = pc.rows_f32(pc.v, pc.row(a.B, bq, h, s), 1, D, buf.data());
        for (i64 d = 0; d < D; ++d) out[d] = std::fma(e, v[d], out[d]);
        out[D] = std::fma(e, 1.f, out[D]);
      }
    }
  });
}

constexpr Table kTable = {"portable", matmul, unary, row_sum, attend, half_to_float};

}  // namespace

const Table* table() { return &kTable; }

}  // namespace portable
}  // namespace chunkwise
