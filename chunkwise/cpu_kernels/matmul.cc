// Skinny matmuls for XLA:CPU that read int8 / bf16 / f32 weights in place.
//
//   out[m, n] = sum_k x[m, k] * w(k, n) * scale(k / group, n)
//
// x: f32 [M, K], small M (decode rows). w: int8, bf16 or f32, either
// [K, N] ("k-major": a weight whose contracted dims lead, e.g. q, o, down)
// or [N, K] ("n-major": a tied embedding table used to unembed); scale: f32
// [K / group, N] or [N, K / group] (group = K / its size: a float weight
// passes one group of ones). out: f32 [M, N].
//
// Each weight element is read once per call and converted in registers:
// int8 reads a quarter of f32's bytes, which is what decode is bound by.
// Work is split into column (k-major) or row (n-major) blocks that the
// calling thread and XLA's intra-op threads claim from a shared counter,
// so the call completes even if no pool thread ever runs its task.
//
// The plain twin (XLA's dot of the dequantized weight) is in matmul.py;
// tests/test_cpu_kernels.py compares the two.

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define CW_AVX2 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using i64 = int64_t;

// Weight rows read ahead of the k-major loop: each step reads short
// segments of four rows N apart, which the hardware prefetchers miss
// (measured on Zen: int8 rows from DRAM 3 -> 5 GB/s per core, f32 10 -> 13).
constexpr i64 kAhead = 8;

inline float to_float(int8_t v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }
inline float to_float(uint16_t bf16) {
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The portable twin of the AVX2 blocks below (any CPU the compiler
// targets); they also use it for column tails.
template <bool SCALED, class W>
void scalar_rows(const float* x, const W* w, const float* s, float* out, i64 M,
                 i64 K, i64 N, i64 group, bool nmajor, i64 n0, i64 n1) {
  const i64 groups = K / group;
  for (i64 n = n0; n < n1; ++n)
    for (i64 m = 0; m < M; ++m) {
      float acc = 0.f;
      for (i64 k = 0; k < K; ++k) {
        float wk = to_float(nmajor ? w[n * K + k] : w[k * N + n]);
        float sc = !SCALED ? 1.f : nmajor ? s[n * groups + k / group]
                                          : s[(k / group) * N + n];
        acc += x[m * K + k] * wk * sc;
      }
      out[m * N + n] = acc;
    }
}

#ifdef CW_AVX2
// 8 consecutive weights as f32.
inline __m256 load8(const int8_t* p) {
  __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
inline __m256 load8(const uint16_t* p) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// k-major: columns [n0, n1) of out, all M rows, accumulated in `acc`
// ([M, n1 - n0], L1-sized) four weight rows at a time: every step streams
// four contiguous row segments and converts each weight vector once for
// all M rows; the group's scale multiplies the four rows' sum.
template <bool SCALED, class W>
void kmajor_cols(const float* x, const W* w, const float* s, float* out,
                 float* acc, i64 M, i64 K, i64 N, i64 group, i64 n0, i64 n1) {
  const i64 B = n1 - n0;
  const i64 nv = n0 + (B / 8) * 8;  // columns [nv, n1) are done one by one
  std::fill(acc, acc + M * B, 0.f);
  const i64 groups = K / group;
  for (i64 g = 0; g < groups; ++g) {
    const float* sr = SCALED ? s + g * N : nullptr;
    const i64 k1 = (g + 1) * group;
    i64 k = g * group;
    for (; k + 4 <= k1; k += 4) {
      const W* r0 = w + k * N;
      const W *r1 = r0 + N, *r2 = r1 + N, *r3 = r2 + N;
      for (i64 n = n0; n < nv; n += 8) {
        if (((n * static_cast<i64>(sizeof(W))) & 63) == 0) {  // a new line
          _mm_prefetch(reinterpret_cast<const char*>(r0 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r1 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r2 + kAhead * N + n), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(r3 + kAhead * N + n), _MM_HINT_T0);
        }
        const __m256 w0 = load8(r0 + n), w1 = load8(r1 + n);
        const __m256 w2 = load8(r2 + n), w3 = load8(r3 + n);
        const __m256 sv = SCALED ? _mm256_loadu_ps(sr + n) : _mm256_set1_ps(1.f);
        for (i64 m = 0; m < M; ++m) {
          const float* xm = x + m * K + k;
          __m256 t = _mm256_mul_ps(_mm256_set1_ps(xm[0]), w0);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[1]), w1, t);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[2]), w2, t);
          t = _mm256_fmadd_ps(_mm256_set1_ps(xm[3]), w3, t);
          float* a = acc + m * B + (n - n0);
          _mm256_storeu_ps(a, _mm256_fmadd_ps(t, sv, _mm256_loadu_ps(a)));
        }
      }
    }
    for (; k < k1; ++k) {
      const W* r0 = w + k * N;
      for (i64 n = n0; n < nv; n += 8) {
        __m256 w0 = load8(r0 + n);
        if (SCALED) w0 = _mm256_mul_ps(w0, _mm256_loadu_ps(sr + n));
        for (i64 m = 0; m < M; ++m) {
          float* a = acc + m * B + (n - n0);
          _mm256_storeu_ps(
              a, _mm256_fmadd_ps(_mm256_set1_ps(x[m * K + k]), w0, _mm256_loadu_ps(a)));
        }
      }
    }
  }
  for (i64 m = 0; m < M; ++m)
    std::copy(acc + m * B, acc + m * B + (nv - n0), out + m * N + n0);
  scalar_rows<SCALED>(x, w, s, out, M, K, N, group, false, nv, n1);
}

// n-major: out[n .. n + R) of one x row, R weight rows at a time (R
// independent FMA chains); group partial sums are scaled as they close.
template <int R, bool SCALED, class W>
inline void nmajor_rows(const float* xm, const W* w, const float* s,
                        float* outm, i64 K, i64 group, i64 n) {
  const i64 groups = K / group;
  const W* r[R];
  __m256 total[R];
  float tail[R];
  for (int j = 0; j < R; ++j) {
    r[j] = w + (n + j) * K;
    total[j] = _mm256_setzero_ps();
    tail[j] = 0.f;
  }
  for (i64 g = 0; g < groups; ++g) {
    __m256 part[R];
    float part_tail[R];
    for (int j = 0; j < R; ++j) {
      part[j] = _mm256_setzero_ps();
      part_tail[j] = 0.f;
    }
    const i64 k1 = (g + 1) * group;
    i64 k = g * group;
    for (; k + 8 <= k1; k += 8) {
      if (((k * static_cast<i64>(sizeof(W))) & 63) == 0)  // the next rows
        for (int j = 0; j < R; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(r[j] + R * K + k), _MM_HINT_T0);
      const __m256 xv = _mm256_loadu_ps(xm + k);
      for (int j = 0; j < R; ++j) part[j] = _mm256_fmadd_ps(xv, load8(r[j] + k), part[j]);
    }
    for (; k < k1; ++k)
      for (int j = 0; j < R; ++j) part_tail[j] += xm[k] * to_float(r[j][k]);
    for (int j = 0; j < R; ++j) {
      const float sc = SCALED ? s[(n + j) * groups + g] : 1.f;
      total[j] = _mm256_fmadd_ps(part[j], _mm256_set1_ps(sc), total[j]);
      tail[j] += part_tail[j] * sc;
    }
  }
  for (int j = 0; j < R; ++j) outm[n + j] = hsum(total[j]) + tail[j];
}
#endif  // CW_AVX2

// Columns (k-major) or rows (n-major) [n0, n1) of the output, all M rows;
// `acc` holds M * (n1 - n0) floats.
template <bool SCALED, class W>
void compute(const float* x, const W* w, const float* s, float* out,
             float* acc, i64 M, i64 K, i64 N, i64 group, bool nmajor, i64 n0,
             i64 n1) {
#ifdef CW_AVX2
  if (!nmajor) {
    kmajor_cols<SCALED>(x, w, s, out, acc, M, K, N, group, n0, n1);
    return;
  }
  // Weight rows outermost: a block of four rows is read from memory once
  // and from L1 for every further x row (x rows outermost read the whole
  // table M times: 16 decode rows of a tied 49152 x 576 table, 1.8 GB).
  i64 n = n0;
  for (; n + 4 <= n1; n += 4)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows<4, SCALED>(x + m * K, w, s, out + m * N, K, group, n);
  for (; n < n1; ++n)
    for (i64 m = 0; m < M; ++m)
      nmajor_rows<1, SCALED>(x + m * K, w, s, out + m * N, K, group, n);
#else
  (void)acc;
  scalar_rows<SCALED>(x, w, s, out, M, K, N, group, nmajor, n0, n1);
#endif
}

// Blocks claimed from a shared counter by the caller and pool threads.
struct Job {
  std::function<void(i64)> body;
  i64 total = 0;
  std::atomic<i64> next{0};
  std::atomic<i64> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void work() {
    for (i64 b; (b = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      body(b);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

void parallel_for(ffi::ThreadPool& pool, i64 total,
                  std::function<void(i64)> body) {
  auto job = std::make_shared<Job>();
  job->body = std::move(body);
  job->total = total;
  // The caller works too: pool threads - 1 helpers keep one worker per
  // core (one more oversubscribes the cores and was slower).
  const i64 helpers = std::min<i64>(pool.num_threads() - 1, total - 1);
  // A task that starts after the caller finished finds no block left; it
  // holds the job, never the caller's buffers.
  for (i64 i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
  job->work();
  // A short spin (a helper is usually about to finish), then block: other
  // programs (another device's shard, another process) may need the cores.
  for (int i = 0; i < 256; ++i) {
    if (job->done.load(std::memory_order_acquire) == total) return;
    std::this_thread::yield();
  }
  std::unique_lock<std::mutex> lock(job->mu);
  job->finished.wait(lock, [&] {
    return job->done.load(std::memory_order_acquire) == total;
  });
}

template <class W>
void run(ffi::ThreadPool& pool, const float* x, const W* w, const float* s,
         float* out, i64 M, i64 K, i64 N, i64 group, bool nmajor) {
  const bool scaled = s != nullptr;
  const i64 threads = std::max<i64>(1, pool.num_threads());
  // Two blocks per thread; k-major blocks are multiples of 8 columns whose
  // accumulators (M rows) stay within 64 KB.
  i64 block = (N + 2 * threads - 1) / (2 * threads);
  if (!nmajor) {
    block = std::min<i64>((block + 7) / 8 * 8, std::max<i64>(8, 16384 / M / 8 * 8));
  }
  block = std::max<i64>(block, 1);
  const i64 blocks = (N + block - 1) / block;
  parallel_for(pool, blocks, [=](i64 b) {
    const i64 n0 = b * block, n1 = std::min(N, n0 + block);
    // k-major accumulators: one buffer per thread, grown, never freed
    // between calls (at most 64 KB, see above).
    thread_local std::vector<float> acc;
    if (!nmajor && acc.size() < static_cast<size_t>(M * (n1 - n0)))
      acc.resize(M * (n1 - n0));
    if (scaled)
      compute<true>(x, w, s, out, acc.data(), M, K, N, group, nmajor, n0, n1);
    else
      compute<false>(x, w, s, out, acc.data(), M, K, N, group, nmajor, n0, n1);
  });
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                  ffi::AnyBuffer w, ffi::Buffer<ffi::F32> scale,
                  ffi::ResultBuffer<ffi::F32> out, int64_t nmajor) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  auto sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument("x, w and scale must be 2-D");
  const i64 M = xd[0], K = xd[1];
  const i64 N = nmajor ? wd[0] : wd[1];
  const i64 G = nmajor ? sd[1] : sd[0];
  if ((nmajor ? wd[1] : wd[0]) != K || (nmajor ? sd[0] : sd[1]) != N ||
      G <= 0 || K % G != 0)
    return ffi::Error::InvalidArgument("x, w and scale shapes disagree");
  const float* s = scale.typed_data();
  // A float weight passes one group of ones: no scaling to do.
  const bool ones = G == 1 && w.element_type() != ffi::DataType::S8;
  const float* sp = ones ? nullptr : s;
  const i64 group = K / G;
  float* o = out->typed_data();
  switch (w.element_type()) {
    case ffi::DataType::S8:
      run(pool, x.typed_data(), static_cast<const int8_t*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    case ffi::DataType::BF16:
      run(pool, x.typed_data(), static_cast<const uint16_t*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    case ffi::DataType::F32:
      run(pool, x.typed_data(), static_cast<const float*>(w.untyped_data()),
          sp, o, M, K, N, group, nmajor);
      break;
    default:
      return ffi::Error::InvalidArgument("w must be int8, bf16 or f32");
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ChunkwiseMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("nmajor"));
