// The kernels' own threads: llmkit_cpu::parallel_for, at::parallel_for's contract (the same
// chunks: ceil(range / threads) elements each, at least the grain), run by a pool that waits
// for the next call spinning and yielding the core, then asleep.
//
// Why not at::parallel_for: a batch-1 decode step calls ~150 parallel kernels with a few
// microseconds of other work (the step graph's glue, small ops) between them. Under OpenMP's
// short spin (GOMP_SPINCOUNT=1000, which llmkit sets so that a process sharing the cores is
// not starved by spinning threads) the other thread is asleep at every call and each call
// pays a futex wake-up; a long spin keeps it awake but takes the core from anything sharing
// it. Spinning with sched_yield() has both: a core nobody else wants stays with the waiting
// worker, one that another process wants goes to it. Chunks are claimed, not assigned: a
// worker that has not woken yet (its core busy elsewhere) does not hold up the call; the
// caller runs what is unclaimed. Each chunk is the same range whichever thread runs it, so
// the pool changes no output's bits.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>

namespace llmkit_cpu {

// Internal linkage: each tier's library (several may be loaded in one process) keeps its own.
namespace {
namespace pool_detail {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// How long an idle worker stays awake (CpuDispatch.thread_pool_spin_us, set by the platform:
// longer than the gaps inside a decode step and the engine's own work between two steps,
// short enough that an idle server's threads sleep); 0: at::parallel_for on torch's threads.
std::atomic<int64_t> g_spin_us{2000};

class Pool {
 public:
  // Runs f(chunk_begin, chunk_end) over [begin, end) in `chunks` chunks of `chunk` elements.
  template <typename F>
  void run(int64_t begin, int64_t end, int64_t chunk, int64_t chunks, const F& f) {
    ensure_workers(chunks - 1);
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    ctx_ = &f;
    call_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    done_.store(0, std::memory_order_relaxed);
    error_ = nullptr;
    const uint64_t gen = (claim_.load(std::memory_order_relaxed) >> 32) + 1;
    claim_.store((gen << 32) | (uint64_t(chunks) << 16), std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(uint32_t(gen));
    for (int64_t spins = 0; done_.load(std::memory_order_acquire) < chunks; ++spins) {
      cpu_relax();
      if ((spins & 255) == 255) sched_yield();
    }
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void ensure_workers(int64_t wanted) {
    for (; workers_ < wanted; ++workers_) {
      const uint32_t gen = uint32_t(claim_.load(std::memory_order_relaxed) >> 32);
      std::thread thread([this, gen] { worker(gen); });
      // Named here, not by the thread when it first runs: it has its name from the start.
      pthread_setname_np(thread.native_handle(), "llmkit-kernels");
      thread.detach();
    }
  }

  // Claims and runs chunks of call `gen` until none is left (or another call began).
  void work(uint32_t gen) {
    uint64_t c = claim_.load(std::memory_order_acquire);
    for (;;) {
      if (uint32_t(c >> 32) != gen) return;
      const int64_t index = int64_t(c & 0xffff), chunks = int64_t((c >> 16) & 0xffff);
      if (index >= chunks) return;
      if (!claim_.compare_exchange_weak(c, c + 1, std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        continue;
      // The call cannot end before this chunk is done: its fields are this call's.
      const int64_t b = begin_ + index * chunk_;
      try {
        c10::ParallelGuard guard(true);
        call_(ctx_, b, std::min(end_, b + chunk_));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu_);
        if (!error_) error_ = std::current_exception();
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
      c = claim_.load(std::memory_order_acquire);
    }
  }

  void worker(uint32_t seen) {
    for (;;) {
      seen = wait_for_call(seen);
      work(seen);
    }
  }

  uint32_t wait_for_call(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::microseconds(g_spin_us.load(std::memory_order_relaxed));
    for (int64_t spins = 0;; ++spins) {
      const uint32_t gen = uint32_t(claim_.load(std::memory_order_acquire) >> 32);
      if (gen != seen) return gen;
      cpu_relax();
      if ((spins & 63) == 63) {
        if (std::chrono::steady_clock::now() > until) break;
        sched_yield();
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    cv_.wait(lock, [&] { return uint32_t(claim_.load(std::memory_order_seq_cst) >> 32) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return uint32_t(claim_.load(std::memory_order_acquire) >> 32);
  }

  // The call's generation (bits 32-63), its chunk count (16-31) and the next unclaimed chunk.
  std::atomic<uint64_t> claim_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  const void* ctx_ = nullptr;
  void (*call_)(const void*, int64_t, int64_t) = nullptr;
  std::exception_ptr error_;
  int64_t workers_ = 0;
  std::mutex mu_;
  std::condition_variable cv_;
};

// One pool per loaded library and process; a forked child starts a new one (the parent's
// workers are not in it). Never destroyed: detached workers may still wait on it at exit.
std::atomic<Pool*> g_pool{nullptr};
std::atomic<bool> g_busy{false};

inline Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
    static std::once_flag registered;
    std::call_once(registered, [] {
      pthread_atfork(nullptr, nullptr, [] {
        g_pool.store(nullptr);
        g_busy.store(false);
      });
    });
    p = new Pool();
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace pool_detail
}  // namespace

inline void set_thread_pool_spin_us(int64_t spin_us) {
  TORCH_CHECK(spin_us >= 0, "set_thread_pool_spin_us: spin_us must be >= 0");
  pool_detail::g_spin_us.store(spin_us, std::memory_order_relaxed);
}

inline int64_t thread_pool_spin_us() { return pool_detail::g_spin_us.load(); }

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (pool_detail::g_spin_us.load(std::memory_order_relaxed) == 0) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int64_t range = end - begin;
  const int64_t threads = at::get_num_threads();
  // A call from inside a chunk (ours or at::parallel_for's: both hold a ParallelGuard), or
  // from a second thread while one runs, runs here and now.
  if (range <= grain || range == 1 || threads <= 1 || c10::ParallelGuard::is_enabled() ||
      at::in_parallel_region() || pool_detail::g_busy.exchange(true, std::memory_order_acquire)) {
    c10::ParallelGuard guard(true);
    f(begin, end);
    return;
  }
  const int64_t min_chunk = std::max<int64_t>(grain, 1);
  // The chunk count fits the claim word's 16 bits.
  const int64_t used = std::min<int64_t>({threads, (range + min_chunk - 1) / min_chunk, 0xffff});
  const int64_t chunk = (range + used - 1) / used;
  const int64_t chunks = (range + chunk - 1) / chunk;
  struct Release {
    ~Release() { pool_detail::g_busy.store(false, std::memory_order_release); }
  } release;
  pool_detail::pool().run(begin, end, chunk, chunks, f);
}

}  // namespace llmkit_cpu
