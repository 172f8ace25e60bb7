// packed_gather: rows of a weight read out of its packed copy (tandem.pack_gemv's layouts) as fp32, for the
// token lookup of a model whose embedding is tied to its LM head.
//
// Why: a tied model's head packs the embedding matrix and drops the row layout where the packed copy serves every
// row count (QLinear.release_rows), yet the lookup read the row layout, so the matrix was held twice. A Q6_K
// embedding's rows are a view of the file's map, whose pages loading drops but each lookup faults back: with every
// token looked up once, the 3B-shaped Q4_K_M file's process held 295 MiB more (1.5B: 179 MiB). Q4_K rows, and
// Q4_0 / Q4_1 / Q8_0 ones (their heads drop the rows on AVX2), are regrouped copies, held from load on. Reading
// the lookup's rows from the packed copy holds the matrix once.
//
// How: each requested row's row-layout bytes are rebuilt from its group (the inverse of the pack) and
// dequantized by tandem.dequantize's own body, so the values are bit for bit dequantize's on the row layout, on
// every ISA. The layouts are those of gemv_packed_q8act.cpp (Q4_0, Q4_1, Q5_0, Q8_0), gemv_packed_k_q8act.cpp (Q4_K,
// Q5_K, Q6_K) and packed_k23.h (Q2_K, Q3_K), described in their headers; tests/kernels/test_packed_gather.py holds
// the pack and this inverse together.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"
#include "packed_k23.h"
#include "packed_mxfp4.h"
#include "packed_q5.h"

namespace tandem {

namespace {

enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};
constexpr int kG = 16;                      // rows of a packed group

bool k23(int64_t qt) { return qt == kQ2_K || qt == kQ3_K; }
bool k_quant(int64_t qt) { return k23(qt) || qt == kQ4_K || qt == kQ5_K || qt == kQ6_K; }
// Bytes a row has in the row layout, and a packed group of 16 rows, for K input features.
int64_t row_bytes(int64_t qt, int64_t K) {
  if (k23(qt)) return K / 256 * k23_row_bytes(qt);
  if (k_quant(qt)) return K / 256 * (qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : 210);
  return K / 32 * (qt == kQ4_0 ? 18 : qt == kQ4_1 ? 20 : qt == kQ5_0 ? 22 : qt == kMXFP4 ? 17 : 34);
}
int64_t group_bytes(int64_t qt, int64_t K) {
  if (k_quant(qt)) return kG * row_bytes(qt, K);
  return K / 32 * ((qt == kQ8_0 ? 512 : qt == kQ5_0 ? 320 : 256) + (qt == kQ4_1 ? 64 : 32));   // quants, scales
}

// Q4_0 / Q4_1 / Q5_0 / Q8_0 (gemv_packed_q8act.cpp's pack_gemv): the regrouped row [d x nb][m x nb (Q4_1)][qh x nb
// (Q5_0, from H: packed_q5.h)][qs x nb]; MXFP4 [e x nb][qs x nb], e from the packed bf16 scale (packed_mxfp4.h).
void unpack_row_q(int64_t qt, const uint8_t* gp, int r, int64_t nb, uint8_t* row) {
  const int64_t QB = qt == kQ8_0 ? 512 : qt == kQ5_0 ? 320 : 256;
  const int64_t qs_at = (qt == kQ4_1 ? 4 : qt == kQ5_0 ? 6 : qt == kMXFP4 ? 1 : 2) * nb;
  const int64_t qs_bytes = qt == kQ8_0 ? 32 : 16;
  const uint8_t flip = qt == kQ8_0 ? 0x80 : 0;         // Q8_0's packed quants are w + 128
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = gp + b * QB;
    uint8_t* qs = row + qs_at + qs_bytes * b;
    for (int v = 0; v < qs_bytes / 4; ++v)
      for (int t = 0; t < 4; ++t) qs[4 * v + t] = (uint8_t)(q[64 * v + 4 * r + t] ^ flip);
    uint32_t qh = 0;
    for (int t = 0; t < 4 && qt == kQ5_0; ++t) qh |= q5_qh_bits(q[256 + 4 * r + t], t);
    if (qt == kQ5_0) std::memcpy(row + 2 * nb + 4 * b, &qh, 4);
    if (qt == kMXFP4) row[b] = mxfp4_exponent(load_u16(gp + nb * QB + 32 * b + 2 * r));
    else std::memcpy(row + 2 * b, gp + nb * QB + 32 * b + 2 * r, 2);                               // d
    if (qt == kQ4_1) std::memcpy(row + 2 * nb + 2 * b, gp + nb * QB + 32 * nb + 32 * b + 2 * r, 2);  // m
  }
}

// Q4_K / Q5_K (gemv_packed_k_q8act.cpp's pack_group): the regrouped row [16-byte headers x ns][Q5_K: qh u32 a
// sub-block][16 nibble bytes a sub-block]; Q5_K's fifth bits come back from H (packed_q5.h).
void unpack_row_q45k(int64_t qt, const uint8_t* gp, int r, int64_t ns, uint8_t* row) {
  const int64_t QB = qt == kQ5_K ? 320 : 256, qs_at = (qt == kQ5_K ? 48 : 16) * ns;
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* sp = gp + s * (8 * QB + 256);
    const uint8_t* tail = sp + 8 * QB;
    uint8_t* head = row + 16 * s;
    std::memcpy(head, tail + 2 * r, 2);                                  // d
    std::memcpy(head + 2, tail + 32 + 2 * r, 2);                         // dmin
    for (int i = 0; i < 12; ++i) head[4 + i] = tail[64 + 16 * i + r];    // the 12 scale bytes
    for (int sb = 0; sb < 8; ++sb) {
      uint8_t* qs = row + qs_at + 16 * (8 * s + sb);
      uint32_t hb = 0;
      for (int p = 0; p < 4; ++p)
        for (int t = 0; t < 4; ++t) qs[4 * p + t] = sp[QB * sb + 64 * p + 4 * r + t];
      for (int t = 0; t < 4 && qt == kQ5_K; ++t) hb |= q5_qh_bits(sp[QB * sb + 256 + 4 * r + t], t);
      if (qt == kQ5_K) std::memcpy(row + 16 * ns + 4 * (8 * s + sb), &hb, 4);
    }
  }
}

// Q6_K: the GGUF's super-blocks [ql 128][qh 64][scales int8 16][d fp16]. The packed group holds each element's
// 6-bit value q + 32 (low nibbles as Q4_K's, the high bits in H0 / H1); they go back to ql / qh as q6k_values
// reads them: element 128 h + 32 t + l has its low nibble in ql[64 h + 32 (t & 1) + l] at bit 4 (t >> 1) and its
// high bits in qh[32 h + l] at bit 2 t.
void unpack_row_q6k(const uint8_t* gp, int r, int64_t ns, uint8_t* row) {
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* sp = gp + s * 3360;
    const uint8_t* tail = sp + 8 * 384;
    uint8_t v[256];
    for (int sb = 0; sb < 8; ++sb) {
      const uint8_t* q = sp + 384 * sb;
      for (int p = 0; p < 4; ++p)
        for (int t = 0; t < 4; ++t) {
          const int i = 4 * p + t, at = 4 * r + t;
          v[32 * sb + i] = (uint8_t)((q[64 * p + at] & 15) | ((q[256 + at] >> (2 * p)) & 3) << 4);
          v[32 * sb + 16 + i] = (uint8_t)((q[64 * p + at] >> 4) | ((q[320 + at] >> (2 * p)) & 3) << 4);
        }
    }
    uint8_t* blk = row + 210 * s;
    std::memset(blk, 0, 192);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, t = (e % 128) / 32, l = e % 32;
      blk[64 * h + 32 * (t & 1) + l] |= (uint8_t)((v[e] & 15) << (4 * (t >> 1)));
      blk[128 + 32 * h + l] |= (uint8_t)((v[e] >> 4) << (2 * t));
    }
    for (int u = 0; u < 16; ++u) blk[192 + u] = tail[16 * u + r];
    std::memcpy(blk + 208, tail + 256 + 2 * r, 2);
  }
}

// Q2_K / Q3_K: the GGUF's super-blocks, each element's value and header byte read back from where packed_k23.h
// put them.
void unpack_row_k23(int64_t qt, const uint8_t* gp, int r, int64_t ns, uint8_t* row) {
  const int64_t rb = k23_row_bytes(qt);
  for (int64_t s = 0; s < ns; ++s) {
    const uint8_t* sp = gp + s * kG * rb;
    uint8_t* blk = row + s * rb;
    std::memset(blk, 0, rb);
    for (int e = 0; e < 256; ++e) k23_set_value(qt, blk, e, k23_get(qt, sp, r, e));
    for (int j = 0; j < rb; ++j)
      if (j < k23_quants_begin(qt) || j >= k23_quants_end(qt)) blk[j] = sp[k23_head_at(qt, j, r)];
  }
}

}  // namespace

at::Tensor packed_gather(const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N, const at::Tensor& index,
                         int64_t isa) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ8_0 || qtype == kMXFP4 || k_quant(qtype),
              "tandem.packed_gather: Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K (ggml types 2, 3, 6, "
              "8, 39, 10-14), got ", qtype);
  const int64_t qk = k_quant(qtype) ? 256 : 32;
  TORCH_CHECK(K > 0 && K % qk == 0, "tandem.packed_gather: K must be a positive multiple of ", qk, ", got ", K);
  TORCH_CHECK(N > 0, "tandem.packed_gather: N must be > 0, got ", N);
  const int64_t NG = (N + kG - 1) / kG, gbytes = group_bytes(qtype, K), rb = row_bytes(qtype, K);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == NG && packed.size(1) == gbytes,
              "tandem.packed_gather: packed must be pack_gemv's uint8 [", NG, ", ", gbytes, "] for N = ", N,
              " and K = ", K);
  TORCH_CHECK(index.dim() == 1 && !at::isFloatingType(index.scalar_type()) && index.scalar_type() != at::kBool,
              "tandem.packed_gather: index must be a 1-D integer tensor");
  const at::Tensor idx = as_long(index);
  const int64_t M = idx.size(0);
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < N, "tandem.packed_gather: index[", i, "] = ", ip[i],
                " is out of range for a weight of ", N, " rows");
  at::Tensor rows = at::empty({M, rb}, packed.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  uint8_t* out = rows.data_ptr<uint8_t>();
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* gp = wp + ip[i] / kG * gbytes;
      const int r = (int)(ip[i] % kG);
      if (k23(qtype)) unpack_row_k23(qtype, gp, r, K / 256, out + i * rb);
      else if (qtype == kQ4_K || qtype == kQ5_K) unpack_row_q45k(qtype, gp, r, K / 256, out + i * rb);
      else if (qtype == kQ6_K) unpack_row_q6k(gp, r, K / 256, out + i * rb);
      else unpack_row_q(qtype, gp, r, K / 32, out + i * rb);
    }
  });
  return dequantize(rows, qtype, K, isa);
}

}  // namespace tandem
