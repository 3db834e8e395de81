// llmkit's CPU kernels, registered as torch.ops.<LLMKIT_OPS>.* (llmkit_cpu_<tier>: one library
// per instruction-set tier, llmkit.kernels.cpu_isa): built on first use by
// llmkit.kernels.cpu_native (torch's C++ extension builder) and cached on disk.
#include <torch/library.h>

#include "activation.h"
#include "amx_bf16_linear.h"
#include "cache.h"
#include "decode_attention.h"
#include "linear.h"
#include "lora.h"
#include "mamba.h"
#include "mla_attention.h"
#include "norm.h"
#include "quant_activation.h"
#include "quant_linear.h"
#include "quant_repack.h"
#include "rotary.h"
#include "thread_pool.h"
#include "tuning.h"

#ifndef LLMKIT_OPS
#define LLMKIT_OPS llmkit_cpu_generic
#endif

TORCH_LIBRARY(LLMKIT_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // The amx tier's bf16 linear on AMX tiles (amx_bf16_linear.h): the weight repacked once.
  m.def("bf16_tile_pack(Tensor weight) -> Tensor");
  m.def("bf16_tile_linear(Tensor x, Tensor packed, int out_features, Tensor? bias) -> Tensor");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos_sin) -> ()");
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, int sliding_window=0, float soft_cap=0.0) -> Tensor");
  // Multi-head latent attention (mla_attention.h): the latent cache's write and decode rows.
  m.def("write_latent_cache(Tensor latent, Tensor(a!) latent_cache, Tensor slot_mapping) -> ()");
  m.def("mla_decode_attention(Tensor q_latent, Tensor q_pe, Tensor latent_cache, "
        "Tensor block_table, Tensor seq_lens, float scale) -> Tensor");
  m.def("lora_add_(Tensor(a!) y, Tensor x, Tensor lora_a, Tensor lora_b, Tensor row_slots, "
        "Tensor ranks, int[] out_offsets) -> ()");
  m.def("lora_embedding_add_(Tensor(a!) y, Tensor ids, Tensor lora_a, Tensor lora_b, "
        "Tensor row_slots, Tensor ranks) -> ()");
  m.def("ssm_state_update(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, "
        "Tensor dt_bias, Tensor(a!) ssm_state, Tensor state_indices, float dt_min, "
        "float dt_max) -> Tensor");
  // Quantized weights (quant_*.h): repack GGUF blocks / int8 / fp8 rows into the packed x8
  // layout, read it back as floats, and multiply with it.
  m.def("quant_repack(Tensor raw, str format, int in_features) -> Tensor");
  m.def("quant_dequantize(Tensor packed, str format, int out_features, int in_features, "
        "Tensor? scales=None, Tensor? rows=None) -> Tensor");
  m.def("quant_linear(Tensor x, Tensor packed, str format, int out_features, "
        "Tensor? scales=None, Tensor? bias=None, bool float_activations=False, "
        "bool portable=False) -> Tensor");
  m.def("quantize_activations_q8(Tensor x, bool portable=False) -> (Tensor, Tensor, Tensor)");
  // The linears' speed-only tuning (tuning.h): set by the platform, read back by tests.
  // (no tensor arguments: one implementation for every dispatch key)
  m.def("set_linear_tuning(int prefetch_bytes, int thread_min_bytes) -> ()",
        &llmkit_cpu::tuning::set_linear_tuning);
  m.def("linear_tuning() -> int[]", &llmkit_cpu::tuning::linear_tuning);
  // How long the kernels' idle threads spin before they sleep (0: torch's threads; thread_pool.h).
  m.def("set_thread_pool_spin_us(int spin_us) -> ()", &llmkit_cpu::set_thread_pool_spin_us);
  m.def("thread_pool_spin_us() -> int", &llmkit_cpu::thread_pool_spin_us);
}

TORCH_LIBRARY_IMPL(LLMKIT_OPS, CPU, m) {
  m.impl("rms_norm", &llmkit_cpu::rms_norm);
  m.impl("fused_add_rms_norm", &llmkit_cpu::fused_add_rms_norm);
  m.impl("silu_and_mul", &llmkit_cpu::silu_and_mul);
  m.impl("linear", &llmkit_cpu::linear);
  m.impl("bf16_tile_pack", &llmkit_cpu::amx_bf16::pack);
  m.impl("bf16_tile_linear", &llmkit_cpu::amx_bf16::linear);
  m.impl("rotary_embedding_", &llmkit_cpu::rotary_embedding_);
  m.impl("reshape_and_cache", &llmkit_cpu::reshape_and_cache);
  m.impl("paged_decode_attention", &llmkit_cpu::paged_decode_attention);
  m.impl("write_latent_cache", &llmkit_cpu::write_latent_cache);
  m.impl("mla_decode_attention", &llmkit_cpu::mla_decode_attention);
  m.impl("lora_add_", &llmkit_cpu::lora_add_);
  m.impl("lora_embedding_add_", &llmkit_cpu::lora_embedding_add_);
  m.impl("ssm_state_update", &llmkit_cpu::ssm_state_update);
  m.impl("quant_repack", &llmkit_cpu::quant::quant_repack);
  m.impl("quant_dequantize", &llmkit_cpu::quant::quant_dequantize);
  m.impl("quant_linear", &llmkit_cpu::quant::quant_linear);
  m.impl("quantize_activations_q8", &llmkit_cpu::quant::quantize_activations_q8);
}
