// Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax as one more "key"
// with no value. For scaled scores s_j and sink logit sigma (not scaled):
//   p_j = exp(s_j - m) / (sum_j exp(s_j - m) + exp(sigma - m)),  m = max(max_j s_j, sigma),  out = sum_j p_j v_j
// (transformers' gpt-oss eager attention). A sink is not a key position: a sliding window never drops it.
//
// Every op folds it into its softmax's final state only (after its last key, before the division), as one more
// state of max sigma, sum 1 and output 0: so the keys' summation order, chunks and merges are untouched, a call
// without sinks runs exactly the code it ran before, and a sink of -inf gives the sink-free bits. The decode op
// (unsplit rows and merge_head) and the causal op (write_columns) finish a head by the one finish_head below, so
// with sinks a prompt token still gets exactly its decode row's bits. Its exp is std::exp (one function for every
// ISA body and both ops; two calls a head, nothing to vectorize).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <optional>

namespace tandem {

// The sink folded into a head's final state (max M, sum L of exp(s_j - M)): L becomes the sum over the keys and
// the sink against M' = max(M, sink), and the returned a = exp(M - M') is the rescale of the output (1 where the
// max stays; then L gains exp(sink - M) alone). A sink of -inf leaves L as it was and returns 1.
inline float fold_sink(float M, float& L, float sink) {
  const float Mn = std::max(M, sink);
  const float a = M == Mn ? 1.f : std::exp(M - Mn), b = sink == Mn ? 1.f : std::exp(sink - Mn);
  L = std::fma(L, a, b);
  return a;
}

// A head's output from its final state: out[d] = O[d os] / L; with a sink (non-null), O[d os] a / L' (fold_sink).
// out may be O itself (os = 1).
inline void finish_head(const float* O, int64_t os, float M, float L, const float* sink, int64_t D, float* out) {
  if (!sink) {
    for (int64_t d = 0; d < D; ++d) out[d] = O[d * os] / L;
    return;
  }
  const float a = fold_sink(M, L, *sink);
  for (int64_t d = 0; d < D; ++d) out[d] = O[d * os] * a / L;
}

// An op's sinks argument checked (fp32 [H], one per query head) and its data, or nullptr without one.
inline const float* sink_data(const std::optional<at::Tensor>& sinks, int64_t H, const char* op) {
  if (!sinks.has_value()) return nullptr;
  const at::Tensor& s = *sinks;
  TORCH_CHECK(s.dim() == 1 && s.size(0) == H && s.scalar_type() == at::kFloat && s.is_contiguous(), op,
              ": sinks must be a contiguous fp32 [H] tensor, one logit per query head");
  return s.data_ptr<float>();
}

}  // namespace tandem
