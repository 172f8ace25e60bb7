// pack_gemv: a row-layout weight (QuantWeight.data) repacked at load for the packed GEMV, in groups of 16 output
// rows: Q4_0, Q4_1, Q5_0, Q8_0 here (the layout: gemv_packed_q8act.cpp's header), the K-quants by pack_gemv_k
// (gemv_packed_k_q8act.cpp's header and packed_k23.h). packed_gather.cpp inverts it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"
#include "packed_layout.h"
#include "packed_mxfp4.h"
#include "packed_q5.h"

namespace tandem {

at::Tensor pack_gemv(const at::Tensor& w, int64_t qtype, int64_t K) {
  if (packable_k(qtype)) return pack_gemv_k(w, qtype, K);
  TORCH_CHECK(packable(qtype), "tandem.pack_gemv: Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K "
              "(ggml types 2, 3, 6, 8, 39, 10-14), got ", qtype);
  TORCH_CHECK(K > 0 && K % 32 == 0, "tandem.pack_gemv: K must be a positive multiple of 32, got ", K);
  const int64_t nb = K / 32, rb = row_block_bytes(qtype) * nb;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == rb,
              "tandem.pack_gemv: w must be a contiguous uint8 [N, ", rb, "] tensor (QuantWeight.data)");
  const int64_t N = w.size(0), NG = (N + kG - 1) / kG, QB = quant_bytes(qtype);
  const int64_t gbytes = nb * (QB + scale_bytes(qtype));
  at::Tensor out = at::zeros({NG, gbytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  // The regrouped row (quant.py): [d fp16 x nb][m fp16 x nb (Q4_1)][qh u32 x nb (Q5_0)][qs: 16 (Q4, Q5_0) or 32
  // (Q8_0) bytes x nb]; MXFP4 [e x nb][qs x nb].
  const int64_t qs_at = (qtype == kQ4_1 ? 4 : qtype == kQ5_0 ? 6 : qtype == kMXFP4 ? 1 : 2) * nb;
  const int64_t qs_bytes = qtype == kQ8_0 ? 32 : 16;
  at::parallel_for(0, NG, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      uint8_t* gp = op + g * gbytes;
      for (int r = 0; r < kG && g * kG + r < N; ++r) {
        const uint8_t* row = wp + (g * kG + r) * rb;
        for (int64_t b = 0; b < nb; ++b) {
          const uint8_t* qs = row + qs_at + qs_bytes * b;
          uint8_t* q = gp + b * QB;
          for (int v = 0; v < (qtype == kQ8_0 ? 8 : 4); ++v)     // vector v: bytes 4 v .. 4 v + 3 of the block
            for (int t = 0; t < 4; ++t)
              q[64 * v + 4 * r + t] = qtype == kQ8_0 ? (uint8_t)(qs[4 * v + t] ^ 0x80) : qs[4 * v + t];
          uint32_t qh = 0;
          if (qtype == kQ5_0) std::memcpy(&qh, row + 2 * nb + 4 * b, 4);
          for (int t = 0; t < 4 && qtype == kQ5_0; ++t) q[256 + 4 * r + t] = q5_h_byte(qh, t);
          const uint16_t mx = qtype == kMXFP4 ? mxfp4_packed_scale(row[b]) : 0;
          std::memcpy(gp + nb * QB + 32 * b + 2 * r, qtype == kMXFP4 ? (const uint8_t*)&mx : row + 2 * b, 2);   // d
          if (qtype == kQ4_1) std::memcpy(gp + nb * QB + 32 * nb + 32 * b + 2 * r, row + 2 * nb + 2 * b, 2);  // m
        }
      }
    }
  });
  return out;
}

}  // namespace tandem
