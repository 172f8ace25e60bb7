// One decoder layer of a pure decode step in one op (issue 17's per-step overhead): the layer's nine torch
// calls (norms, the four quantized linears, RoPE, the fused K/V write + attention, SiLU x up) made from C++,
// so a batch-1 step of a 30-layer model dispatches 30 ops for its layers instead of ~270. Each call is the
// same function the op of that name runs, on the same tensors, so the result is bit for bit the op-by-op
// layer's (tests/test_kernels.py compares them).
//
//   x        fp32 [B, E]         the residual stream, updated in place (x += delta, then x += o)
//   delta    fp32 [B, E] or none the previous layer's MLP output, still to add (none for layer 0)
//   w        [qkv, o, gate_up, down] GGUF blocks (QuantWeight.data), qtypes their ggml types
//   int8     whether a linear of an integer block type rounds its input to int8 (kernels_act="int8")
//   returns  fp32 [B, E]         this layer's MLP output (the next layer's delta)
// The rest as decode_attention_qkv_ (cache, layer, loc, kv_index, seq_lens, scale, heads) and rope_ (cos,
// sin, positions; RoPE on heads + kv_heads heads of head_dim).
#include <ATen/ATen.h>

#include "vec.h"

namespace tandem {

at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                   const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor qlinear_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                      const std::optional<at::Tensor>& bias, int64_t isa);
at::Tensor decode_attention_qkv_(const at::Tensor& qkv, const at::Tensor& cache, int64_t layer, const at::Tensor& loc,
                                 const at::Tensor& kv_index, const at::Tensor& seq_lens, double scale, int64_t heads,
                                 int64_t isa, int64_t chunk_keys);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps);
at::Tensor silu_mul(const at::Tensor& gu);
void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
           int64_t heads, int64_t D);

static bool int8_type(int64_t qtype) { return qtype == 2 || qtype == 3 || (qtype >= 6 && qtype <= 8) ||
                                              (qtype >= 10 && qtype <= 14); }  // qlinear_q8's types

at::Tensor decode_layer_(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& attn_norm,
                         const at::Tensor& mlp_norm, double eps, at::TensorList w, at::IntArrayRef qtypes,
                         const std::optional<at::Tensor>& qkv_bias, bool int8, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& positions, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const at::Tensor& cache, int64_t layer, const at::Tensor& loc,
                         const at::Tensor& kv_index, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(w.size() == 4 && qtypes.size() == 4, "tandem.decode_layer_: w and qtypes are [qkv, o, gate_up, down]");
  auto lin = [&](const at::Tensor& in, int i, const std::optional<at::Tensor>& bias) {
    return int8 && int8_type(qtypes[i]) ? qlinear_q8(in, w[i], qtypes[i], in.size(1), bias, -1)
                                        : qlinear(in, w[i], qtypes[i], in.size(1), bias, -1);
  };
  at::Tensor h = delta.has_value() ? add_rms_norm_(x, *delta, attn_norm, eps) : rms_norm(x, attn_norm, eps);
  at::Tensor qkv = lin(h, 0, qkv_bias);                                  // [B, (H + 2 KVH) D]
  rope_(qkv, cos, sin, positions, heads + kv_heads, head_dim);
  at::Tensor attn = decode_attention_qkv_(qkv, cache, layer, loc, kv_index, seq_lens, scale, heads, -1, -1);
  h = add_rms_norm_(x, lin(attn, 1, std::nullopt), mlp_norm, eps);
  return lin(silu_mul(lin(h, 2, std::nullopt)), 3, std::nullopt);
}

}  // namespace tandem
