// The linears' run-time tuning: values that change how fast they run and never what they
// compute, so that the platform can time candidates at first start and keep the fastest
// (llmkit.kernels.cpu_calibration; llmkit.config.cpu_dispatch holds the tier defaults).
//  - prefetch distance: how far ahead of the block being read the weight is prefetched;
//    prefetches only warm the cache.
//  - the minimum weight bytes one thread streams: threads split a linear's output features
//    into contiguous runs, and each output is one thread's fixed chain of sums, so how many
//    threads share a weight changes no output; a small weight on fewer threads saves waking
//    them.
// One value per loaded library (each tier's build keeps its own; internal linkage), set by
// ``set_linear_tuning`` between calls, read with relaxed loads (a plain load on x86).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace llmkit_cpu::tuning {

namespace {
// The defaults of every tier (CpuDispatch.linear_prefetch_bytes / linear_thread_min_bytes).
std::atomic<int64_t> g_prefetch_bytes{2048};
std::atomic<int64_t> g_thread_min_bytes{8192};
}  // namespace

inline int64_t prefetch_bytes() { return g_prefetch_bytes.load(std::memory_order_relaxed); }

// at::parallel_for's grain for a weight of ``units`` parts of ``unit_bytes`` each: every
// thread's run is at least the minimum bytes (one part at least).
inline int64_t grain(int64_t unit_bytes) {
  const int64_t min_bytes = g_thread_min_bytes.load(std::memory_order_relaxed);
  return std::max<int64_t>(1, min_bytes / std::max<int64_t>(unit_bytes, 1));
}

inline void set_linear_tuning(int64_t prefetch, int64_t thread_min_bytes) {
  TORCH_CHECK(prefetch >= 0 && thread_min_bytes >= 0,
              "set_linear_tuning: prefetch and thread_min_bytes must be >= 0");
  g_prefetch_bytes.store(prefetch, std::memory_order_relaxed);
  g_thread_min_bytes.store(thread_min_bytes, std::memory_order_relaxed);
}

inline std::vector<int64_t> linear_tuning() {
  return {g_prefetch_bytes.load(), g_thread_min_bytes.load()};
}

}  // namespace llmkit_cpu::tuning
