// An MoE layer's router for the native path (moe.py): each row's logits over the experts, softmax, top-k and
// (norm_topk_prob) the chosen weights divided by their sum, in transformers' order. One op a layer instead of
// ~8 torch calls ([T, E, H] products, a sum, softmax, topk, a division: ~60 us of a decode row's layer).
//
// Batch invariance: every number of a row comes from that row alone, in a fixed order: the logits one fma chain
// an expert along hidden (moe_route_simd.inc; the same bits on every ISA body), the softmax's max and sum in
// expert order, ties in top-k to the lower expert id, the renormalizing sum in rank order. (torch's fp32 sum of
// [T, E, H] products, the torch reference path's, has its own order: the two paths differ in the last bits.)
//
//   x         fp32 [T, H]      the normed residual rows
//   router_t  fp32 [H, EP]     the router's weight [E, H] transposed, experts zero-padded to EP (a multiple of 64)
//   experts   E;  top_k  k;  renormalize  divide the k weights by their sum
//   returns   (weights fp32 [T, k], ids int64 [T, k]), by descending weight
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace tandem {
namespace {

namespace scalar {
void route_logits(const float* x, const float* wt, int64_t H, int64_t EP, int64_t e0, int64_t e1, float* acc) {
  for (int64_t e = e0; e < e1; ++e) acc[e] = 0.f;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t e = e0; e < e1; ++e) acc[e] = std::fma(x[h], wt[h * EP + e], acc[e]);
}
}  // namespace scalar

#define TANDEM_SIMD_BODY "moe_route_simd.inc"
#include "simd_namespaces.inc"

// Softmax over the E logits, top-k, renormalization: scalar, the same on every ISA.
void choose(float* l, int64_t E, int64_t k, bool renormalize, float* w, int64_t* ids) {
  float mx = l[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
  float sum = 0.f;
  for (int64_t e = 0; e < E; ++e) sum += (l[e] = std::exp(l[e] - mx));
  for (int64_t e = 0; e < E; ++e) l[e] = l[e] / sum;
  for (int64_t r = 0; r < k; ++r) {              // the r-th largest; among equals the lowest id not yet taken
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      bool taken = false;
      for (int64_t q = 0; q < r; ++q) taken |= ids[q] == e;
      if (!taken && (best < 0 || l[e] > l[best])) best = e;
    }
    ids[r] = best;
    w[r] = l[best];
  }
  if (!renormalize) return;
  float s = 0.f;
  for (int64_t r = 0; r < k; ++r) s += w[r];
  for (int64_t r = 0; r < k; ++r) w[r] = w[r] / s;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> moe_route(const at::Tensor& x_in, const at::Tensor& router_t, int64_t experts,
                                             int64_t top_k, bool renormalize, int64_t isa_req) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "tandem.moe_route: x must be fp32 [T, H]");
  const int64_t T = x_in.size(0), H = x_in.size(1);
  TORCH_CHECK(router_t.dim() == 2 && router_t.scalar_type() == at::kFloat && router_t.is_contiguous() &&
              router_t.size(0) == H && router_t.size(1) % 64 == 0 && experts > 0 && experts <= router_t.size(1),
              "tandem.moe_route: router_t must be contiguous fp32 [H, EP] (EP a multiple of 64, >= experts)");
  TORCH_CHECK(top_k > 0 && top_k <= experts, "tandem.moe_route: top_k must be in [1, experts]");
  const at::Tensor x = x_in.contiguous();
  const int64_t EP = router_t.size(1);
  at::Tensor w = at::empty({T, top_k}, x.options()), ids = at::empty({T, top_k}, x.options().dtype(at::kLong));
  const float *xp = x.data_ptr<float>(), *wt = router_t.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const Isa isa = resolve_isa(isa_req);
  auto logits = TANDEM_BODY(isa, route_logits);
  // Logits in blocks of 64 experts (a decode row's 128 on both threads: the router is 1 MB of fp32 a layer to
  // stream), then each row's choice. Rows and blocks are independent: any split gives the same bits.
  std::vector<float> l(T * EP);
  const int64_t blocks = EP / 64;
  at::parallel_for(0, T * blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t t = b / blocks, e0 = b % blocks * 64;
      logits(xp + t * H, wt, H, EP, e0, e0 + 64, l.data() + t * EP);
    }
  });
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      choose(l.data() + t * EP, experts, top_k, renormalize, wp + t * top_k, ip + t * top_k);
  });
  return {w, ids};
}

}  // namespace tandem
