// The CPU kernels without XLA: one instruction set's build of kernels.cc
// (its table, ChunkwiseKernelTable) against portable.cc's definition, bit
// for bit, on seeded random problems. tests/test_kernels_arm.py builds it
// for AArch64 (NEON) with a cross compiler and runs it under qemu-user;
// it runs natively the same way for an x86 path.
//
//   selftest [cases]     prints one line per failure, exits 1 if any

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common.h"

namespace chunkwise {
namespace portable {
const Table* table();
}
}  // namespace chunkwise
extern "C" const chunkwise::Table* ChunkwiseKernelTable();

namespace {

using chunkwise::i64;
using chunkwise::Problem;
using chunkwise::Table;
using chunkwise::Weight;

// Blocks claimed from a shared counter by two threads (as XLA's pool).
class Threads : public chunkwise::Parallel {
 public:
  int threads() const override { return 2; }
  void run(i64 total, const std::function<void(i64)>& body) override {
    std::atomic<i64> next{0};
    auto work = [&] {
      for (i64 b; (b = next.fetch_add(1)) < total;) body(b);
    };
    std::thread helper(work);
    work();
    helper.join();
  }
};

struct Case {
  i64 G, M, K, N, groups;
  Weight type;
  bool nmajor, acc, ones, shift = false;
  bool offset = false, half = false;  // int8 / u4: offsets, f16 scales
  bool act8 = false;                  // int8 / u4: 8-bit activations
};

// Whether the vector paths take act8 case c (ffi.cc sends the others to
// the portable loops).
bool act8_vectored(const Case& c) {
  const i64 group = c.K / c.groups, A = group % 32 == 0 ? 32 : group;
  return A % 4 == 0 && !(c.type == Weight::kU4 && c.nmajor && A != 32);
}

std::mt19937 rng(0);

float normal() { return std::normal_distribution<float>(0.f, 1.f)(rng); }

uint16_t bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

int failures = 0;

void fail(const std::string& what) {
  ++failures;
  std::printf("FAIL %s\n", what.c_str());
}

std::string describe(const Case& c) {
  const char* t = c.type == Weight::kF32    ? "f32"
                  : c.type == Weight::kBF16 ? "bf16"
                  : c.type == Weight::kU4   ? "u4"
                                            : "int8";
  char buf[200];
  std::snprintf(buf, sizeof buf, "matmul G=%lld M=%lld K=%lld N=%lld groups=%lld %s %s%s%s%s%s%s%s",
                (long long)c.G, (long long)c.M, (long long)c.K, (long long)c.N,
                (long long)c.groups, t, c.nmajor ? "n-major" : "k-major", c.acc ? " acc" : "",
                c.ones ? " ones" : "", c.shift ? " shift" : "", c.offset ? " offset" : "",
                c.half ? " f16" : "", c.act8 ? " act8" : "");
  return buf;
}

void check_matmul(const Table* table, const Case& c) {
  const i64 cols = c.N + (c.ones ? 1 : 0);
  std::vector<float> x(c.G * c.M * c.K), wf(c.G * c.K * c.N), s(c.G * c.groups * c.N);
  std::vector<uint16_t> wb(wf.size());
  std::vector<int8_t> wi(wf.size());
  std::vector<float> acc(c.G * c.M * cols), shift(c.G * c.M);
  for (auto& v : shift) v = normal();
  for (auto& v : x) v = normal();
  for (size_t i = 0; i < wf.size(); ++i) {
    wf[i] = normal();
    wb[i] = bf16(normal());
    wi[i] = static_cast<int8_t>(std::uniform_int_distribution<int>(-127, 127)(rng));
  }
  for (auto& v : s) v = std::uniform_real_distribution<float>(0.f, 0.02f)(rng);
  const bool u4 = c.type == Weight::kU4;
  std::vector<uint8_t> w4(wf.size() / 2);  // u4: two codes a byte along K
  for (auto& v : w4) v = static_cast<uint8_t>(rng());
  std::vector<float> o(s.size());
  for (auto& v : o) v = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
  std::vector<uint16_t> s16(s.size()), o16(o.size());
  if (c.half)  // f16 scales of 2^-10 .. 2^-5, offsets of either sign
    for (size_t i = 0; i < s.size(); ++i) {
      s16[i] = static_cast<uint16_t>(std::uniform_int_distribution<int>(0x1400, 0x27ff)(rng));
      o16[i] = static_cast<uint16_t>(s16[i] | (rng() & 0x8000));
      s[i] = chunkwise::half_bits_to_float(s16[i]);
      o[i] = chunkwise::half_bits_to_float(o16[i]);
    }
  Problem p;
  p.x = x.data();
  const bool int8 = c.type == Weight::kI8 || u4;
  p.w = c.type == Weight::kF32    ? static_cast<const void*>(wf.data())
        : c.type == Weight::kBF16 ? static_cast<const void*>(wb.data())
        : u4                      ? static_cast<const void*>(w4.data())
                                  : static_cast<const void*>(wi.data());
  p.s = int8 && !c.half ? s.data() : nullptr;
  p.o = int8 && c.offset && !c.half ? o.data() : nullptr;
  p.s16 = int8 && c.half ? s16.data() : nullptr;
  p.o16 = int8 && c.offset && c.half ? o16.data() : nullptr;
  p.acc = c.acc ? acc.data() : nullptr;
  p.shift = c.shift ? shift.data() : nullptr;
  p.type = c.type;
  p.nmajor = c.nmajor;
  p.G = c.G;
  p.M = c.M;
  p.K = c.K;
  p.N = c.N;
  p.groups = c.groups;
  p.group = c.K / c.groups;
  p.w_shared = c.G == 1;
  p.ones = c.ones;
  p.act8 = c.act8;
  std::vector<float> want(c.G * c.M * cols), got(want.size());
  Threads par;
  p.out = want.data();
  chunkwise::portable::table()->matmul(p, par);
  p.out = got.data();
  table->matmul(p, par);
  if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0) {
    i64 i = 0;
    while (std::memcmp(&want[i], &got[i], sizeof(float)) == 0) ++i;
    char buf[96];
    std::snprintf(buf, sizeof buf, ": out[%lld] %.9g, defined %.9g", (long long)i, got[i], want[i]);
    return fail(describe(c) + buf);
  }
  // The last row alone: the same bits.
  if (c.G == 1 && c.M > 1) {
    Problem one = p;
    one.M = 1;
    one.x = x.data() + (c.M - 1) * c.K;
    one.acc = c.acc ? acc.data() + (c.M - 1) * cols : nullptr;
    one.shift = c.shift ? shift.data() + (c.M - 1) : nullptr;
    std::vector<float> alone(cols);
    one.out = alone.data();
    table->matmul(one, par);
    if (std::memcmp(alone.data(), got.data() + (c.M - 1) * cols, cols * sizeof(float)) != 0)
      fail(describe(c) + ": the last row alone differs");
  }
}

void check_unary(const Table* table, i64 n) {
  std::vector<float> x(n), want(n), got(n);
  for (i64 i = 0; i < n; ++i) x[i] = normal() * 30.f;
  const float special[] = {0.f, -0.f, INFINITY, -INFINITY, NAN, 89.f, -88.f, 1e-45f, 88.7f};
  for (i64 i = 0; i < n && i < 9; ++i) x[i] = special[i];
  Threads par;
  for (int64_t op : {chunkwise::kExp, chunkwise::kLog}) {
    std::vector<float> in = x;
    if (op == chunkwise::kLog)
      for (i64 i = 9; i < n; ++i) in[i] = std::fabs(in[i]);
    chunkwise::portable::table()->unary(in.data(), want.data(), n, op, par);
    table->unary(in.data(), got.data(), n, op, par);
    if (std::memcmp(want.data(), got.data(), n * sizeof(float)) != 0)
      fail(std::string(op == chunkwise::kExp ? "exp" : "log") + " of " + std::to_string(n));
  }
}

void check_row_sum(const Table* table, i64 M, i64 K) {
  std::vector<float> x(M * K), shift(M), want(M), got(M);
  for (auto& v : x) v = normal() * 5.f;
  for (i64 m = 0; m < M; ++m) shift[m] = *std::max_element(&x[m * K], &x[m * K] + K);
  Threads par;
  const float* shifts[] = {nullptr, shift.data()};
  for (const float* s : shifts) {
    chunkwise::portable::table()->row_sum(x.data(), s, want.data(), M, K, par);
    table->row_sum(x.data(), s, got.data(), M, K, par);
    if (std::memcmp(want.data(), got.data(), M * sizeof(float)) != 0)
      fail(std::string(s ? "exp_sum " : "row_sum ") + std::to_string(M) + " x " +
           std::to_string(K));
  }
}

// Attention in one call: a prefix piece shared by the batch rows (b = 1,
// a window of heads, each row's length) and the chunk's own keys, causal.
void check_attend(const Table* table, i64 B, i64 T, i64 group, i64 D, i64 S, bool half) {
  const i64 kv = 2, heads = 3;
  std::vector<float> q(B * kv * T * group * D), want(B * kv * T * group * (D + 1));
  std::vector<float> got(want.size());
  for (auto& v : q) v = normal() * 0.3f;
  std::vector<float> k1(heads * S * D), v1(heads * S * D), k2(B * kv * T * D), v2(k2.size());
  for (auto* a : {&k1, &v1, &k2, &v2})
    for (auto& v : *a) v = normal();
  std::vector<uint16_t> k2h(k2.size()), v2h(v2.size());
  for (size_t i = 0; i < k2.size(); ++i) {
    k2h[i] = bf16(k2[i]);
    v2h[i] = bf16(v2[i]);
  }
  std::vector<uint8_t> lengths(B * S), causal(T * T);
  for (i64 b = 0; b < B; ++b) {
    const i64 n = std::uniform_int_distribution<i64>(0, S)(rng);
    for (i64 s = 0; s < S; ++s) lengths[b * S + s] = s < n;
  }
  for (i64 t = 0; t < T; ++t)
    for (i64 s = 0; s < T; ++s) causal[t * T + s] = s <= t;
  chunkwise::AttendPiece pieces[2];
  pieces[0].k = k1.data();
  pieces[0].v = v1.data();
  pieces[0].heads = heads;
  pieces[0].first = 1;
  pieces[0].S = S;
  pieces[0].mask = lengths.data();
  pieces[0].mr = B;
  pieces[0].ms = S;
  pieces[1].k = half ? static_cast<const void*>(k2h.data()) : k2.data();
  pieces[1].v = half ? static_cast<const void*>(v2h.data()) : v2.data();
  pieces[1].bf16 = half;
  pieces[1].b = B;
  pieces[1].heads = kv;
  pieces[1].S = T;
  pieces[1].mask = causal.data();
  pieces[1].mt = T;
  pieces[1].ms = T;
  chunkwise::Attend a;
  a.q = q.data();
  a.B = B;
  a.kv = kv;
  a.T = T;
  a.group = group;
  a.D = D;
  a.piece = pieces;
  a.pieces = 2;
  Threads par;
  a.out = want.data();
  chunkwise::portable::table()->attend(a, par);
  a.out = got.data();
  table->attend(a, par);
  if (std::memcmp(want.data(), got.data(), want.size() * sizeof(float)) != 0)
    fail("attend B=" + std::to_string(B) + " T=" + std::to_string(T) + " group=" +
         std::to_string(group) + " D=" + std::to_string(D) + " S=" + std::to_string(S) +
         (half ? " bf16" : ""));
}

}  // namespace

int main(int argc, char** argv) {
  const int random_cases = argc > 1 ? std::atoi(argv[1]) : 40;
  const Table* table = ChunkwiseKernelTable();
  // Every kernel's blocks and tails (as tests/test_invariant_kernels.py).
  const Case cases[] = {
      {1, 1, 576, 200, 1, Weight::kF32, false, false, false},  // decode: stream
      {1, 33, 96, 70, 1, Weight::kF32, false, false, false},   // panels, column tail
      {1, 100, 300, 130, 1, Weight::kF32, false, true, false}, // two bands, two panels
      {3, 13, 70, 64, 1, Weight::kF32, false, true, true},     // attention's values
      {2, 40, 37, 64, 1, Weight::kF32, false, true, true},
      {1, 5, 576, 30, 1, Weight::kBF16, false, false, false},
      {1, 1, 70, 203, 1, Weight::kF32, true, false, false},    // tied unembedding
      {1, 9, 64, 50, 1, Weight::kF32, true, false, false},
      {3, 3, 64, 37, 1, Weight::kF32, true, false, false},     // attention's logits
      {1, 2, 40, 11, 1, Weight::kBF16, true, false, false},
      {1, 7, 72, 40, 2, Weight::kI8, false, false, false},
      {1, 50, 72, 33, 4, Weight::kI8, false, false, false},
      {1, 17, 30, 50, 2, Weight::kI8, false, false, false},    // odd groups
      {1, 3, 600, 70, 1, Weight::kI8, false, true, false},     // chunks of 256
      {1, 18, 72, 9, 2, Weight::kI8, true, false, false},
      {1, 18, 30, 37, 2, Weight::kI8, true, false, false},
      {1, 3, 600, 21, 1, Weight::kI8, true, false, false},
      {1, 7, 64, 40, 2, Weight::kU4, false, false, false},       // GGUF blocks
      {1, 1, 576, 70, 18, Weight::kU4, false, false, false, false, true, true},
      {1, 9, 96, 33, 3, Weight::kU4, true, false, false, false, true, false},
      {1, 18, 64, 37, 4, Weight::kU4, true, true, false, false, false, true},
      {1, 5, 96, 50, 6, Weight::kI8, false, true, false, false, true, true},
      {1, 3, 64, 21, 4, Weight::kI8, true, false, false, false, true, true},
      {3, 40, 300, 64, 1, Weight::kF32, false, true, true, true},  // values from logits
      {2, 3, 70, 64, 1, Weight::kBF16, false, true, true, true},
  };
  for (const Case& c : cases) {
    check_matmul(table, c);
    Case q8 = c;  // int8 and u4 weights with 8-bit activations too
    q8.act8 = true;
    if ((c.type == Weight::kI8 || c.type == Weight::kU4) && act8_vectored(q8)) check_matmul(table, q8);
  }
  for (int i = 0; i < random_cases; ++i) {
    auto pick = [](std::initializer_list<i64> v) {
      return *(v.begin() + std::uniform_int_distribution<size_t>(0, v.size() - 1)(rng));
    };
    Case c{};
    c.G = 1;
    c.type = static_cast<Weight>(i % 4);
    c.nmajor = (i / 4) % 2;
    const bool int8 = c.type == Weight::kI8 || c.type == Weight::kU4;
    c.M = pick({1, 2, 3, 5, 8, 17, 33, 40});
    c.N = std::uniform_int_distribution<i64>(1, 150)(rng);
    c.groups = int8 ? pick({1, 2, 3}) : 1;
    const i64 per = std::uniform_int_distribution<i64>(1, 70)(rng);
    c.K = c.groups * (c.type == Weight::kU4 ? 2 * per : per);  // u4: even groups
    c.ones = !int8 && !c.nmajor && (rng() & 1);
    c.acc = !c.nmajor && (rng() & 1);
    c.shift = !int8 && (rng() % 3 == 0);
    c.offset = int8 && (rng() & 1);
    c.half = int8 && (rng() & 1);
    check_matmul(table, c);
    if (int8) {  // act8: blocks of 32 (GGUF's, and groups of several), 16, 8, 12
      c.act8 = true;
      const i64 block = c.type == Weight::kU4 && c.nmajor ? 32 : pick({32, 16, 8, 12});
      c.K = c.groups * block * (block == 32 ? pick({1, 2, 3}) : 1);
      check_matmul(table, c);
    }
  }
  for (i64 n : {1, 3, 7, 16, 33, 1001}) check_unary(table, n);
  for (auto mk : {std::pair<i64, i64>{5, 4099}, {3, 70}, {17, 16}, {2, 5}, {4, 23}})
    check_row_sum(table, mk.first, mk.second);
  check_attend(table, 2, 37, 3, 64, 70, false);
  check_attend(table, 1, 9, 5, 40, 130, true);
  check_attend(table, 3, 20, 1, 72, 1, false);
  std::printf("%s: %d failures\n", table->name, failures);
  return failures ? 1 : 0;
}
