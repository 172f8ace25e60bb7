// The Gated DeltaNet delta rule of a step's rows, token by token, in one call (model/linear_attention.py):
//   gated_delta_rule_(q [T, Hk, Dk], k [T, Hk, Dk], v [T, Hv, Dv], g [T, Hv], beta [T, Hv], state [S, Hv, Dk, Dv],
//                     slots [B], starts [B + 1], fresh [B]) -> o [T, Hv, Dv]
// fp32 (slots, starts int64; fresh bool or uint8). Row b's tokens are [starts[b], starts[b + 1]), its state
// state[slots[b]] (updated in place; zeroed first where fresh[b]); value head h reads key head h / (Hv / Hk), so q
// and k come unrepeated. q and k are already L2-normed, q scaled by 1 / sqrt(Dk). Per (row, value head) and token:
//   S <- exp(g) S;  kv = S^T k;  delta = beta (v - kv);  S <- S + k delta^T;  o = S^T q        (S: [Dk, Dv])
// the torch reference's order (delta_rule_reference), up to fused multiply-adds and the order of the sums over Dk.
//
// Why: the torch loop ran ~8 ops a token per layer per request, each a pass over [Hv, Dk, Dv] plus a temporary;
// here each state column block is decayed and read (S^T k), then written and read again (S^T q) while it sits in
// L1 (a column's kv, delta and o depend on that column alone): the state goes through the core once a token.
// A decode step of 8 rows x 32 heads of 128 x 128 (Qwen3.6-35B-A3B's layer), 2 threads: ~1.7 ms with AVX-512,
// ~4.5 ms with AVX2, ~11 ms plain, where the torch loop took ~42 ms.
// A (row, head)'s arithmetic depends on its own data only: the column blocks follow from Dv alone, and tokens run
// one at a time, so a row alone or among others, its prompt in one call or many, gives the same bits.
// Thread split: at::parallel_for over the (row, value head) pairs. The rows' slots must differ, as request-table
// rows do (padding rows sharing slot 0 may race there, a slot no request reads). Bodies: AVX-512 and AVX2 over V
// (gated_delta_rule_simd.inc, columns a register block at a time), a plain loop without AVX2 (also the SIMD
// bodies' columns past the last whole register).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace tandem {
namespace {

struct Tok {           // one token of one (row, value head)
  const float* q;      // [Dk]
  const float* k;      // [Dk]
  const float* v;      // [Dv]
  float* o;            // [Dv]
  float decay, beta;   // exp(g), beta
};

namespace scalar {
// Columns [j0, Dv) of one token, rows of S innermost over Dv; d: Dv floats of scratch.
void columns(float* S, const Tok& tk, int64_t Dk, int64_t Dv, int64_t j0, float* d) {
  const float *kp = tk.k, *qp = tk.q, *vp = tk.v, decay = tk.decay, beta = tk.beta;
  float* o = tk.o;
  for (int64_t j = j0; j < Dv; ++j) d[j] = 0.f;
  for (int64_t i = 0; i < Dk; ++i) {
    float* row = S + i * Dv;
    const float ki = kp[i];
    for (int64_t j = j0; j < Dv; ++j) {
      row[j] *= decay;
      d[j] += row[j] * ki;
    }
  }
  for (int64_t j = j0; j < Dv; ++j) {
    d[j] = (vp[j] - d[j]) * beta;
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < Dk; ++i) {
    float* row = S + i * Dv;
    const float ki = kp[i], qi = qp[i];
    for (int64_t j = j0; j < Dv; ++j) {
      row[j] += ki * d[j];
      o[j] += row[j] * qi;
    }
  }
}

void head_token(float* S, const Tok& tk, int64_t Dk, int64_t Dv, float* d) { columns(S, tk, Dk, Dv, 0, d); }
}  // namespace scalar

#define TANDEM_SIMD_BODY "gated_delta_rule_simd.inc"      // avx2::head_token, avx512::head_token
#include "simd_namespaces.inc"

using HeadFn = void (*)(float*, const Tok&, int64_t, int64_t, float*);

at::Tensor checked(const at::Tensor& x, at::ScalarType dtype, int64_t dim, const char* what) {
  TORCH_CHECK(x.scalar_type() == dtype && x.dim() == dim, "tandem.gated_delta_rule_: ", what);
  return x.contiguous();
}

// The rows' token ranges and slots, checked: starts nondecreasing within [0, T], slots within [0, S).
void check_rows(const int64_t* st, const int64_t* sl, int64_t B, int64_t T, int64_t S) {
  TORCH_CHECK(st[0] >= 0 && st[B] <= T, "tandem.gated_delta_rule_: starts must lie within [0, tokens]");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] <= st[b + 1], "tandem.gated_delta_rule_: starts must be nondecreasing");
    TORCH_CHECK(sl[b] >= 0 && sl[b] < S, "tandem.gated_delta_rule_: slot out of range");
  }
}

}  // namespace

at::Tensor gated_delta_rule_(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& g_in, const at::Tensor& beta_in, const at::Tensor& state,
                             const at::Tensor& slots_in, const at::Tensor& starts_in, const at::Tensor& fresh_in,
                             int64_t isa_req) {
  const at::Tensor q = checked(q_in, at::kFloat, 3, "q must be fp32 [T, Hk, Dk]");
  const at::Tensor k = checked(k_in, at::kFloat, 3, "k must be fp32 [T, Hk, Dk]");
  const at::Tensor v = checked(v_in, at::kFloat, 3, "v must be fp32 [T, Hv, Dv]");
  const at::Tensor g = checked(g_in, at::kFloat, 2, "g must be fp32 [T, Hv]");
  const at::Tensor beta = checked(beta_in, at::kFloat, 2, "beta must be fp32 [T, Hv]");
  const at::Tensor slots = checked(slots_in, at::kLong, 1, "slots must be int64 [B]");
  const at::Tensor starts = checked(starts_in, at::kLong, 1, "starts must be int64 [B + 1]");
  TORCH_CHECK(fresh_in.scalar_type() == at::kBool || fresh_in.scalar_type() == at::kByte,
              "tandem.gated_delta_rule_: fresh must be bool or uint8 [B]");
  const at::Tensor fresh = fresh_in.contiguous();
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              "tandem.gated_delta_rule_: state must be contiguous fp32 [slots, Hv, Dk, Dv]");
  const int64_t T = q.size(0), Hk = q.size(1), Dk = q.size(2), Hv = v.size(1), Dv = v.size(2);
  const int64_t B = slots.size(0), S = state.size(0);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == T && Hk > 0 && Hv % Hk == 0,
              "tandem.gated_delta_rule_: q, k [T, Hk, Dk] and v [T, Hv, Dv] with Hv a multiple of Hk");
  TORCH_CHECK(g.size(0) == T && g.size(1) == Hv && beta.sizes() == g.sizes(),
              "tandem.gated_delta_rule_: g and beta must be [T, Hv]");
  TORCH_CHECK(state.size(1) == Hv && state.size(2) == Dk && state.size(3) == Dv,
              "tandem.gated_delta_rule_: state must be [slots, Hv, Dk, Dv]");
  TORCH_CHECK(starts.size(0) == B + 1 && fresh.dim() == 1 && fresh.size(0) == B,
              "tandem.gated_delta_rule_: starts [B + 1] and fresh [B] for slots [B]");
  const int64_t* st = starts.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  check_rows(st, sl, B, T, S);
  // tokens outside every row (none, as the layer calls it) read as zeros
  at::Tensor out = st[0] == 0 && st[B] == T ? at::empty({T, Hv, Dv}, v.options()) : at::zeros({T, Hv, Dv}, v.options());
  const float *pq = q.data_ptr<float>(), *pk = k.data_ptr<float>(), *pv = v.data_ptr<float>();
  const float *pg = g.data_ptr<float>(), *pb = beta.data_ptr<float>();
  const uint8_t* pf = (const uint8_t*)fresh.data_ptr();
  float *ps = state.data_ptr<float>(), *po = out.data_ptr<float>();
  const int64_t rep = Hv / Hk;
  const HeadFn fn = TANDEM_BODY(resolve_isa(isa_req), head_token);
  at::parallel_for(0, B * Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(Dv);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / Hv, h = p % Hv, kh = h / rep;
      float* S_bh = ps + (sl[b] * Hv + h) * Dk * Dv;
      if (pf[b]) std::fill(S_bh, S_bh + Dk * Dv, 0.f);
      for (int64_t t = st[b]; t < st[b + 1]; ++t) {
        const int64_t th = t * Hv + h;
        const Tok tk{pq + (t * Hk + kh) * Dk, pk + (t * Hk + kh) * Dk, pv + th * Dv, po + th * Dv,
                     std::exp(pg[th]), pb[th]};
        fn(S_bh, tk, Dk, Dv, scratch.data());
      }
    }
  });
  return out;
}

}  // namespace tandem
