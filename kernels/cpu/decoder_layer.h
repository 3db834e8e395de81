// A whole Llama-family decoder layer for a step of decoding rows (one token each) as one
// call: the same kernels in the same order as the layer's Python path (norm, QKV, rotary, KV
// write, paged attention, O, residual norm, gate/up, SiLU, down), so the same bits. At a few
// rows a layer's eleven kernels and ~20 tensor views cost more to dispatch from Python (~100 us
// a layer on the 2-core AVX2 machine) than most of them take to run; from C++ the views cost a
// few hundred ns.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "activation.h"
#include "cache.h"
#include "decode_attention.h"
#include "linear.h"
#include "norm.h"
#include "rotary.h"

namespace llmkit_cpu {

// x [rows, hidden]: the previous layer's output (or, with first, the embeddings). residual
// [rows, hidden] is updated in place (with first it is x itself: the stream starts there).
// The QKV weight stacks num_heads query heads, then num_kv_heads key and value heads.
// Returns the MLP's output; the next layer (or the final norm) adds it to the residual.
inline at::Tensor llama_decode_layer(
    const at::Tensor& x, at::Tensor& residual, bool first, const at::Tensor& input_norm,
    const at::Tensor& qkv_weight, const std::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o_weight, const std::optional<at::Tensor>& o_bias,
    const at::Tensor& post_norm, const at::Tensor& gate_up_weight,
    const std::optional<at::Tensor>& gate_up_bias, const at::Tensor& down_weight,
    const std::optional<at::Tensor>& down_bias, double eps, const at::Tensor& cos_sin,
    at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& seq_lens, int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
              qkv_weight.size(0) % (num_heads + 2 * num_kv_heads) == 0,
              "llama_decode_layer: the QKV weight's rows must be (num_heads + 2 num_kv_heads) "
              "heads");
  const int64_t rows = x.size(0);
  const int64_t head_dim = qkv_weight.size(0) / (num_heads + 2 * num_kv_heads);
  const at::Tensor h = first ? rms_norm(x, input_norm, eps)
                             : fused_add_rms_norm(x, residual, input_norm, eps);
  const at::Tensor qkv = linear(h, qkv_weight, qkv_bias);
  // Q and K rotate together: their heads sit side by side at the start of each row.
  at::Tensor qk = qkv.narrow(1, 0, (num_heads + num_kv_heads) * head_dim)
                      .view({rows, num_heads + num_kv_heads, head_dim});
  rotary_embedding_(qk, cos_sin);
  const at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * head_dim,
                                  num_kv_heads * head_dim)
                           .view({rows, num_kv_heads, head_dim});
  reshape_and_cache(qk.narrow(1, num_heads, num_kv_heads), v, kv_cache, slot_mapping);
  const at::Tensor o = paged_decode_attention(qk.narrow(1, 0, num_heads), kv_cache,
                                              block_table, seq_lens, scale);
  const at::Tensor attn = linear(o.view({rows, num_heads * head_dim}), o_weight, o_bias);
  const at::Tensor h2 = fused_add_rms_norm(attn, residual, post_norm, eps);
  return linear(silu_and_mul(linear(h2, gate_up_weight, gate_up_bias)), down_weight, down_bias);
}

}  // namespace llmkit_cpu
