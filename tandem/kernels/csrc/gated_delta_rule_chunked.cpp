// The Gated DeltaNet delta rule with long rows in its chunked (matrix) form (model/delta_chunked.py, the torch
// reference, states the equations):
//   gated_delta_rule_chunked_(q, k, v, g, beta, state, slots, starts, fresh, chunk) -> o [T, Hv, Dv]
// the arguments of gated_delta_rule_ (gated_delta_rule.cpp) plus the chunk length. A row's full chunks of `chunk`
// tokens from its first take the matrix form; its tail shorter than a chunk (all of a short row, a decode token)
// runs the recurrent op's own body, so those tokens get its bits.
//
// Why: the recurrent form reads and writes a head's [Dk, Dv] state twice a token and waits on the cache. A chunk
// of C tokens is instead a few products of [C, D] x [D, D] and [C, C] x [C, D] matrices, run by register tiles
// near the FMA rate, and the state is read and written once a chunk. The work is about the same (a token: 3 Dk Dv
// FMAs for the products with the state and ~2 C D for the triangles, against 3 Dk Dv FMAs and Dk Dv products),
// so the gain is the rate, and shorter chunks cost fewer FMAs: chunks of 32 ran ~2x the recurrent op at 512
// tokens on Qwen3.6-35B-A3B's heads (benchmarks/results/delta_rule_chunked.md), 64 a little less. Its bits depend
// on where chunks start, so the model takes this op only without batch invariance (model/numerics.py).
//
// Per (row, value head) and chunk (gam the cumulative sum of g over the chunk; every exponent <= 0):
//   d = K S0, o = Q S0; kk = K K^T, qk = Q K^T (lower triangles)           products with the state before the chunk
//   d_t = beta_t (v_t - exp(gam_t) d_t); o_t *= exp(gam_t)
//   kk[t, s<t] = -beta_t exp(gam_t - gam_s) kk[t, s]; qk[t, s<=t] *= exp(gam_t - gam_s), 0 above
//   d <- (I - kk)^-1 d (forward substitution: d is the chunk's delta); o += qk d
//   S <- exp(gam_last) S + (exp(gam_last - gam_s) k_s)^T d
// Thread split: at::parallel_for over the (row, value head) pairs, a thread's heads of a row chunk by chunk
// (row_heads), each thread with its own chunk matrices (Scratch, ~40 KB at C = 32 and Dk = Dv = 128, ~100 KB at
// C = 64: they stay in L2). Bodies: AVX-512 and AVX2 register tiles
// (gated_delta_rule_chunked_simd.inc), plain loops without AVX2.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

#include "gated_delta_rule.h"
#include "ops.h"
#include "vec.h"

namespace tandem {
namespace {

// C [M, N] (rows ldc apart) (+)= A B: A's element (r, k) at A[r as + k ak], B [K, N] (rows ldb apart).
struct Product {
  float* C;
  int64_t ldc;
  const float* A;
  int64_t as, ak;
  const float* B;
  int64_t ldb, M, K, N;
  bool acc;         // add to C (else overwrite it)
};

// Which part of a product is needed: all; C's lower triangle (columns past a row strip's last row may be left
// unwritten); A lower triangular (row r reads k <= r only, the rest of its strip's k being zeros).
enum Tri { kFull, kLowerOut, kLowerA };

// exp(x), 0 where it would be subnormal (x < ln FLT_MIN), as the SIMD bodies' exp (vec_math.inc) gives: a chunk whose
// decays sum below -87 would otherwise scale the whole state into subnormals, each a slow microcode assist.
inline float exp_normal(float x) {
  const float e = std::exp(x);
  return e < FLT_MIN ? 0.f : e;
}

namespace scalar {
// Columns [c0, N) of p in plain loops: the scalar body's products, and the SIMD ones' columns past the last register.
void mm_columns(const Product& p, Tri tri, int64_t c0) {
  for (int64_t r = 0; r < p.M; ++r) {
    const int64_t K = tri == kLowerA ? std::min(p.K, r + 1) : p.K;
    const int64_t N = tri == kLowerOut ? std::min(p.N, r + 1) : p.N;
    float* c = p.C + r * p.ldc;
    if (!p.acc)
      for (int64_t j = c0; j < N; ++j) c[j] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float a = p.A[r * p.as + k * p.ak];
      const float* b = p.B + k * p.ldb;
      for (int64_t j = c0; j < N; ++j) c[j] += a * b[j];
    }
  }
}

void mm(const Product& p, Tri tri) { mm_columns(p, tri, 0); }

// d [C, N] (rows ldd apart) <- (I - a)^-1 d, a strictly lower [C, C] (rows lda apart): row t += a[t, s] row s, s < t.
void solve(float* d, int64_t ldd, const float* a, int64_t lda, int64_t C, int64_t N) {
  for (int64_t t = 1; t < C; ++t)
    for (int64_t s = 0; s < t; ++s) {
      const float x = a[t * lda + s];
      for (int64_t j = 0; j < N; ++j) d[t * ldd + j] += x * d[s * ldd + j];
    }
}

// out[s] = exp(x - y[s]) for s < n
void exp_diff(float* out, float x, const float* y, int64_t n) {
  for (int64_t s = 0; s < n; ++s) out[s] = exp_normal(x - y[s]);
}
}  // namespace scalar

#define TANDEM_SIMD_BODY "gated_delta_rule_chunked_simd.inc"      // avx2::, avx512:: mm, solve, exp_diff
#include "simd_namespaces.inc"

struct Body {                // one ISA's parts of the chunk form
  void (*mm)(const Product&, Tri);
  void (*solve)(float*, int64_t, const float*, int64_t, int64_t, int64_t);
  void (*exp_diff)(float*, float, const float*, int64_t);
};

Body body(Isa isa) { return {TANDEM_BODY(isa, mm), TANDEM_BODY(isa, solve), TANDEM_BODY(isa, exp_diff)}; }

// One thread's chunk matrices; the C x C ones (and k^T) have rows of Cp = C rounded up to 16 floats, so their
// products run whole registers (k^T's columns past C stay zero).
struct Scratch {
  int64_t C, Cp;
  std::vector<float> kt, kk, qk, d, gam, e, tok;
  Scratch(int64_t C, int64_t Dk, int64_t Dv)
      : C(C), Cp((C + 15) / 16 * 16), kt(Dk * Cp, 0.f), kk(C * Cp), qk(C * Cp), d(C * Dv), gam(C), e(Cp), tok(Dv) {}
};

// A chunk's token views for one value head: q and k rows ldq apart, v and o rows ldv apart, g and beta Hv apart.
struct ChunkIo {
  const float *q, *k, *v, *g, *beta;
  float* o;
  int64_t ldq, ldv, Hv;
};

// The triangles' decays and d's and o's scaling by exp(gam_t) (the header's second and third lines).
void decays(const Body& f, Scratch& w, const ChunkIo& x, int64_t Dv) {
  const int64_t C = w.C, Cp = w.Cp;
  for (int64_t t = 0; t < C; ++t) {
    const float bt = x.beta[t * x.Hv], et = exp_normal(w.gam[t]);
    float *kk = w.kk.data() + t * Cp, *qk = w.qk.data() + t * Cp, *e = w.e.data();
    f.exp_diff(e, w.gam[t], w.gam.data(), t + 1);
    for (int64_t s = 0; s < t; ++s) kk[s] *= -bt * e[s];
    for (int64_t s = 0; s <= t; ++s) qk[s] *= e[s];
    std::fill(qk + t + 1, qk + C, 0.f);
    float *d = w.d.data() + t * Dv, *o = x.o + t * x.ldv;
    const float* v = x.v + t * x.ldv;
    for (int64_t j = 0; j < Dv; ++j) {
      d[j] = bt * (v[j] - et * d[j]);
      o[j] *= et;
    }
  }
}

// One chunk of one (row, value head) through S [Dk, Dv], in place; o written for its tokens.
void chunk_form(const Body& f, Scratch& w, const ChunkIo& x, float* S, int64_t Dk, int64_t Dv) {
  const int64_t C = w.C, Cp = w.Cp;
  float *kt = w.kt.data(), *d = w.d.data(), *gam = w.gam.data(), *e = w.e.data();
  float sum = 0.f;
  for (int64_t t = 0; t < C; ++t) gam[t] = sum += x.g[t * x.Hv];
  for (int64_t s = 0; s < C; ++s)
    for (int64_t i = 0; i < Dk; ++i) kt[i * Cp + s] = x.k[s * x.ldq + i];
  f.mm({d, Dv, x.k, x.ldq, 1, S, Dv, C, Dk, Dv, false}, kFull);                   // K S0
  f.mm({x.o, x.ldv, x.q, x.ldq, 1, S, Dv, C, Dk, Dv, false}, kFull);              // Q S0
  f.mm({w.kk.data(), Cp, x.k, x.ldq, 1, kt, Cp, C, Dk, Cp, false}, kLowerOut);    // k_t . k_s
  f.mm({w.qk.data(), Cp, x.q, x.ldq, 1, kt, Cp, C, Dk, Cp, false}, kLowerOut);    // q_t . k_s
  decays(f, w, x, Dv);
  f.solve(d, Dv, w.kk.data(), Cp, C, Dv);                                         // d: the chunk's delta
  f.mm({x.o, x.ldv, w.qk.data(), Cp, 1, d, Dv, C, C, Dv, true}, kLowerA);         // o += qk d
  const float last = gam[C - 1], decay = exp_normal(last);
  f.exp_diff(e, last, gam, C);
  for (int64_t i = 0; i < Dk; ++i)
    for (int64_t s = 0; s < C; ++s) kt[i * Cp + s] *= e[s];
  for (int64_t i = 0; i < Dk * Dv; ++i) S[i] *= decay;
  f.mm({S, Dv, kt, Cp, 1, d, Dv, Dk, C, Dv, true}, kFull);                        // S += (decayed k)^T d
}

// Row b's value heads [h0, h1): chunk by chunk, each chunk for every head in turn, then each head's tail token by
// token. Chunk-major: a chunk's tokens hold the heads' q, k, v and o rows side by side, so the pages a chunk
// touches serve all its heads at once; head by head, each head's rows lay a page or more apart and the op spent a
// third of its time fetching them (the heads' states, 64 KB each at Dk = Dv = 128, stay in L2 meanwhile).
void row_heads(const DeltaRows& r, Isa isa, const Body& f, Scratch& w, int64_t b, int64_t h0, int64_t h1) {
  const int64_t end = r.st[b + 1];
  for (int64_t h = h0; h < h1; ++h) r.open_state(b, h);
  int64_t t = r.st[b];
  for (; t + w.C <= end; t += w.C)
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t th = t * r.Hv + h;
      const ChunkIo x{r.q_at(t, h), r.k_at(t, h), r.pv + th * r.Dv, r.pg + th, r.pb + th, r.po + th * r.Dv,
                      r.Hk * r.Dk, r.Hv * r.Dv, r.Hv};
      chunk_form(f, w, x, r.state(b, h), r.Dk, r.Dv);
    }
  for (int64_t h = h0; h < h1; ++h) recurrent_tokens(r, isa, r.state(b, h), h, t, end, w.tok.data());
}

}  // namespace

at::Tensor gated_delta_rule_chunked_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                     const at::Tensor& slots, const at::Tensor& starts, const at::Tensor& fresh,
                                     int64_t chunk, int64_t isa_req) {
  const char* op = "tandem.gated_delta_rule_chunked_";
  TORCH_CHECK(chunk > 0, op, ": chunk must be positive");
  const DeltaRows r = delta_rows(op, q, k, v, g, beta, state, slots, starts, fresh);
  const Isa isa = resolve_isa(isa_req);
  const Body f = body(isa);
  at::parallel_for(0, r.B * r.Hv, 1, [&](int64_t p0, int64_t p1) {
    Scratch w(chunk, r.Dk, r.Dv);
    for (int64_t p = p0, next; p < p1; p = next) {          // the thread's pairs row by row
      const int64_t b = p / r.Hv;
      next = std::min(p1, (b + 1) * r.Hv);
      row_heads(r, isa, f, w, b, p - b * r.Hv, next - b * r.Hv);
    }
  });
  return r.out;
}

}  // namespace tandem
