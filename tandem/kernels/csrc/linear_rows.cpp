// Weight-only quantized linear on GGUF blocks: y[M, N] = x[M, K] @ dequant(w)[N, K]^T (+ bias), fp32 x and y.
//
// Block formats (ggml), 32 weights along K per block, fp16 scales little-endian:
//   Q4_0 (18 B): d fp16 | qs[16]   value i = d * ((qs[i % 16] >> 4 * (i / 16) & 15) - 8)
//   Q4_1 (20 B): d fp16 | m fp16 | qs[16]   value i = d * (qs[i % 16] >> 4 * (i / 16) & 15) + m
//   Q8_0 (34 B): d fp16 | qs int8[32]        value i = d * qs[i]
//   Q5_0 (22 B): d fp16 | qh[4] | qs[16]     value i = d * ((q4_i | (qh >> i & 1) << 4) - 16)
//   Q5_1 (24 B): d fp16 | m fp16 | qh[4] | qs[16]   value i = d * (q4_i | (qh >> i & 1) << 4) + m
//   F16 / BF16 (64 B): 32 halves              value i = the half, exact in fp32
//   MXFP4 (17 B): e uint8 | qs[16]           value i = kMxfp4Values[q4_i] * 2^(e - 128) (mxfp4.h)
// So element i < 16 is the low nibble of byte i, element i >= 16 the high nibble of byte i - 16 (q4_i), and
// qh, a little-endian uint32, holds the fifth bit of element i at bit i.
// K-quants, 256 weights along K per super-block (GGUF layout; Q4_K and Q5_K are regrouped at load, below):
//   Q4_K (144 B): d fp16 | dmin fp16 | scales[12] (8 x 6-bit scale, 8 x 6-bit min) | qs[128]
//     sub-block j (32 weights) = nibbles of qs[32 (j / 2) ..][0..31], low for even j, high for odd;
//     value = (d * sc_j) * q - (dmin * m_j)
//   Q5_K (176 B): d fp16 | dmin fp16 | scales[12] (as Q4_K) | qh[32] | qs[128] (as Q4_K)
//     weight l of sub-block j: Q4_K's nibble | (qh[l] >> j & 1) << 4; value = (d * sc_j) * q - (dmin * m_j)
//   Q2_K (84 B): scales[16] (4-bit scale | 4-bit min << 4, one a 16 weights) | qs[64] | d fp16 | dmin fp16
//     element 128 h + 32 t + l: q = qs[32 h + l] >> 2 t & 3, sub-block u = 8 h + 2 t + l / 16;
//     value = (d * (scales[u] & 15)) * q - dmin * (scales[u] >> 4)
//   Q3_K (110 B): hmask[32] | qs[64] | scales[12] (16 x 6-bit, gguf-py's packing) | d fp16
//     element 128 h + 32 t + l: q = (qs[32 h + l] >> 2 t & 3) - 4 (+ 4 where hmask[l] >> (4 h + t) & 1);
//     value = (d * (scale_u - 32)) * q, u = 8 h + 2 t + l / 16
//   Q6_K (210 B): ql[128] | qh[64] | scales int8[16] | d fp16
//     element 128 h + 32 t + l (h < 2, t < 4, l < 32): 4 low bits from ql[64 h + 32 (t % 2) + l] >> 4 (t / 2),
//     2 high bits from qh[32 h + l] >> 2 t; value = (d * scales[8 h + 2 t + l / 16]) * (q - 32)
// Weight tensor: uint8 [N, K / block weights * block bytes], one row per output feature holding the GGUF bytes of its
// nb = K / 32 blocks (F16 / BF16: the row's halves unchanged), otherwise regrouped (tandem/kernels/quant.py,
// QuantWeight.from_gguf):
//   [d fp16 x nb][m fp16 x nb, Q4_1 / Q5_1][qh uint32 x nb, Q5][qs x nb: 16 bytes (Q4, Q5) or 32 int8 (Q8) each]
//   (MXFP4: [e uint8 x nb][qs 16 bytes x nb])
// so a row's scales convert 16 at a time and broadcast from memory in the block loop. Q6_K rows are the GGUF's
// super-blocks unchanged, as are Q2_K and Q3_K rows; Q4_K and Q5_K rows are regrouped (same size) as
//   [d fp16 | dmin fp16 | scales[12] : 16 bytes x ns super-blocks][qh uint32 x nb, Q5_K]
//   [qs x nb: 16 bytes in Q4_0's nibble order]
// (Q5_K's qh of sub-block b: bit l = the fifth bit of its weight l), so a Q4_K / Q5_K sub-block is a Q4_1 /
// Q5_1 block (value d * sc_j * q - dmin * m_j) for the kernels. A row's 4-bit / 6-bit / int8 sub-block scales
// (and Q2_K's mins) are decoded to fp32 once per call.
//
// Thread split: at::parallel_for over tiles of output features (NR = FR = 4 per tile). For M <= FUSED_M
// (decode at batch 1-4 on AVX-512, 1 on AVX2) each block is dequantized in registers and used at once (the fused path: weight
// bytes stream through once, nothing is stored). For more rows a thread dequantizes its NR rows into a
// private fp32 buffer [NR, K] (L1/L2-resident) once, then multiplies every row of x against it in tiles of
// MR rows (NR x MR accumulators in registers), so the dequantization is paid once per weight row and call,
// however many rows x has. Meant for few rows (decode, M <= ~96); for prefill the Python side dequantizes
// the layer and calls the fp32 GEMM (measured faster there).
//
// ISA: the scalar body below is the specification; the AVX2 and AVX-512 bodies (linear_rows_simd.inc, with the
// vector helpers of vec.h and vec_ext.inc) equal it up to summation order. The dequantized weights are
// bit-identical (d * q + m unfused, as gguf-py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "mxfp4.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

enum QType : int64_t {
  kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13,
  kQ6_K = 14, kBF16 = 30
};  // ggml type ids

static int64_t block_bytes(int64_t qtype) {     // bytes of one block (32 weights; 256 for K-quants)
  switch (qtype) {
    case kF16:
    case kBF16: return 64;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kMXFP4: return 17;
  }
  TORCH_CHECK(false, "tandem.linear_rows: unsupported ggml type ", qtype,
              " (supported: F16=1, BF16=30, Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, Q2_K=10, Q3_K=11, Q4_K=12, ",
              "Q5_K=13, Q6_K=14, MXFP4=39)");
}

static bool is_k_quant(int64_t qtype) { return qtype >= kQ2_K && qtype <= kQ6_K; }
static int64_t block_weights(int64_t qtype) { return is_k_quant(qtype) ? 256 : 32; }

#include "k_scales.inc"

struct GemmArgs {
  int64_t qtype, M, N, K, row_bytes;
  const float* x;       // [M, K]
  const uint8_t* w;     // [N, row_bytes]
  const float* bias;    // [N] or null
  float* y;             // [M, N]
};

namespace scalar {
constexpr int NR = 1;

// Weight i of 32-weight block b of a K-quant row (b / 8: super-block, b % 8: its sub-block).
static float k_weight(int64_t qtype, const uint8_t* row, int64_t nb, int64_t b, int i) {
  const int j = (int)(b % 8);
  if (qtype == kQ4_K || qtype == kQ5_K) {
    const uint8_t* blk = row + 16 * (b / 8);
    int scale, min;
    q4_k_scale_min(blk + 4, j, scale, min);
    const uint8_t* qs = row + (qtype == kQ5_K ? 6 : 2) * nb;         // after nb / 8 16-byte headers (and qh)
    int q = qs[16 * b + i % 16] >> 4 * (i / 16) & 15;
    if (qtype == kQ5_K) q |= (row[2 * nb + 4 * b + i / 8] >> i % 8 & 1) << 4;
    return fp16_to_fp32(load_u16(blk)) * (float)scale * (float)q - fp16_to_fp32(load_u16(blk + 2)) * (float)min;
  }
  const int h = j / 4, t = j % 4, u = 2 * j + i / 16;
  if (qtype == kQ2_K) {
    const uint8_t* blk = row + 84 * (b / 8);
    int q = blk[16 + 32 * h + i] >> 2 * t & 3;
    return fp16_to_fp32(load_u16(blk + 80)) * (float)(blk[u] & 15) * (float)q -
           fp16_to_fp32(load_u16(blk + 82)) * (float)(blk[u] >> 4);
  }
  if (qtype == kQ3_K) {
    const uint8_t* blk = row + 110 * (b / 8);
    int q = (blk[32 + 32 * h + i] >> 2 * t & 3) - (blk[i] >> j & 1 ? 0 : 4);
    return fp16_to_fp32(load_u16(blk + 108)) * (float)q3_k_scale(blk + 96, u) * (float)q;
  }
  const uint8_t* blk = row + 210 * (b / 8);
  int lo = blk[64 * h + 32 * (t % 2) + i] >> 4 * (t / 2) & 15, hi = blk[128 + 32 * h + i] >> 2 * t & 3;
  return fp16_to_fp32(load_u16(blk + 208)) * (float)(int8_t)blk[192 + 8 * h + 2 * t + i / 16] *
         (float)((lo | hi << 4) - 32);
}

// Weight i of block b of a row (the specification of the format).
static float weight(int64_t qtype, const uint8_t* row, int64_t nb, int64_t b, int i) {
  if (is_k_quant(qtype)) return k_weight(qtype, row, nb, b, i);
  if (qtype == kF16) return fp16_to_fp32(load_u16(row + 64 * b + 2 * i));
  if (qtype == kBF16) {
    uint32_t bits = (uint32_t)load_u16(row + 64 * b + 2 * i) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (qtype == kMXFP4) {
    const uint8_t byte = row[nb + 16 * b + i % 16];
    return (float)kMxfp4Values[i < 16 ? byte & 15 : byte >> 4] * e8m0_half(row[b]);
  }
  float d = fp16_to_fp32(load_u16(row + 2 * b));
  if (qtype == kQ8_0) return d * (float)(int8_t)row[2 * nb + 32 * b + i];
  if (qtype == kQ5_0 || qtype == kQ5_1) {
    const uint8_t* qh = row + (qtype == kQ5_1 ? 4 : 2) * nb;      // past d (and m); qs follow the nb masks
    int q = (qh[4 * nb + 16 * b + i % 16] >> 4 * (i / 16) & 15) | (qh[4 * b + i / 8] >> i % 8 & 1) << 4;
    return qtype == kQ5_1 ? d * (float)q + fp16_to_fp32(load_u16(row + 2 * nb + 2 * b)) : d * (float)(q - 16);
  }
  bool q41 = qtype == kQ4_1;
  uint8_t byte = row[(q41 ? 4 : 2) * nb + 16 * b + i % 16];
  int q = i < 16 ? byte & 15 : byte >> 4;
  return q41 ? d * (float)q + fp16_to_fp32(load_u16(row + 2 * nb + 2 * b)) : d * (float)(q - 8);
}

void dequant_row(int64_t qtype, const uint8_t* row, int64_t nb, float* dst, float* = nullptr) {
  for (int64_t b = 0; b < nb; ++b)
    for (int i = 0; i < 32; ++i) dst[b * 32 + i] = weight(qtype, row, nb, b, i);
}

static void gemm_rows(const GemmArgs& a, int64_t n0, int64_t n1, float* buf) {
  for (int64_t n = n0; n < n1; ++n) {
    dequant_row(a.qtype, a.w + n * a.row_bytes, a.K / 32, buf);
    for (int64_t m = 0; m < a.M; ++m) {
      const float* x = a.x + m * a.K;
      float s = 0.f;
      for (int64_t k = 0; k < a.K; ++k) s += buf[k] * x[k];
      a.y[m * a.N + n] = s + (a.bias ? a.bias[n] : 0.f);
    }
  }
}
}  // namespace scalar

#include "vec_ext.inc"

#define TANDEM_SIMD_BODY "linear_rows_simd.inc"
#include "simd_namespaces.inc"

using GemmRows = void (*)(const GemmArgs&, int64_t, int64_t, float*);

// Also dequantize.cpp's: the check of a row-layout weight, and (each body's dequant_row) its dequantization.
void check_weight(const at::Tensor& w, int64_t qtype, int64_t K) {
  const int64_t bytes = block_bytes(qtype), qk = block_weights(qtype);
  TORCH_CHECK(K > 0 && K % qk == 0, "tandem: K must be a positive multiple of ", qk, " for ggml type ", qtype,
              ", got ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
              "tandem: w must be a contiguous uint8 [N, row bytes] tensor");
  TORCH_CHECK(w.size(1) == K / qk * bytes, "tandem: w has ", w.size(1), " bytes a row, ",
              "expected ", K / qk * bytes, " for K=", K);
}

at::Tensor linear_rows(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                       const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  check_weight(w, qtype, K);
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == K,
              "tandem.linear_rows: x must be fp32 [M, ", K, "]");
  auto [x, bias, y] = linear_io(x_in, bias_in, w.size(0));
  const int64_t M = x.size(0), N = w.size(0);
  if (M == 0 || N == 0) return y;
  Isa isa = resolve_isa(isa_req);
  GemmRows fn = TANDEM_BODY(isa, gemm_rows);
  const int nr = TANDEM_BODY(isa, NR);
  GemmArgs a{qtype, M, N, K, w.size(1), x.data_ptr<float>(), w.data_ptr<uint8_t>(),
             bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>()};
  const int64_t tiles = (N + nr - 1) / nr;
  at::parallel_for(0, tiles, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf((size_t)nr * K + 16 * (K / 32));    // weight rows, then 4 rows' scales
    fn(a, t0 * nr, std::min(t1 * nr, N), buf.data());
  });
  return y;
}

}  // namespace tandem
