// One decoder layer of a pure decode step in one op (issue 17's per-step overhead): the layer's nine torch
// calls (norms, the four quantized linears, RoPE, the fused K/V write + attention, SiLU x up) made from C++,
// so a batch-1 step of a 30-layer model dispatches 30 ops for its layers instead of ~270. Each call is the
// same function the op of that name runs, on the same tensors, so the result is bit for bit the op-by-op
// layer's (tests/kernels/test_kernels.py compares them). Each call runs in a profiler scope named as its op, so a
// torch.profiler table (benchmarks/decode_profile.py) still splits the layer by op; the scopes cost a flag
// check when no profiler runs.
//
//   x        fp32 [B, E]         the residual stream, updated in place (x += delta, then x += o)
//   delta    fp32 [B, E] or none the previous layer's MLP output, still to add (none for layer 0)
//   w        [qkv, o, gate_up, down] GGUF blocks (QuantWeight.data), qtypes their ggml types; qkv may be three
//            weights [q, k, v] of different block types (Q4_K_M's Q6_K attn_v), whose outputs are concatenated
//   packed   per entry of w, its repacked copy (tandem.pack_gemv; an empty tensor: none), run by gemv_packed_q8act
//            up to gemv_packed_q8act_max_rows() rows (the same bits as linear_rows_q8act)
//   int8     whether a linear of an integer block type rounds its input to int8 (kernels_act="int8")
//   qk_norm  fp32 [H + KVH, D] or none: Qwen3's QK-norm (head_rms_norm_ on the fused qkv before RoPE)
//   mlp      false: w is [qkv, o] or [q, k, v, o] and the op returns the MLP's normed input instead (an MoE layer,
//            whose experts run after it: moe.py)
//   returns  fp32 [B, E]         this layer's MLP output (the next layer's delta), or with mlp false its input
// The rest as decode_attention_qkv_ (cache, layer, loc, kv_index, seq_lens, scale, heads, bf16_products) and
// rope_ (cos, sin, positions; RoPE on heads + kv_heads heads of head_dim).
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "ops.h"
#include "vec.h"

namespace tandem {

static bool int8_type(int64_t qtype) { return qtype == 2 || qtype == 3 || (qtype >= 6 && qtype <= 8) ||
                                              (qtype >= 10 && qtype <= 14); }  // linear_rows_q8act's types

at::Tensor decode_layer_(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& attn_norm,
                         const at::Tensor& mlp_norm, double eps, at::TensorList w, at::IntArrayRef qtypes,
                         at::TensorList packed, const std::optional<at::Tensor>& qkv_bias, bool int8, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& positions, int64_t heads, int64_t kv_heads,
                         int64_t head_dim, const at::Tensor& cache, int64_t layer, const at::Tensor& loc,
                         const at::Tensor& kv_index, const at::Tensor& seq_lens, double scale, bool bf16_products,
                         const std::optional<at::Tensor>& qk_norm, bool mlp) {
  const size_t tail = mlp ? 3 : 1;                                      // o (, gate_up, down)
  TORCH_CHECK((w.size() == tail + 1 || w.size() == tail + 3) && qtypes.size() == w.size() && packed.size() == w.size(),
              "tandem.decode_layer_: w, qtypes and packed are [qkv, o, gate_up, down] or [q, k, v, o, gate_up, down]",
              " (mlp false: without gate_up and down)");
  const int nq = (int)(w.size() - tail);                                // parts of the qkv projection
  auto lin = [&](const at::Tensor& in, int i, const std::optional<at::Tensor>& bias) {
    if (int8 && packed[i].numel() && in.size(0) <= gemv_packed_q8act_max_rows(qtypes[i])) {
      RECORD_FUNCTION("tandem::gemv_packed_q8act", std::vector<c10::IValue>());
      return gemv_packed_q8act(in, packed[i], qtypes[i], in.size(1), w[i].size(0), bias, -1);
    }
    if (int8 && int8_type(qtypes[i])) {
      RECORD_FUNCTION("tandem::linear_rows_q8act", std::vector<c10::IValue>());
      return linear_rows_q8act(in, w[i], qtypes[i], in.size(1), bias, -1);
    }
    RECORD_FUNCTION("tandem::linear_rows", std::vector<c10::IValue>());
    return linear_rows(in, w[i], qtypes[i], in.size(1), bias, -1);
  };
  at::Tensor h;
  {
    RECORD_FUNCTION(delta.has_value() ? "tandem::add_rms_norm_" : "tandem::rms_norm", std::vector<c10::IValue>());
    h = delta.has_value() ? add_rms_norm_(x, *delta, attn_norm, eps) : rms_norm(x, attn_norm, eps);
  }
  at::Tensor qkv;                                                       // [B, (H + 2 KVH) D]
  if (nq == 1) {
    qkv = lin(h, 0, qkv_bias);
  } else {                                  // as QLinear does: each part on its blocks, concatenated, + bias
    std::vector<at::Tensor> parts;
    for (int i = 0; i < nq; ++i) parts.push_back(lin(h, i, std::nullopt));
    qkv = at::cat(parts, 1);
    if (qkv_bias.has_value()) qkv.add_(*qkv_bias);
  }
  if (qk_norm.has_value()) {
    RECORD_FUNCTION("tandem::head_rms_norm_", std::vector<c10::IValue>());
    head_rms_norm_(qkv, *qk_norm, eps);
  }
  {
    RECORD_FUNCTION("tandem::rope_", std::vector<c10::IValue>());
    rope_(qkv, cos, sin, positions, heads + kv_heads, head_dim);
  }
  at::Tensor attn;
  {
    RECORD_FUNCTION("tandem::decode_attention_qkv_", std::vector<c10::IValue>());
    // global layers only (window 0)
    attn = decode_attention_qkv_(qkv, cache, layer, loc, kv_index, seq_lens, scale, heads, -1, -1, 0, bf16_products);
  }
  at::Tensor o = lin(attn, nq, std::nullopt);
  {
    RECORD_FUNCTION("tandem::add_rms_norm_", std::vector<c10::IValue>());
    h = add_rms_norm_(x, o, mlp_norm, eps);
  }
  if (!mlp) return h;
  at::Tensor gu = lin(h, nq + 1, std::nullopt), act;
  {
    RECORD_FUNCTION("tandem::silu_mul", std::vector<c10::IValue>());
    act = silu_mul(gu);
  }
  return lin(act, nq + 2, std::nullopt);
}

}  // namespace tandem
