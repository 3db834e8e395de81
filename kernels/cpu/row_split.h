// How many rows an element-wise row op (norms, SiLU-and-mul, rotary, activation quantization)
// gives one thread. A parallel region costs a wake-up of the other threads: under llmkit's
// short OpenMP spin (GOMP_SPINCOUNT=1000) they sleep between a step's ops, and waking them
// costs about as much as one such op on 64 rows x 576 (docs/cpu-speed.md, "Workload A"). So a
// region opens only where each thread gets enough elements to pay for it: a 64-row decode
// step's ops run on the calling thread, a prefill chunk's still split. Rows are computed one
// by one, so the split changes no bits.
#pragma once

#include <algorithm>
#include <cstdint>

namespace llmkit_cpu {

constexpr int64_t kMinTaskElements = int64_t(1) << 17;

// at::parallel_for's grain for rows of row_elements elements each.
inline int64_t row_split_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kMinTaskElements / std::max<int64_t>(row_elements, 1));
}

}  // namespace llmkit_cpu
