// `parallel_for(pool, total, body)`: body(0 .. total - 1) run by the
// calling thread and XLA's intra-op pool threads, each block claimed from a
// shared counter, so the call completes even if no pool thread ever runs
// its task. Shared by every kernel library (kernels.cc, portable.cc).

#ifndef CHUNKWISE_CPU_KERNELS_POOL_H_
#define CHUNKWISE_CPU_KERNELS_POOL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace chunkwise {

// Blocks claimed from a shared counter by the caller and pool threads.
struct Job {
  std::function<void(int64_t)> body;
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void work() {
    for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < total;) {
      body(b);
      if (done.fetch_add(1, std::memory_order_acq_rel) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
    }
  }
};

inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t total,
                  std::function<void(int64_t)> body) {
  auto job = std::make_shared<Job>();
  job->body = std::move(body);
  job->total = total;
  // The caller works too: pool threads - 1 helpers keep one worker per
  // core (one more oversubscribes the cores and was slower).
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, total - 1);
  // A task that starts after the caller finished finds no block left; it
  // holds the job, never the caller's buffers.
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([job] { job->work(); });
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

}  // namespace chunkwise

#endif  // CHUNKWISE_CPU_KERNELS_POOL_H_
