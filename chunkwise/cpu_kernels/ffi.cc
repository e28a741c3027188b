// The invariant kernels' XLA FFI handlers, and the choice of instruction
// set at run time.
//
// This file and portable.cc are built for the architecture's baseline into
// the library XLA calls, so it loads on any CPU of it. build.py builds
// kernels.cc once per instruction set the compiler can target (AVX2,
// AVX-512, AVX-512 + VNNI on x86-64; NEON on AArch64), each into a shared
// object of its own, and registers the table of each one this CPU runs
// (ChunkwiseRegisterIsa). Each call runs the table of its `isa`
// attribute, or with 0 the process's default: the best registered set
// (cpuid through the compiler's __builtin_cpu_supports, which also checks
// that the OS saves the registers; hwcaps on Linux/AArch64; always NEON on
// Apple silicon), unless ChunkwiseSetIsa picked another (isa.py, from
// CHUNKWISE_CPU_ISA). A set this CPU lacks is refused, never run.

#include <atomic>
#include <string>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#include <vector>

#include "common.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

#if defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1 << 20)
#endif
#endif

namespace chunkwise {
namespace portable { const Table* table(); }
}  // namespace chunkwise

namespace ffi = xla::ffi;

namespace {

using chunkwise::i64;
using chunkwise::Table;

const char* const kNames[chunkwise::kIsaCount] = {
    "auto", "portable", "avx2", "avx2_vnni", "avx512", "avx512_vnni", "neon", "neon_dotprod"};

// Whether the CPU can run instruction set `isa` (compiled or not).
bool cpu_has(int64_t isa) {
  switch (isa) {
    case chunkwise::kPortable: return true;
#if defined(__x86_64__) || defined(__i386__)
    case chunkwise::kAvx2:
      __builtin_cpu_init();
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case chunkwise::kAvx2Vnni: {  // AVX-VNNI: CPUID leaf 7, subleaf 1, EAX bit 4
      // asked once: CPUID is slow, and in a VM a trap to the hypervisor
      static const bool vnni = [] {
        unsigned a = 0, b = 0, c = 0, d = 0;
        return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 4));
      }();
      return cpu_has(chunkwise::kAvx2) && vnni;
    }
    case chunkwise::kAvx512:
      __builtin_cpu_init();
      return cpu_has(chunkwise::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
    case chunkwise::kAvx512Vnni:
      return cpu_has(chunkwise::kAvx512) && __builtin_cpu_supports("avx512vnni");
#endif
#if defined(__aarch64__)
    case chunkwise::kNeon:
#if defined(__APPLE__)
      return true;
#elif defined(__linux__)
      return (getauxval(AT_HWCAP) & HWCAP_ASIMD) != 0;
#else
      return true;  // Advanced SIMD is part of every AArch64 ABI
#endif
    case chunkwise::kNeonDot:
#if defined(__APPLE__)
      return true;  // every Apple silicon core has ARMv8.4's dot products
#elif defined(__linux__)
      return (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#else
      return false;
#endif
#endif
    default: return false;
  }
}

// Each instruction set's table, once registered (the portable one is
// built in).
std::atomic<const Table*> tables[chunkwise::kIsaCount] = {};

const Table* compiled(int64_t isa) {
  if (isa == chunkwise::kPortable) return chunkwise::portable::table();
  return tables[isa].load(std::memory_order_acquire);
}

const Table* usable(int64_t isa) {
  if (isa <= chunkwise::kAuto || isa >= chunkwise::kIsaCount) return nullptr;
  return cpu_has(isa) ? compiled(isa) : nullptr;
}

int64_t best() {
  for (int64_t isa = chunkwise::kIsaCount - 1; isa > chunkwise::kAuto; --isa)
    if (usable(isa)) return isa;
  return chunkwise::kPortable;
}

std::atomic<int64_t> default_isa{chunkwise::kAuto};

int64_t resolved(int64_t isa) {
  if (isa != chunkwise::kAuto) return isa;
  const int64_t d = default_isa.load(std::memory_order_relaxed);
  return d != chunkwise::kAuto ? d : best();
}

// XLA's intra-op pool as the kernels' threads (pool.h).
class Pool : public chunkwise::Parallel {
 public:
  explicit Pool(ffi::ThreadPool& pool) : pool_(pool) {}
  int threads() const override { return std::max<int>(1, static_cast<int>(pool_.num_threads())); }
  void run(i64 total, const std::function<void(i64)>& body) override {
    chunkwise::parallel_for(pool_, total, body);
  }

 private:
  ffi::ThreadPool& pool_;
};

ffi::Error table_of(int64_t isa, const Table** table) {
  *table = usable(resolved(isa));
  if (*table == nullptr)
    return ffi::Error::InvalidArgument(
        std::string("instruction set ") +
        (isa >= 0 && isa < chunkwise::kIsaCount ? kNames[isa] : "?") +
        " is not compiled or not supported by this CPU");
  return ffi::Error::Success();
}

ffi::Error Invariant(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::AnyBuffer scale, ffi::Buffer<ffi::F32> acc,
                     ffi::Buffer<ffi::F32> shift, ffi::Buffer<ffi::S32> first,
                     ffi::AnyBuffer offset, ffi::Buffer<ffi::S32> rows,
                     ffi::Buffer<ffi::S32> valid, ffi::ResultBuffer<ffi::F32> out,
                     int64_t count, int64_t nmajor, int64_t scaled, int64_t has_acc,
                     int64_t has_shift, int64_t ones, int64_t has_offset, int64_t has_rows,
                     int64_t has_valid, int64_t act8, int64_t isa) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  auto od = out->dimensions();
  if (xd.size() != 3 || wd.size() < 3 || sd.size() != 3 || od.size() != 3)
    return ffi::Error::InvalidArgument("x, scale and out must be 3-D, w at least 3-D");
  // w's leading dims are its batch ([b, kv, S, D] attention caches are read
  // as they are: a reshape made XLA copy a loop's buffer every step).
  const size_t r = wd.size();
  int64_t gw = 1;
  for (size_t i = 0; i + 2 < r; ++i) gw *= wd[i];
  chunkwise::Problem p;
  p.G = xd[0];
  p.M = xd[1];
  p.K = xd[2];
  p.nmajor = nmajor != 0;
  p.N = p.nmajor ? wd[r - 2] : wd[r - 1];
  p.ones = ones != 0;
  switch (w.element_type()) {
    case ffi::DataType::S8: p.type = chunkwise::Weight::kI8; break;
    case ffi::DataType::U8: p.type = chunkwise::Weight::kU4; break;
    case ffi::DataType::BF16: p.type = chunkwise::Weight::kBF16; break;
    case ffi::DataType::F32: p.type = chunkwise::Weight::kF32; break;
    default: return ffi::Error::InvalidArgument("w must be int8, uint8 (u4), bf16 or f32");
  }
  const bool u4 = p.type == chunkwise::Weight::kU4;
  const bool int8 = p.type == chunkwise::Weight::kI8 || u4;
  if ((scaled != 0) != int8)
    return ffi::Error::InvalidArgument("scale is given for int8 weights, and only for them");
  // An attention cache read by row (`rows`: each of n rows names the
  // cache's row it reads) or up to each row's valid keys: w [b, heads, S,
  // D], a float, G = n * (count or heads).
  const i64 n_rows = has_rows ? static_cast<i64>(rows.element_count())
                     : has_valid ? static_cast<i64>(valid.element_count())
                                 : (r == 4 ? wd[0] : 0);
  if (has_rows || has_valid) {
    const i64 per = count > 0 ? count : (r == 4 ? wd[1] : 0);
    if (r != 4 || int8 || n_rows <= 0 || p.G != n_rows * per ||
        (has_rows && has_valid && static_cast<i64>(valid.element_count()) != n_rows) ||
        (!has_rows && wd[0] != n_rows))
      return ffi::Error::InvalidArgument(
          "rows and valid need a float w [b, heads, S, D] and one entry per row of G");
    p.per = per;
    p.lead = wd[0];
    if (has_rows) p.rows = rows.typed_data();
    if (has_valid) p.valid = valid.typed_data();
  }
  if (count > 0) {  // a window of heads: w [b, heads, ...]
    if (r != 4 || p.G != n_rows * count || count > wd[1] || int8)
      return ffi::Error::InvalidArgument("a heads window needs w [b, kv, ., .], G = b * count");
    p.heads = wd[1];
    p.count = count;
    p.first = first.typed_data()[0];
    if (p.first < 0 || p.first + count > p.heads)
      return ffi::Error::InvalidArgument("heads window out of range");
    gw = p.G;
  }
  p.w_shared = gw == 1 && count == 0;
  if (u4 && (!p.w_shared || p.K % 2))
    return ffi::Error::InvalidArgument("a u4 weight is one [K / 2, N] or [N, K / 2], K even");
  if (has_rows && count == 0) gw = p.G;  // each row's heads, read by rows
  if ((p.nmajor ? wd[r - 1] : wd[r - 2]) * (u4 ? 2 : 1) != p.K || (gw != 1 && gw != p.G))
    return ffi::Error::InvalidArgument("x and w shapes disagree");
  if (od[0] != p.G || od[1] != p.M || od[2] != p.cols())
    return ffi::Error::InvalidArgument("out shape disagrees");
  if (p.ones && (p.nmajor || int8))
    return ffi::Error::InvalidArgument("ones needs a k-major float weight");
  p.groups = 1;
  p.group = p.K;
  if (int8) {
    p.groups = p.nmajor ? sd[2] : sd[1];
    if (sd[0] != gw || (p.nmajor ? sd[1] : sd[2]) != p.N || p.groups <= 0 ||
        p.K % p.groups != 0)
      return ffi::Error::InvalidArgument("w and scale shapes disagree");
    p.group = p.K / p.groups;
    if (u4 && p.group % 2)
      return ffi::Error::InvalidArgument("a u4 weight's groups must be even");
  }
  if (act8) {
    if (!int8)
      return ffi::Error::InvalidArgument("act8 (8-bit activations) needs an int8 or u4 weight");
    p.act8 = true;
    if (p.act_block() > chunkwise::kMaxActBlock)
      return ffi::Error::InvalidArgument(
          "act8: a weight group of " + std::to_string(p.group) +
          " inputs is not a multiple of 32 and above 2^17 (int32 sums could overflow)");
  }
  if (has_offset && (!int8 || offset.element_count() != scale.element_count()))
    return ffi::Error::InvalidArgument("offset needs an int8 or u4 weight and scale's shape");
  if (has_acc) {
    auto ad = acc.dimensions();
    if (ad.size() != 3 || ad[0] != p.G || ad[1] != p.M || ad[2] != p.cols())
      return ffi::Error::InvalidArgument("acc needs the output's shape [G, M, N']");
    p.acc = acc.typed_data();
  }
  if (has_shift) {
    if (int8 || static_cast<i64>(shift.element_count()) != p.G * p.M)
      return ffi::Error::InvalidArgument("shift needs a float weight and one value per row of x");
    p.shift = shift.typed_data();
  }
  p.x = x.typed_data();
  p.w = w.untyped_data();
  p.out = out->typed_data();
  const Table* table;
  if (auto e = table_of(isa, &table); e.failure()) return e;
  if (int8) {  // scales and offsets: f32, or f16 the kernels widen per block
    const auto type = scale.element_type();
    if (type != ffi::DataType::F32 && type != ffi::DataType::F16)
      return ffi::Error::InvalidArgument("scales and offsets must be f32 or f16");
    if (has_offset && offset.element_type() != type)
      return ffi::Error::InvalidArgument("scale and offset must have one dtype");
    const bool f16 = type == ffi::DataType::F16;
    if (f16 && !p.w_shared)
      return ffi::Error::InvalidArgument("f16 scales need one shared weight");
    if (f16) {
      p.s16 = static_cast<const uint16_t*>(scale.untyped_data());
      if (has_offset) p.o16 = static_cast<const uint16_t*>(offset.untyped_data());
    } else {
      p.s = static_cast<const float*>(scale.untyped_data());
      if (has_offset) p.o = static_cast<const float*>(offset.untyped_data());
    }
  }
  if (p.G * p.M * p.cols() == 0) return ffi::Error::Success();
  if (p.K == 0) {  // every chain is its start
    for (i64 i = 0; i < p.G * p.M * p.cols(); ++i) p.out[i] = p.acc ? p.acc[i] : 0.f;
    return ffi::Error::Success();
  }
  // The vector paths read act8's blocks 4 inputs at a time, n-major u4
  // ones 32 (kernels_q8.h); other blocks run the portable loops.
  if (p.act8 && (p.act_block() % 4 != 0 || (u4 && p.nmajor && p.act_block() != 32)))
    table = chunkwise::portable::table();
  Pool par(pool);
  table->matmul(p, par);
  return ffi::Error::Success();
}

ffi::Error RowSum(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> shift,
                  ffi::ResultBuffer<ffi::F32> out, int64_t exp, int64_t isa) {
  auto xd = x.dimensions();
  const i64 K = xd.size() ? xd[xd.size() - 1] : 1;
  const i64 M = K ? static_cast<i64>(x.element_count()) / K : 0;
  if ((exp && static_cast<i64>(shift.element_count()) != M) ||
      static_cast<i64>(out->element_count()) != M)
    return ffi::Error::InvalidArgument("shift and out need one value per row of x");
  const Table* table;
  if (auto e = table_of(isa, &table); e.failure()) return e;
  if (M == 0) return ffi::Error::Success();
  Pool par(pool);
  table->row_sum(x.typed_data(), exp ? shift.typed_data() : nullptr, out->typed_data(), M, K,
                 par);
  return ffi::Error::Success();
}

ffi::Error Unary(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out,
                 int64_t op, int64_t isa) {
  if (op != chunkwise::kExp && op != chunkwise::kLog)
    return ffi::Error::InvalidArgument("op: 0 exp, 1 log");
  const Table* table;
  if (auto e = table_of(isa, &table); e.failure()) return e;
  Pool par(pool);
  table->unary(x.typed_data(), out->typed_data(), static_cast<i64>(x.element_count()), op, par);
  return ffi::Error::Success();
}

// Attention in one call (common.h's Attend): q f32[B, kv, T * group, D],
// firsts s32[P] (each piece's first head), then k, v, mask per piece (k, v
// [b, heads, S, D] f32 or bf16; mask bool [mb, mr, mt, ms], each dim 1 or
// b, B / b, T, S); out f32[B, kv, T * group, D + 1].
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> firsts,
                  ffi::RemainingArgs rest, ffi::ResultBuffer<ffi::F32> out, int64_t group,
                  int64_t isa) {
  auto qd = q.dimensions();
  if (qd.size() != 4 || group <= 0 || qd[2] % group != 0)
    return ffi::Error::InvalidArgument("q must be [B, kv, T * group, D]");
  chunkwise::Attend a;
  a.B = qd[0];
  a.kv = qd[1];
  a.T = qd[2] / group;
  a.group = group;
  a.D = qd[3];
  auto od = out->dimensions();
  if (od.size() != 4 || od[0] != a.B || od[1] != a.kv || od[2] != qd[2] || od[3] != a.D + 1)
    return ffi::Error::InvalidArgument("out must be [B, kv, T * group, D + 1]");
  const i64 P = static_cast<i64>(firsts.element_count());
  if (static_cast<i64>(rest.size()) != 3 * P)
    return ffi::Error::InvalidArgument("k, v and mask for every piece");
  std::vector<chunkwise::AttendPiece> pieces(P);
  for (i64 p = 0; p < P; ++p) {
    auto k = rest.get<ffi::AnyBuffer>(3 * p);
    auto v = rest.get<ffi::AnyBuffer>(3 * p + 1);
    auto m = rest.get<ffi::AnyBuffer>(3 * p + 2);
    if (!k.has_value() || !v.has_value() || !m.has_value())
      return ffi::Error::InvalidArgument("pieces are buffers");
    auto kd = k->dimensions(), vd = v->dimensions(), md = m->dimensions();
    chunkwise::AttendPiece& pc = pieces[p];
    if (kd.size() != 4 || vd.size() != 4 || md.size() != 4 || k->element_type() != v->element_type())
      return ffi::Error::InvalidArgument("k and v [b, heads, S, D] of one dtype, mask 4-D");
    for (int i = 0; i < 4; ++i)
      if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("k and v shapes disagree");
    if (k->element_type() == ffi::DataType::BF16) pc.bf16 = true;
    else if (k->element_type() != ffi::DataType::F32)
      return ffi::Error::InvalidArgument("k and v must be f32 or bf16");
    if (m->element_type() != ffi::DataType::PRED)
      return ffi::Error::InvalidArgument("mask must be bool");
    pc.b = kd[0];
    pc.heads = kd[1];
    pc.S = kd[2];
    pc.first = firsts.typed_data()[p];
    if (kd[3] != a.D || pc.b <= 0 || a.B % pc.b != 0 || pc.first < 0 || pc.first + a.kv > pc.heads)
      return ffi::Error::InvalidArgument("a piece's k and v disagree with q");
    const i64 full[4] = {pc.b, a.B / pc.b, a.T, pc.S};
    for (int i = 0; i < 4; ++i)
      if (md[i] != 1 && md[i] != full[i])
        return ffi::Error::InvalidArgument("mask dims must be 1 or [b, B / b, T, S]");
    pc.mb = md[0];
    pc.mr = md[1];
    pc.mt = md[2];
    pc.ms = md[3];
    pc.k = k->untyped_data();
    pc.v = v->untyped_data();
    pc.mask = static_cast<const uint8_t*>(m->untyped_data());
  }
  a.piece = pieces.data();
  a.pieces = P;
  a.q = q.typed_data();
  a.out = out->typed_data();
  const Table* table;
  if (auto e = table_of(isa, &table); e.failure()) return e;
  if (a.B * a.kv * qd[2] == 0) return ffi::Error::Success();
  if (a.keys() == 0) return ffi::Error::InvalidArgument("attention needs a key");
  Pool par(pool);
  table->attend(a, par);
  return ffi::Error::Success();
}

}  // namespace

// The run-time choice, for invariant.py (ctypes).
extern "C" {
// 1 if `isa` is compiled into this library and the CPU runs it.
int ChunkwiseIsaUsable(int64_t isa) { return usable(isa) != nullptr; }
// 1 if the CPU runs `isa`, compiled or not.
int ChunkwiseIsaCpuHas(int64_t isa) {
  return isa > chunkwise::kAuto && isa < chunkwise::kIsaCount && cpu_has(isa);
}
// The set calls with isa 0 run.
int64_t ChunkwiseIsaDefault() { return resolved(chunkwise::kAuto); }
// Registers `table` (a build of kernels.cc) as `isa`'s; -1 if the CPU
// does not run `isa`.
int ChunkwiseRegisterIsa(int64_t isa, const void* table) {
  if (isa <= chunkwise::kPortable || isa >= chunkwise::kIsaCount || !cpu_has(isa)) return -1;
  tables[isa].store(static_cast<const Table*>(table), std::memory_order_release);
  return 0;
}
// Makes `isa` (0: the best) the default; -1 if it is not usable here.
int ChunkwiseSetIsa(int64_t isa) {
  if (isa != chunkwise::kAuto && !usable(isa)) return -1;
  default_isa.store(isa, std::memory_order_relaxed);
  return 0;
}
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantMatmul, Invariant,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("count")
                                  .Attr<int64_t>("nmajor")
                                  .Attr<int64_t>("scaled")
                                  .Attr<int64_t>("has_acc")
                                  .Attr<int64_t>("has_shift")
                                  .Attr<int64_t>("ones")
                                  .Attr<int64_t>("has_offset")
                                  .Attr<int64_t>("has_rows")
                                  .Attr<int64_t>("has_valid")
                                  .Attr<int64_t>("act8")
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantUnary, Unary,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("op")
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantRowSum, RowSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("exp")
                                  .Attr<int64_t>("isa"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseInvariantAttend, Attend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group")
                                  .Attr<int64_t>("isa"));
