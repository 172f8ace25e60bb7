// An MoE layer's chosen experts for a few rows in one op (moe.py's op-by-op path made from C++, as
// decode_layer.cpp does for a dense layer): per row, its top-k experts in rank order, each one's gate_up by
// the packed GEMV, SiLU or GELU(tanh) x up, down by the packed GEMV, times its router weight, added in rank order.
// The same kernels on the same tensors as the op-by-op path, so the same bits (a packed GEMV gives a row the same
// bits at any row count; the weighted sum is the same elementwise sequence); one dispatch a layer instead of ~30
// (benchmarks/results/moe_a3b.md: 7.5 ms of a 26 ms decode step went to the calls around the GEMVs).
// All T k gate_ups run in one thread split, then all downs (gemv_packed_q8act_jobs): two parallel regions a layer,
// not two an expert, each thread streaming whole experts (Qwen3-30B-A3B's shape: 1.6-1.75 -> 1.26-1.38 ms a
// layer with the experts streamed from memory, the stacked tensors below included).
//
//   x         fp32 [T, H]    the normed residual rows
//   gate_up   uint8 [E, groups, bytes]: each expert's packed [2I, H] (tandem.pack_gemv), stacked (one tensor, not
//             a list of E: passing 2 x 128 tensors through the dispatcher took ~60 us a call); gu_qtype their type
//   down      uint8 [E, groups, bytes]: each expert's packed [H, I], stacked; down_qtype their type
//   inter     I, the expert width
//   ids       int64 [T, k]   each row's experts by rank; weights fp32 [T, k] their router weights
//   act       0 SiLU, 1 GELU(tanh)
//   isa       the body of its GEMVs and activation (-1: the best here; tests force each)
//   returns   fp32 [T, H]
#include <ATen/ATen.h>
#include <ATen/record_function.h>

#include <vector>

#include "ops.h"

namespace tandem {

at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& gate_up, int64_t gu_qtype, const at::Tensor& down,
                       int64_t down_qtype, int64_t inter, const at::Tensor& ids, const at::Tensor& weights,
                       int64_t act, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "tandem.moe_experts: x must be fp32 [T, H]");
  TORCH_CHECK(ids.dim() == 2 && ids.scalar_type() == at::kLong && ids.size(0) == x.size(0),
              "tandem.moe_experts: ids must be int64 [T, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat,
              "tandem.moe_experts: weights must be fp32 [T, k] like ids");
  TORCH_CHECK(gate_up.dim() == 3 && down.dim() == 3 && gate_up.size(0) == down.size(0) && gate_up.size(0) > 0,
              "tandem.moe_experts: gate_up and down must be the experts' packed copies stacked, [E, groups, bytes]");
  TORCH_CHECK(act == 0 || act == 1, "tandem.moe_experts: act must be 0 (silu) or 1 (gelu_tanh)");
  const int64_t T = x.size(0), k = ids.size(1), H = x.size(1);
  const at::Tensor idc = ids.contiguous(), wc = weights.contiguous(), xc = x.contiguous();
  const int64_t* idp = idc.data_ptr<int64_t>();
  const std::vector<int64_t> jobs(idp, idp + T * k);   // job t k + r: row t's expert of rank r (ids checked there)
  at::Tensor gu = at::empty({T * k, 2 * inter}, x.options()), y = at::empty({T * k, H}, x.options());
  {
    RECORD_FUNCTION("tandem::gemv_packed_q8act", std::vector<c10::IValue>());
    gemv_packed_q8act_jobs(xc, gate_up, jobs, k, gu_qtype, H, 2 * inter, gu.data_ptr<float>(), isa);   // x row t: k jobs
  }
  at::Tensor a;
  {
    RECORD_FUNCTION(act == 0 ? "tandem::silu_mul" : "tandem::gelu_tanh_mul", std::vector<c10::IValue>());
    a = act == 0 ? silu_mul(gu, isa) : gelu_tanh_mul(gu, isa);
  }
  {
    RECORD_FUNCTION("tandem::gemv_packed_q8act", std::vector<c10::IValue>());
    gemv_packed_q8act_jobs(a, down, jobs, 1, down_qtype, inter, H, y.data_ptr<float>(), isa);
  }
  // A row's outputs times their weights, added in rank order: each product rounded, then each sum, as at::mul
  // then at::add compute them (no fma: this function is built for the baseline x86-64, which has none to contract
  // into; the test against the op-by-op composition would see one).
  at::Tensor out = at::empty({T, H}, x.options());
  const float *yp = y.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    float* o = op + t * H;
    const float* yt = yp + t * k * H;
    const float w0 = wp[t * k];
    for (int64_t h = 0; h < H; ++h) o[h] = yt[h] * w0;
    for (int64_t r = 1; r < k; ++r) {
      const float wr = wp[t * k + r];
      for (int64_t h = 0; h < H; ++h) o[h] = o[h] + yt[r * H + h] * wr;
    }
  }
  return out;
}

}  // namespace tandem
