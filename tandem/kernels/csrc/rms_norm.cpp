// RMSNorm ops of a decoder layer, one pass over each row instead of ~5-10 torch calls:
//   rms_norm(x [T, E], w [E], eps) -> w * x / sqrt(mean(x^2) + eps)
//   add_rms_norm_(x [T, E], delta [T, E], w, eps) -> x += delta (in place, the residual stream), returns
//       rms_norm(x)
//   head_rms_norm_(qkv [T, C], w [heads, D], eps): RMSNorm in place over each of the first `heads` heads of D of
//       each row, head h by w[h] (QK-norm: q heads by q_norm, then k heads by k_norm)
// fp32, rows contiguous. Thread split: at::parallel_for over rows. The loops are plain C++ (the compiler
// vectorizes them at the baseline ISA); they are memory-light and exist to cut per-op overhead, which a
// decode step profile showed as the other half of its time. RoPE is rope.cpp's; the gated activations (silu_mul,
// gelu_tanh_mul), whose exp the compiler cannot vectorize, are act_mul.cpp's.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>

#include "ops.h"

namespace tandem {

static void norm_row(const float* x, const float* w, float eps, int64_t E, float* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < E; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / (float)E + eps);
  for (int64_t i = 0; i < E; ++i) out[i] = w[i] * (x[i] * r);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
  at::Tensor x = x_in.contiguous();
  check_rows(x, "x");
  const int64_t T = x.size(0), E = x.size(1), ld = x.stride(0);
  at::Tensor wc = w.contiguous(), out = at::empty({T, E}, x.options());
  const float *px = x.data_ptr<float>(), *pw = wc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(px + t * ld, pw, (float)eps, E, po + t * E);
  });
  return out;
}

at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& delta_in, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  at::Tensor delta = delta_in.contiguous();
  check_rows(delta, "delta");
  TORCH_CHECK(x.sizes() == delta.sizes(), "tandem.add_rms_norm_: x and delta shapes differ");
  const int64_t T = x.size(0), E = x.size(1), ldx = x.stride(0), ldd = delta.stride(0);
  at::Tensor wc = w.contiguous(), out = at::empty({T, E}, x.options());
  float* px = x.data_ptr<float>();
  const float *pd = delta.data_ptr<float>(), *pw = wc.data_ptr<float>();
  float* po = out.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* xr = px + t * ldx;
      const float* dr = pd + t * ldd;
      for (int64_t i = 0; i < E; ++i) xr[i] += dr[i];
      norm_row(xr, pw, (float)eps, E, po + t * E);
    }
  });
  return out;
}

void head_rms_norm_(const at::Tensor& qkv, const at::Tensor& w_in, double eps) {
  check_rows(qkv, "qkv");
  at::Tensor w = w_in.contiguous();
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.size(0) * w.size(1) <= qkv.size(1),
              "tandem.head_rms_norm_: w must be fp32 [heads, D] within the row");
  const int64_t T = qkv.size(0), ld = qkv.stride(0), heads = w.size(0), D = w.size(1);
  float* px = qkv.data_ptr<float>();
  const float* pw = w.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        float* x = px + t * ld + h * D;
        norm_row(x, pw + h * D, (float)eps, D, x);               // in place: norm_row reads x before writing
      }
  });
}

}  // namespace tandem
