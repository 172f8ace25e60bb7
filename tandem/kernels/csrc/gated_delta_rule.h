// What the two delta rule ops share (gated_delta_rule.cpp defines it): their arguments, checked once, and the
// token-by-token form of one (row, value head), which the chunked op (gated_delta_rule_chunked.cpp) runs for a
// row's tail so that short rows and decode tokens keep the recurrent op's bits.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "vec.h"

namespace tandem {

// gated_delta_rule_'s arguments (its header comment), checked and contiguous, with their raw pointers; out is the
// op's output [T, Hv, Dv] (zeros outside every row).
struct DeltaRows {
  at::Tensor q, k, v, g, beta, slots, starts, fresh, out;
  int64_t T, Hk, Hv, Dk, Dv, B;
  const float *pq, *pk, *pv, *pg, *pb;
  const int64_t *st, *sl;
  const uint8_t* pf;
  float *ps, *po;

  // Row b's value head h: its state S [Dk, Dv] in the pool; open_state zeroes it first where the row is fresh.
  float* state(int64_t b, int64_t h) const { return ps + (sl[b] * Hv + h) * Dk * Dv; }
  float* open_state(int64_t b, int64_t h) const;
  const float* q_at(int64_t t, int64_t h) const { return pq + (t * Hk + h / (Hv / Hk)) * Dk; }
  const float* k_at(int64_t t, int64_t h) const { return pk + (t * Hk + h / (Hv / Hk)) * Dk; }
};

DeltaRows delta_rows(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state, const at::Tensor& slots,
                     const at::Tensor& starts, const at::Tensor& fresh);

// Tokens [t0, t1) of value head h through S one at a time, the recurrent op's arithmetic; scratch: Dv floats.
void recurrent_tokens(const DeltaRows& r, Isa isa, float* S, int64_t h, int64_t t0, int64_t t1, float* scratch);

}  // namespace tandem
