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

#include "gated_delta_rule.h"
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

at::Tensor checked(const at::Tensor& x, at::ScalarType dtype, int64_t dim, const char* op, const char* what) {
  TORCH_CHECK(x.scalar_type() == dtype && x.dim() == dim, op, ": ", what);
  return x.contiguous();
}

// The rows' token ranges and slots, checked: starts nondecreasing within [0, T], slots within [0, S).
void check_rows(const char* op, const int64_t* st, const int64_t* sl, int64_t B, int64_t T, int64_t S) {
  TORCH_CHECK(st[0] >= 0 && st[B] <= T, op, ": starts must lie within [0, tokens]");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(st[b] <= st[b + 1], op, ": starts must be nondecreasing");
    TORCH_CHECK(sl[b] >= 0 && sl[b] < S, op, ": slot out of range");
  }
}

}  // namespace

DeltaRows delta_rows(const char* op, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                     const at::Tensor& g_in, const at::Tensor& beta_in, const at::Tensor& state,
                     const at::Tensor& slots_in, const at::Tensor& starts_in, const at::Tensor& fresh_in) {
  DeltaRows r;
  r.q = checked(q_in, at::kFloat, 3, op, "q must be fp32 [T, Hk, Dk]");
  r.k = checked(k_in, at::kFloat, 3, op, "k must be fp32 [T, Hk, Dk]");
  r.v = checked(v_in, at::kFloat, 3, op, "v must be fp32 [T, Hv, Dv]");
  r.g = checked(g_in, at::kFloat, 2, op, "g must be fp32 [T, Hv]");
  r.beta = checked(beta_in, at::kFloat, 2, op, "beta must be fp32 [T, Hv]");
  r.slots = checked(slots_in, at::kLong, 1, op, "slots must be int64 [B]");
  r.starts = checked(starts_in, at::kLong, 1, op, "starts must be int64 [B + 1]");
  TORCH_CHECK(fresh_in.scalar_type() == at::kBool || fresh_in.scalar_type() == at::kByte,
              op, ": fresh must be bool or uint8 [B]");
  r.fresh = fresh_in.contiguous();
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.dim() == 4 && state.is_contiguous(),
              op, ": state must be contiguous fp32 [slots, Hv, Dk, Dv]");
  r.T = r.q.size(0), r.Hk = r.q.size(1), r.Dk = r.q.size(2), r.Hv = r.v.size(1), r.Dv = r.v.size(2);
  r.B = r.slots.size(0);
  TORCH_CHECK(r.k.sizes() == r.q.sizes() && r.v.size(0) == r.T && r.Hk > 0 && r.Hv % r.Hk == 0,
              op, ": q, k [T, Hk, Dk] and v [T, Hv, Dv] with Hv a multiple of Hk");
  TORCH_CHECK(r.g.size(0) == r.T && r.g.size(1) == r.Hv && r.beta.sizes() == r.g.sizes(),
              op, ": g and beta must be [T, Hv]");
  TORCH_CHECK(state.size(1) == r.Hv && state.size(2) == r.Dk && state.size(3) == r.Dv,
              op, ": state must be [slots, Hv, Dk, Dv]");
  TORCH_CHECK(r.starts.size(0) == r.B + 1 && r.fresh.dim() == 1 && r.fresh.size(0) == r.B,
              op, ": starts [B + 1] and fresh [B] for slots [B]");
  r.st = r.starts.data_ptr<int64_t>();
  r.sl = r.slots.data_ptr<int64_t>();
  check_rows(op, r.st, r.sl, r.B, r.T, state.size(0));
  // tokens outside every row (none, as the layer calls it) read as zeros
  const bool covered = r.st[0] == 0 && r.st[r.B] == r.T;
  r.out = covered ? at::empty({r.T, r.Hv, r.Dv}, r.v.options()) : at::zeros({r.T, r.Hv, r.Dv}, r.v.options());
  r.pq = r.q.data_ptr<float>(), r.pk = r.k.data_ptr<float>(), r.pv = r.v.data_ptr<float>();
  r.pg = r.g.data_ptr<float>(), r.pb = r.beta.data_ptr<float>();
  r.pf = (const uint8_t*)r.fresh.data_ptr();
  r.ps = state.data_ptr<float>(), r.po = r.out.data_ptr<float>();
  return r;
}

float* DeltaRows::open_state(int64_t b, int64_t h) const {
  float* S = state(b, h);
  if (pf[b]) std::fill(S, S + Dk * Dv, 0.f);
  return S;
}

void recurrent_tokens(const DeltaRows& r, Isa isa, float* S, int64_t h, int64_t t0, int64_t t1, float* scratch) {
  const HeadFn fn = TANDEM_BODY(isa, head_token);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t th = t * r.Hv + h;
    const Tok tk{r.q_at(t, h), r.k_at(t, h), r.pv + th * r.Dv, r.po + th * r.Dv, std::exp(r.pg[th]), r.pb[th]};
    fn(S, tk, r.Dk, r.Dv, scratch);
  }
}

at::Tensor gated_delta_rule_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta, const at::Tensor& state, const at::Tensor& slots,
                             const at::Tensor& starts, const at::Tensor& fresh, int64_t isa_req) {
  const DeltaRows r = delta_rows("tandem.gated_delta_rule_", q, k, v, g, beta, state, slots, starts, fresh);
  const Isa isa = resolve_isa(isa_req);
  at::parallel_for(0, r.B * r.Hv, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scratch(r.Dv);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / r.Hv, h = p % r.Hv;
      recurrent_tokens(r, isa, r.open_state(b, h), h, r.st[b], r.st[b + 1], scratch.data());
    }
  });
  return r.out;
}

}  // namespace tandem
