// The gated activations of an MLP, one pass over each row:
//   silu_mul(gu [T, 2I]) -> silu(gu[:, :I]) * gu[:, I:]                   ([T, I])
//   gelu_tanh_mul(gu [T, 2I]) -> gelu_tanh(gu[:, :I]) * gu[:, I:]         ([T, I], GeGLU: gemma)
// fp32, rows contiguous; thread split over rows.
//
// Why SIMD bodies (AVX-512 and AVX2: act_mul_simd.inc over vec.h's exp; a plain loop without AVX2): the plain loop
// called std::exp (or std::tanh) per element, which the compiler cannot vectorize, and took 50 us for 32 rows of
// SmolLM2's 1,536 (aten's F.silu(g) * u: 14 us; 2 threads, AMD EPYC): ~1.5 ms of a 32-row decode step's 27. A row's result depends
// on its own values only (no sums), so it has the same bits in any batch; the AVX-512 and AVX2 bodies run the same
// lane-wise operations (the same bits); the plain loop differs in the last bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "vec.h"

namespace tandem {
namespace {

namespace scalar {   // CPUs without AVX2: libm's exp (Vec1's polynomial, one lane at a time, is slower)
template <bool GELU>
void act_mul_row(const float* g, const float* u, float* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float x = g[i], a = GELU ? 2.f * 0.7978845608028654f * (x + 0.044715f * x * x * x) : x;
    o[i] = x / (1.f + std::exp(-a)) * u[i];
  }
}
}  // namespace scalar

#define TANDEM_SIMD_BODY "act_mul_simd.inc"
#include "simd_namespaces.inc"

using RowFn = void (*)(const float*, const float*, float*, int64_t);
template <bool GELU>
RowFn row_fn(Isa isa) {
  return TANDEM_BODY(isa, act_mul_row<GELU>);
}

at::Tensor act_mul(const at::Tensor& gu_in, bool gelu, int64_t isa_req, const char* name) {
  TORCH_CHECK(gu_in.dim() == 2 && gu_in.scalar_type() == at::kFloat, "tandem.", name,
              ": gu must be fp32 [rows, 2 * features]");
  TORCH_CHECK(gu_in.size(1) % 2 == 0, "tandem.", name, ": odd feature count");
  const at::Tensor gu = gu_in.stride(1) == 1 ? gu_in : gu_in.contiguous();
  const int64_t T = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* pg = gu.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const Isa isa = resolve_isa(isa_req);
  const RowFn fn = gelu ? row_fn<true>(isa) : row_fn<false>(isa);
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(pg + t * ld, pg + t * ld + I, po + t * I, I);
  });
  return out;
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gu, int64_t isa) { return act_mul(gu, false, isa, "silu_mul"); }
at::Tensor gelu_tanh_mul(const at::Tensor& gu, int64_t isa) { return act_mul(gu, true, isa, "gelu_tanh_mul"); }

}  // namespace tandem
