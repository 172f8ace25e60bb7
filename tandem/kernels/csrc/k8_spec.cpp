// The K8 contract: what Q4_K, Q5_K and Q6_K weights times int8 rows of x compute, on every body (the packed GEMV's
// AVX-512 VNNI and AVX2 tiles in gemv_packed_k_q8act.cpp, and this scalar specification, which the row-layout ops
// gemm_rows_q8act, linear_rows_q8act and gemv_rows_q8act run for these types).
//
// x is rounded per 256-element super-block (quantize_k8_x: llama.cpp's Q8_K), and a super-block's dot product is
// one integer: the sub-block sums times their integer scales. For output row n, row m of x, super-blocks s in
// order (v: the stored unsigned quants, Q6_K's q + 32; bs: x's sums of quants, ops.h):
//   Q4_K / Q5_K:  I = sum_j sc_j sum_{e in j} v_e x_e,  Mn = sum_j m_j bs_j        (8 sub-blocks of 32)
//                 f = fma(float(I), dx * d, f);  f = fma(float(Mn), dx * (-dmin), f)
//   Q6_K:         I = sum_u sc_u (sum_{e in u} v_e x_e - 32 bs_u)                    (16 halves of 16)
//                 f = fma(float(I), dx * d, f)
// then y = f (+ bias). Every sum is exact in int32 (|I| < 2^29), so a body may add its integers in any order; the
// fp32 operations, their operands and their order are the contract. One conversion and one or two fma a
// super-block, where the per-half contract (Q2_K / Q3_K, the 32-weight types: gemm_rows_q8act.cpp's header) has 16
// halves of a scale product and one or two fma each: on the packed tile that work was half the vector operations
// (benchmarks/results/tile_peak.md, issue 67).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace tandem {

namespace {

enum : int64_t { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
#include "k_scales.inc"

int64_t row_bytes(int64_t qt, int64_t ns) { return ns * (qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : 210); }

// Super-block s of a row in the row layout (quant.py: Q4_K / Q5_K regrouped, Q6_K the GGUF's): its 256 stored
// quants in element order, its integer scales (Q4_K / Q5_K: 8 sc and 8 m; Q6_K: 16 sc) and d, dmin.
struct SuperBlock {
  uint8_t v[256];
  int32_t sc[16], mn[8];
  float d, dmin;
};

void decode(int64_t qt, const uint8_t* row, int64_t ns, int64_t s, SuperBlock& b) {
  if (qt == kQ6_K) {
    const uint8_t* blk = row + 210 * s;
    q6k_values(blk, b.v);
    for (int u = 0; u < 16; ++u) b.sc[u] = (int8_t)blk[192 + u];
    b.d = fp16_to_fp32(load_u16(blk + 208));
    b.dmin = 0.f;
    return;
  }
  const uint8_t* head = row + 16 * s;
  b.d = fp16_to_fp32(load_u16(head));
  b.dmin = fp16_to_fp32(load_u16(head + 2));
  const int64_t qs_at = (qt == kQ5_K ? 48 : 16) * ns;
  for (int j = 0; j < 8; ++j) {
    q4_k_scale_min(head + 4, j, b.sc[j], b.mn[j]);
    const uint8_t* qs = row + qs_at + 16 * (8 * s + j);
    uint32_t qh = 0;
    if (qt == kQ5_K) std::memcpy(&qh, row + 16 * ns + 4 * (8 * s + j), 4);
    for (int i = 0; i < 16; ++i) {
      b.v[32 * j + i] = (uint8_t)((qs[i] & 15) | ((qh >> i) & 1) << 4);
      b.v[32 * j + 16 + i] = (uint8_t)((qs[i] >> 4) | ((qh >> (16 + i)) & 1) << 4);
    }
  }
}

// One super-block's term for one row of x (q: its 256 quants, bs: its sums, dx: its scale), added to f.
float term(int64_t qt, const SuperBlock& b, const int8_t* q, const int16_t* bs, float dx, float f) {
  int32_t I = 0, Mn = 0;
  const int n = qt == kQ6_K ? 16 : 8, len = 256 / n;
  for (int j = 0; j < n; ++j) {
    int32_t S = 0;
    for (int e = 0; e < len; ++e) S += (int32_t)b.v[len * j + e] * q[len * j + e];
    if (qt == kQ6_K) S -= 32 * bs[j];
    I += b.sc[j] * S;
    if (qt != kQ6_K) Mn += b.mn[j] * bs[j];
  }
  f = std::fma((float)I, dx * b.d, f);
  if (qt != kQ6_K) f = std::fma((float)Mn, dx * -b.dmin, f);
  return f;
}

}  // namespace

at::Tensor k8_rows_spec(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                        const std::optional<at::Tensor>& bias_in) {
  TORCH_CHECK(k8_type(qtype), "tandem: the K8 contract is Q4_K, Q5_K or Q6_K's (ggml types 12-14), got ", qtype);
  TORCH_CHECK(K > 0 && K % 256 == 0, "tandem: K must be a positive multiple of 256 for K-quants, got ", K);
  const int64_t ns = K / 256, rb = row_bytes(qtype, ns);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == rb,
              "tandem: w must be uint8 [N, ", rb, "] (QuantWeight.data) for this type and K");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == K, "tandem: x must be fp32 [M, ",
              K, "]");
  const int64_t N = w.size(0);
  auto [x, bias, y] = linear_io(x_in, bias_in, N);
  const int64_t M = x.size(0);
  if (M == 0 || N == 0) return y;
  const at::Tensor wc = w.contiguous();
  const K8X xr = quantize_k8_x(x, qtype == kQ6_K);
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> f(M);
    SuperBlock b;
    for (int64_t n = n0; n < n1; ++n) {
      std::fill(f.begin(), f.end(), 0.f);
      for (int64_t s = 0; s < ns; ++s) {
        decode(qtype, wp + n * rb, ns, s, b);
        for (int64_t m = 0; m < M; ++m)
          f[m] = term(qtype, b, xr.q + m * K + 256 * s, xr.bs + 16 * (m * ns + s), xr.d[m * ns + s], f[m]);
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = bp ? f[m] + bp[n] : f[m];
    }
  });
  return y;
}

}  // namespace tandem
