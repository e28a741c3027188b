// Attention in one call (common.h's Attend), included by kernels.cc inside
// its per-instruction-set namespace: portable.cc's operations, with
// - a tile of kRows query rows at a time, W rows a vector: the logits of
//   kKeys keys at once, each a vector of rows (FMA chains over D, a row's
//   lane doing exactly its scalar chain), kept [key][row] in a buffer
//   sized by the keys (so a row's weights are one vector per key: the
//   max, exp and the weights' sum run down the rows' lanes);
// - key blocks of kKeyBlock keys that no row of the tile sees skipped: a
//   masked logit is -1e30 (only its part in the max is kept), its weight
//   exp(-1e30 - top) exactly 0, and fma(0, v, a) = a for every finite v;
// - the values' chains in register tiles of up to 6 rows x kNV vectors
//   over the keys in order, a key block at a time (the chains stored into
//   `out` and reloaded between).

constexpr int kRV = 3;                     // row vectors a tile
constexpr i64 kRows = kRV * W;             // query rows a tile
constexpr int kKeys = W == 8 ? 4 : 8;      // keys a logits step (kRV * kKeys chains)
constexpr i64 kKeyBlock = 64;              // keys whose mask is read together
constexpr int kValueNV = kNV;              // value vectors a register tile (as a product's)
static_assert(kValueNV <= 4, "value_rows has cases up to 4 vectors");

// Logits of keys k[0..NK) (rows of D) for the tile (qt: [D][kRows]) into
// lt[key][kRows].
template <int NK>
inline void logit_step(const float* qt, const float* k, i64 D, float* lt) {
  V acc[kRV][NK];
  for (int i = 0; i < kRV; ++i)
    for (int j = 0; j < NK; ++j) acc[i][j] = Vec::zero();
  for (i64 d = 0; d < D; ++d) {
    V qv[kRV];
    for (int i = 0; i < kRV; ++i) qv[i] = Vec::load(qt + d * kRows + i * W);
    for (int j = 0; j < NK; ++j) {
      const V kb = Vec::set1(k[j * D + d]);
      for (int i = 0; i < kRV; ++i) acc[i][j] = Vec::fma(qv[i], kb, acc[i][j]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int i = 0; i < kRV; ++i) Vec::store(lt + j * kRows + i * W, acc[i][j]);
}

// MR rows x NV vectors of values' chains (out rows `lo` apart, from +0 if
// `fresh`, else from out) over keys [0, n) of v (rows of D, from column
// c0), weighted by et[key][kRows] at the rows' lanes `j0`...; `Full`: NV
// whole vectors of columns (else the last one partial).
template <int MR, int NV, bool Full>
inline void value_tile(const float* et, i64 j0, const float* v, i64 n, i64 D, i64 c0, bool fresh,
                       float* out, i64 lo) {
  const i64 last = std::min<i64>(W, D - c0 - (NV - 1) * W);  // the last vector's columns
  V a[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) {
      const float* o = out + r * lo + c0 + c * W;
      a[r][c] = fresh ? Vec::zero() : (Full || c < NV - 1) ? Vec::load(o) : Vec::loadn(o, last);
    }
  for (i64 s = 0; s < n; ++s) {
    V vv[NV];
    const float* row = v + s * D + c0;
    for (int c = 0; c < NV; ++c)
      vv[c] = (Full || c < NV - 1) ? Vec::load(row + c * W) : Vec::loadn(row + c * W, last);
    for (int r = 0; r < MR; ++r) {
      const V e = Vec::set1(et[s * kRows + j0 + r]);
      for (int c = 0; c < NV; ++c) a[r][c] = Vec::fma(e, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NV; ++c) {
      float* o = out + r * lo + c0 + c * W;
      if (Full || c < NV - 1) Vec::store(o, a[r][c]);
      else Vec::storen(o, a[r][c], last);
    }
}

template <int MR>
inline void value_rows(const float* et, i64 j0, const float* v, i64 n, i64 D, bool fresh,
                       float* out, i64 lo) {
  for (i64 c0 = 0; c0 < D; c0 += kValueNV * W) {
    const i64 cols = std::min<i64>(kValueNV * W, D - c0);
    const bool full = cols % W == 0;
    switch ((cols + W - 1) / W) {
#define CW_CASE(nv)                                                              \
  case nv:                                                                       \
    if constexpr (nv <= kValueNV) {                                              \
      if (full) value_tile<MR, nv, true>(et, j0, v, n, D, c0, fresh, out, lo);  \
      else value_tile<MR, nv, false>(et, j0, v, n, D, c0, fresh, out, lo);      \
    }                                                                            \
    break;
      CW_CASE(1) CW_CASE(2) CW_CASE(3) CW_CASE(4)
#undef CW_CASE
      default: break;
    }
  }
}

// One tile: batch row bq, head h, rows [r0, r0 + n).
void attend_tile(const Attend& a, i64 bq, i64 h, i64 r0, i64 n) {
  const i64 D = a.D, total = a.keys();
  const i64 blocks_total = (total + kKeyBlock - 1) / kKeyBlock + a.pieces;
  thread_local LineBuffer<float> qts, lts, kbuf;
  thread_local std::vector<uint8_t> live;
  float* qt = qts.get(D * kRows);
  float* lt = lts.get(total * kRows);
  std::fill(qt, qt + D * kRows, 0.f);
  live.assign(blocks_total, 0);
  const float* q = a.q + ((bq * a.kv + h) * a.rows() + r0) * D;
  for (i64 j = 0; j < n; ++j)
    for (i64 d = 0; d < D; ++d) qt[d * kRows + j] = q[j * D + d];
  const i64 t0 = r0 / a.group, t1 = (r0 + n - 1) / a.group;  // the tile's tokens

  // Every key block in order: fn(piece, its block number, the piece's
  // first key among all, s0, nk).
  auto blocks = [&](auto&& fn) {
    i64 at = 0, blk = 0;
    for (i64 p = 0; p < a.pieces; ++p) {
      const AttendPiece& pc = a.piece[p];
      for (i64 s0 = 0; s0 < pc.S; s0 += kKeyBlock, ++blk)
        fn(pc, blk, at, s0, std::min(kKeyBlock, pc.S - s0));
      at += pc.S;
    }
  };
  auto live_keys = [&](auto&& fn) {  // fn(piece, at, s0, nk) of the live blocks
    blocks([&](const AttendPiece& pc, i64 blk, i64 at, i64 s0, i64 nk) {
      if (live[blk]) fn(pc, at, s0, nk);
    });
  };

  // Logits (masked -1e30) of the key blocks some row sees, and top = their
  // max over every key (a masked one's -1e30 included).
  bool any_masked = false;
  V top[kRV], sum[kRV];
  for (int i = 0; i < kRV; ++i) {
    top[i] = Vec::set1(-INFINITY);
    sum[i] = Vec::zero();
  }
  blocks([&](const AttendPiece& pc, i64 blk, i64 at, i64 s0, i64 nk) {
    bool some = false, all = true;
    for (i64 t = t0; t <= t1; ++t) {
      const auto seen = pc.seen(a.B, bq, t);
      if (seen.step == 0) {
        some |= seen.at(0);
        all &= seen.at(0);
      } else {  // bool bytes: 0 or 1
        const uint8_t* m = seen.m + s0;
        some |= std::memchr(m, 1, nk) != nullptr;
        all &= std::memchr(m, 0, nk) == nullptr;
      }
    }
    any_masked |= !all;
    if (!some) return;
    live[blk] = 1;
    const float* k = pc.rows_f32(pc.k, pc.row(a.B, bq, h, s0), nk, D, kbuf.get(nk * D));
    float* lb = lt + (at + s0) * kRows;
    i64 s = 0;
    for (; s + kKeys <= nk; s += kKeys) logit_step<kKeys>(qt, k + s * D, D, lb + s * kRows);
    for (; s < nk; ++s) logit_step<1>(qt, k + s * D, D, lb + s * kRows);
    if (!all)
      for (i64 j = 0; j < n; ++j) {
        const auto seen = pc.seen(a.B, bq, (r0 + j) / a.group);
        for (i64 s = 0; s < nk; ++s)
          if (!seen.at(s0 + s)) lb[s * kRows + j] = kMasked;
      }
    for (i64 s = 0; s < nk; ++s)
      for (int i = 0; i < kRV; ++i) top[i] = Vec::max(top[i], Vec::load(lb + s * kRows + i * W));
  });
  if (any_masked)
    for (int i = 0; i < kRV; ++i) top[i] = Vec::max(top[i], Vec::set1(kMasked));

  // The weights exp(logit - top) in place, and their sum down the keys.
  live_keys([&](const AttendPiece&, i64 at, i64 s0, i64 nk) {
    float* lb = lt + (at + s0) * kRows;
    for (i64 s = 0; s < nk; ++s)
      for (int i = 0; i < kRV; ++i) {
        const V x = Vec::L::sub(Vec::load(lb + s * kRows + i * W), top[i]);
        const V e = Vec::within(x, kExpLow, 0.f) ? exp_lanes_nonpositive<Vec::L>(x)
                                                  : exp_lanes<Vec::L>(x);
        Vec::store(lb + s * kRows + i * W, e);
        sum[i] = Vec::add(sum[i], e);  // fma(e, 1, sum)
      }
  });

  // The values' chains, a key block at a time (its values in L1 for every
  // register tile of rows).
  float* out = a.out + ((bq * a.kv + h) * a.rows() + r0) * (D + 1);
  const i64 lo = D + 1;
  bool fresh = true;
  live_keys([&](const AttendPiece& pc, i64 at, i64 s0, i64 nk) {
    const float* v = pc.rows_f32(pc.v, pc.row(a.B, bq, h, s0), nk, D, kbuf.get(nk * D));
    const float* et = lt + (at + s0) * kRows;
    i64 j = 0;
    for (; j + 6 <= n; j += 6) value_rows<6>(et, j, v, nk, D, fresh, out + j * lo, lo);
    for (; j + 2 <= n; j += 2) value_rows<2>(et, j, v, nk, D, fresh, out + j * lo, lo);
    if (j < n) value_rows<1>(et, j, v, nk, D, fresh, out + j * lo, lo);
    fresh = false;
  });
  if (fresh)  // no key seen by any row (not reached: every row sees itself)
    for (i64 j = 0; j < n; ++j) std::fill(out + j * lo, out + j * lo + D, 0.f);
  float sums[kRows];
  for (int i = 0; i < kRV; ++i) Vec::store(sums + i * W, sum[i]);
  for (i64 j = 0; j < n; ++j) out[j * lo + D] = sums[j];
}

void attend(const Attend& a, Parallel& par) {
  const i64 tiles = (a.rows() + kRows - 1) / kRows;
  const i64 total = a.B * a.kv * tiles;
  auto body = [&](i64 b) {
    const i64 bq = b / (a.kv * tiles), h = b / tiles % a.kv, r0 = b % tiles * kRows;
    attend_tile(a, bq, h, r0, std::min(kRows, a.rows() - r0));
  };
  if (total == 1 || a.B * a.kv * a.rows() * a.keys() * a.D < kInline) {
    for (i64 b = 0; b < total; ++b) body(b);
    return;
  }
  par.run(total, body);
}
