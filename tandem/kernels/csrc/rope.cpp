// rope_(qkv [T, C], cos [P, D], sin [P, D], positions [T], heads, D): rotate-half RoPE in place on the first
// `heads` heads of D of each row (q then k of the fused qkv projection), at each token's position. fp32, rows
// contiguous; thread split over rows. A plain loop (the compiler vectorizes it at the baseline ISA), as the
// RMSNorm ops (rms_norm.cpp): memory-light, it exists to cut per-op overhead.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "ops.h"

namespace tandem {

void rope_(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
           int64_t heads, int64_t D) {
  check_rows(qkv, "qkv");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "tandem.rope_: cos/sin must be contiguous [positions, D]");
  TORCH_CHECK(heads * D <= qkv.size(1) && D % 2 == 0, "tandem.rope_: heads * D exceeds the row");
  // Already int64 (the engine's case): no aten::to dispatch, 30 a decode step.
  at::Tensor pos = positions.scalar_type() == at::kLong ? positions.contiguous() : positions.to(at::kLong).contiguous();
  const int64_t T = qkv.size(0), ld = qkv.stride(0), half = D / 2, P = cos.size(0);
  float* px = qkv.data_ptr<float>();
  const float *pc = cos.data_ptr<float>(), *ps = sin.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "tandem.rope_: position out of range");
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = pc + pp[t] * D, *s = ps + pp[t] * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = px + t * ld + h * D;
        for (int64_t i = 0; i < half; ++i) {     // x * cos + rotate_half(x) * sin, rotate_half = (-x2, x1)
          const float a = x[i], b = x[i + half];
          x[i] = a * c[i] - b * s[i];
          x[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

}  // namespace tandem
