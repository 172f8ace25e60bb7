// An MoE layer's chosen experts for a few rows in one op (moe.py's op-by-op path made from C++, as
// decode_layer.cpp does for a dense layer): per row, its top-k experts in rank order, each one's gate_up by
// qgemv_packed, SiLU or GELU(tanh) x up, down by qgemv_packed, times its router weight, added in rank order. The
// same functions on the same tensors as the op-by-op path, so the same bits (a packed GEMV gives a row the same
// bits at any row count; the weighted sum is the same elementwise sequence); one dispatch a layer instead of ~30
// (benchmarks/results/moe_a3b.md: 7.5 ms of a 26 ms decode step went to the calls around the GEMVs).
//
//   x         fp32 [T, H]    the normed residual rows
//   gate_up   per expert, its packed [2I, H] (tandem.pack_gemv); gu_qtype their ggml type (one for all)
//   down      per expert, its packed [H, I]; down_qtype their type
//   inter     I, the expert width
//   ids       int64 [T, k]   each row's experts by rank; weights fp32 [T, k] their router weights
//   act       0 SiLU, 1 GELU(tanh)
//   isa       the body of its GEMVs and activation (-1: the best here; tests force each)
//   returns   fp32 [T, H]
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include "ops.h"

namespace tandem {

at::Tensor moe_experts(const at::Tensor& x, at::TensorList gate_up, int64_t gu_qtype, at::TensorList down,
                       int64_t down_qtype, int64_t inter, const at::Tensor& ids, const at::Tensor& weights,
                       int64_t act, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "tandem.moe_experts: x must be fp32 [T, H]");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "tandem.moe_experts: ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "tandem.moe_experts: weights must be fp32 [T, k] like ids");
  TORCH_CHECK(gate_up.size() == down.size() && !gate_up.empty(), "tandem.moe_experts: one gate_up and down an expert");
  TORCH_CHECK(act == 0 || act == 1, "tandem.moe_experts: act must be 0 (silu) or 1 (gelu_tanh)");
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1), E = (int64_t)gate_up.size();
  const at::Tensor idc = ids.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < T * k; ++i)
    TORCH_CHECK(idp[i] >= 0 && idp[i] < E, "tandem.moe_experts: expert id ", idp[i], " out of [0, ", E, ")");
  at::Tensor out = at::empty({T, H}, x.options());
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor row = x.narrow(0, t, 1), w = weights.narrow(0, t, 1);
    at::Tensor sum;
    for (int64_t r = 0; r < k; ++r) {
      const int64_t e = idp[t * k + r];
      at::Tensor gu, a, y;
      {
        RECORD_FUNCTION("tandem::qgemv_packed", std::vector<c10::IValue>());
        gu = qgemv_packed(row, gate_up[e], gu_qtype, H, 2 * inter, std::nullopt, isa);
      }
      {
        RECORD_FUNCTION(act == 0 ? "tandem::silu_mul" : "tandem::gelu_tanh_mul", std::vector<c10::IValue>());
        a = act == 0 ? silu_mul(gu, isa) : gelu_tanh_mul(gu, isa);
      }
      {
        RECORD_FUNCTION("tandem::qgemv_packed", std::vector<c10::IValue>());
        y = qgemv_packed(a, down[e], down_qtype, inter, H, std::nullopt, isa);
      }
      const at::Tensor part = at::mul(y, w.narrow(1, r, 1));
      sum = r == 0 ? part : at::add(sum, part);
    }
    out.narrow(0, t, 1).copy_(sum);
  }
  return out;
}

}  // namespace tandem
