// gemv_packed_q8act for the K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): the streaming int8 GEMV on weights interleaved
// at load for 16 output rows, as gemv_packed_q8act.cpp does for Q4_0 / Q4_1 / Q8_0. Q4_K / Q5_K / Q6_K compute the
// K8 contract (k8_spec.cpp: x rounded per super-block, a super-block's sums times their integer scales in int32,
// one conversion and one or two fma a super-block), so their rows are bit for bit its specification's at any row
// count; Q2_K / Q3_K keep gemm_rows_q8act's per-half arithmetic (its header; gemv_packed_q8act_k23.inc). Here: the
// op and the pack; the tiles of Q4_K / Q5_K / Q6_K in gemv_packed_k8_vnni.inc (AVX-512 VNNI) and
// gemv_packed_k_q8act_avx2.inc, Q2_K / Q3_K's in gemv_packed_q8act_k23.inc.
//
// Why: on a 1.5B Q4_K_M file a decode step is the weight stream, and the row layout's GEMV (gemv_rows_q8act) read it
// at ~32 GB/s where llama.cpp reads ~43 on the same cores (issue 46). The packed layout is the file's size
// exactly (16 rows x 144, 176 or 210 bytes a super-block; Q2_K / Q3_K 84, 110), so a model keeps it as the
// weight's only copy.
//
// Packed tensor: uint8 [ceil(N / 16), K / 256 * SB], group g = output rows 16 g .. 16 g + 15 (rows past N
// zero), super-block after super-block, SB bytes each:
//   Q4_K, SB = 2304: 8 sub-blocks of 256 quant bytes (4 vectors p of 64: byte 4 r + t of vector p is byte
//     4 p + t of row r's 16 nibble bytes of the sub-block, Q4_0's order: low nibble element 4 p + t, high nibble
//     element 16 + 4 p + t), then d fp16 x 16, dmin fp16 x 16, then the 12 scale bytes transposed (byte i of
//     row r at 16 i + r), so one 16-byte load and a few byte operations give sub-block j's 16 scales or mins.
//   Q5_K, SB = 2816: Q4_K's, each sub-block's 256 nibble bytes followed by H, its 64 bytes of fifth bits
//     (packed_q5.h: one shift and one ternary logic op move vector p's into bit 4 of its bytes).
//   Q6_K, SB = 3360: 8 sub-blocks of 384 quant bytes (the 4 low-nibble vectors as Q4_K's, then H0, H1: byte
//     4 r + t of H0 holds the two high bits of element 4 p + t at bits 2 p, 2 p + 1, H1 those of element
//     16 + 4 p + t), then the int8 scales transposed (scale u < 16 of row r at 16 u + r), then d fp16 x 16.
//   Q2_K, SB = 1344 and Q3_K, SB = 1760: packed_k23.h (a 64-byte vector of 2-bit quants a 16-weight half).
// The operand vpdpbusd takes unsigned is the weight: Q4_K's nibbles and Q5_K's 5-bit values are their quants;
// Q6_K's 6-bit values are q + 32, so a half's sum loses 32 sum(x) (Q3_K's q + 4: 4 sum(x)).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "packed_k23.h"
#include "packed_q5.h"
#include "vec.h"

namespace tandem {

namespace {

enum : int64_t { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };
constexpr int kG = 16;

constexpr bool k23(int64_t qt) { return qt == kQ2_K || qt == kQ3_K; }           // gemv_packed_q8act_k23.inc's types
constexpr int64_t row_sb_bytes(int64_t qt) {
  return k23(qt) ? k23_row_bytes(qt) : qt == kQ4_K ? 144 : qt == kQ5_K ? 176 : 210;
}
constexpr int64_t sb_bytes(int64_t qt) { return kG * row_sb_bytes(qt); }         // a group's super-block
constexpr int64_t sub_bytes(int64_t qt) { return qt == kQ4_K ? 256 : qt == kQ5_K ? 320 : 384; }   // its quants
constexpr bool has_min(int64_t qt) { return qt == kQ4_K || qt == kQ5_K; }        // Q4_K, Q5_K: d, dmin, scales

struct KX {                 // rows of x, natural order: Q2_K / Q3_K rounded per half as gemm_rows_q8act rounds
  const int8_t* q;              // them, Q4_K / Q5_K / Q6_K per super-block (quantize_k8_x); q [M][K]
  const float *dx, *sxh;        // [M][nh], per half
  const int32_t* off;           // [M][nh]: Q3_K 4 sum(x) of the half; the others unused
  const float* d8;              // [M][K / 256], per super-block
  const int16_t* bs;            // [M][K / 256][16]: quantize_k8_x's sums
  int64_t K, nh;
};


// The 16 rows' fp32 scales of 4 sub-blocks from their 6-bit values v (16 bytes a sub-block; sign: int8): out[i]
// = float(v lane i) * s, as k_scales computes them.
TANDEM_KERNEL_VNNI inline __m512 widen1(__m128i b, __m512 s, bool sign) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(sign ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b)), s);
}
TANDEM_KERNEL_VNNI inline void widen4(__m512i v, __m512 s, __m512* out, bool sign = false) {
  out[0] = widen1(_mm512_extracti32x4_epi32(v, 0), s, sign);
  out[1] = widen1(_mm512_extracti32x4_epi32(v, 1), s, sign);
  out[2] = widen1(_mm512_extracti32x4_epi32(v, 2), s, sign);
  out[3] = widen1(_mm512_extracti32x4_epi32(v, 3), s, sign);
}

// Q6_K vector p's element quants (q + 32, 0..63) of half h from its nibble vector v and high-bit vector hb.
TANDEM_KERNEL_VNNI inline __m512i q6k_bits512(__m512i v, __m512i hb, int p, int h) {
  const __m512i m4 = _mm512_set1_epi8(0x0f), m30 = _mm512_set1_epi8(0x30);
  const __m512i lo = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, m4);
  const __m512i hi = p == 3 ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 4 - 2 * p);
  return _mm512_or_si512(lo, _mm512_and_si512(hi, m30));
}

// The weight stream's software prefetch: a tile requests, into L2, the lines kPrefetchAhead bytes ahead of the
// super-block it reads (past the group's end: the next group's, read next; a prefetch past the weights does not
// fault). One group a tile keeps the weights one sequential stream a thread. Measured on the 1.5B-shaped file's
// matrices streamed from DRAM on an AMD EPYC (2 threads, one row of x): 37-47 ms a step with 4 groups a tile and
// the next 4 requested whole into L1 (as gemv_packed_q8act.cpp does), 27-30 ms with 4 streams and this prefetch,
// 20-25 ms with one stream (L2-resident, 4 groups a tile was no faster).
constexpr int64_t kPrefetchAhead = 4096;

TANDEM_KERNEL_AVX2 inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch((const char*)(p + l), _MM_HINT_T1);
}

// A half's exact int32 sums of the 16 rows: weight vectors w[p] (4 unsigned quants of each row's lane) against
// the half's 16 bytes of x, 4 a vector. Two chains of 2 vpdpbusd, not one of 4 (its latency bound the tile); an
// int32 sum in any order is the same sum.
// 4 bytes of x in every lane: a broadcast from memory
TANDEM_KERNEL_VNNI inline __m512i x4(const int8_t* xb) {
  int32_t v;
  std::memcpy(&v, xb, 4);
  return _mm512_set1_epi32(v);
}
TANDEM_KERNEL_VNNI inline __m512i half_dot512(const __m512i* w, const int8_t* xb) {
  const __m512i a0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x4(xb));
  const __m512i a1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], x4(xb + 4));
  return _mm512_add_epi32(_mm512_dpbusd_epi32(a0, w[2], x4(xb + 8)), _mm512_dpbusd_epi32(a1, w[3], x4(xb + 12)));
}
// One chain of 4, for tiles of several rows of x: their rows' chains overlap, and the add was one vector operation
// in 9 of the many-row tile's.
TANDEM_KERNEL_VNNI inline __m512i half_dot512_chain(const __m512i* w, const int8_t* xb) {
  __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], x4(xb));
  for (int p = 1; p < 4; ++p) a = _mm512_dpbusd_epi32(a, w[p], x4(xb + 4 * p));
  return a;
}

// The same for 8 rows by pmaddubsw, the 4 products' pairs added in int16 (the caller's quants are small enough
// for |sum| < 2^15), then pmaddwd by ones.
TANDEM_KERNEL_AVX2 inline __m256i half_dot256(const __m256i* w, const int8_t* xb) {
  __m256i pr[4];
  for (int p = 0; p < 4; ++p) {
    int32_t xv;
    std::memcpy(&xv, xb + 4 * p, 4);
    pr[p] = _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(xv));
  }
  const __m256i sum = _mm256_add_epi16(_mm256_add_epi16(pr[0], pr[1]), _mm256_add_epi16(pr[2], pr[3]));
  return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}

// A tile's outputs: rows m0 .. m0 + MT - 1 of y at columns n0 .. (16, or 8 on AVX2, not past N), plus bias.
template <int MT>
TANDEM_KERNEL_VNNI void store16(const __m512* f, int64_t m0, const float* bias, float* y, int64_t ldy, int64_t n0,
                                int64_t N) {
  const int nr = (int)std::min<int64_t>(kG, N - n0);
  const __mmask16 keep = nr >= kG ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n0) : _mm512_setzero_ps();
  for (int j = 0; j < MT; ++j)
    _mm512_mask_storeu_ps(y + (m0 + j) * ldy + n0, keep, bias ? _mm512_add_ps(f[j], bv) : f[j]);
}
template <int MT>
TANDEM_KERNEL_AVX2 void store8(const __m256* f, int64_t m0, const float* bias, float* y, int64_t ldy, int64_t n,
                               int64_t N) {
  const int nr = (int)std::min<int64_t>(8, N - n);
  for (int j = 0; j < MT; ++j) {
    alignas(32) float out[8];
    _mm256_store_ps(out, f[j]);
    for (int i = 0; i < nr; ++i) y[(m0 + j) * ldy + n + i] = bias ? out[i] + bias[n + i] : out[i];
  }
}

#include "gemv_packed_k8_vnni.inc"
#include "gemv_packed_k_q8act_avx2.inc"
#include "gemv_packed_q8act_k23.inc"

// The type's tile: this file's, or gemv_packed_q8act_k23.inc's.
template <int64_t QT, int MT>
void tile(const uint8_t* gp, int64_t ns, const KX& x, int64_t m0, const float* bias, float* y, int64_t n0, int64_t N) {
  if constexpr (k23(QT)) ktile23<QT, MT>(gp, ns, x, m0, bias, y, N, n0, N);
  else ktile<QT, MT>(gp, ns, x, m0, bias, y, N, n0, N);
}

// Rows m0 .. M - 1 of x against half s of a group, MT rows a tile and the last < MT by narrower ones.
template <int64_t QT, int MT>
void krows_avx2(const uint8_t* gp, int64_t ns, const KX& x, int64_t m0, int64_t M, const float* bias, float* y,
                int64_t n, int64_t N, int s) {
  for (; M - m0 >= MT; m0 += MT) {
    if constexpr (k23(QT)) ktile23_avx2<QT, MT>(gp, ns, x, m0, bias, y, N, n, N, s);
    else ktile_avx2<QT, MT>(gp, ns, x, m0, bias, y, N, n, N, s);
  }
  if constexpr (MT > 1) {
    if (M > m0) krows_avx2<QT, MT - 1>(gp, ns, x, m0, M, bias, y, n, N, s);
  }
}

// Groups g0 .. g1 - 1 against every row of x, a group at a time (one weight stream), 4 rows of x a tile.
template <int64_t QT>
void kgroups(int body, const uint8_t* wp, int64_t gbytes, int64_t ns, const KX& x, int64_t M, const float* bias,
             float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gp = wp + g * gbytes;
    const int64_t n0 = g * kG;
    if (body == 1) {
      for (int s = 0; s < 2 && n0 + 8 * s < N; ++s) krows_avx2<QT, 4>(gp, ns, x, 0, M, bias, y, n0 + 8 * s, N, s);
      continue;
    }
    // 16 rows of x a tile (Q4_K / Q5_K / Q6_K: a group's decoded super-block serves twice the rows; measured 1.06-1.18x
    // at 16-512 rows, one thread, an Intel Xeon with AVX-512 VNNI; Q2_K / Q3_K's tiles spill at 16: 0.9x), else 8, 4
    constexpr int64_t wide = k23(QT) ? 8 : 16;
    for (int64_t m0 = 0; m0 < M; m0 += M - m0 >= wide ? wide : M - m0 >= 8 ? 8 : 4) {
      switch (std::min<int64_t>(M - m0 >= wide ? wide : M - m0 >= 8 ? 8 : 4, M - m0)) {
        case 16: if constexpr (!k23(QT)) tile<QT, 16>(gp, ns, x, m0, bias, y, n0, N); break;
        case 8: tile<QT, 8>(gp, ns, x, m0, bias, y, n0, N); break;
        case 4: tile<QT, 4>(gp, ns, x, m0, bias, y, n0, N); break;
        case 3: tile<QT, 3>(gp, ns, x, m0, bias, y, n0, N); break;
        case 2: tile<QT, 2>(gp, ns, x, m0, bias, y, n0, N); break;
        default: tile<QT, 1>(gp, ns, x, m0, bias, y, n0, N); break;
      }
    }
  }
}

void pack_group(int64_t qt, const uint8_t* w, int64_t rb, int64_t ns, int64_t N, int64_t g, uint8_t* gp) {
  for (int r = 0; r < kG && g * kG + r < N; ++r) {
    const uint8_t* row = w + (g * kG + r) * rb;
    if (k23(qt)) {
      pack_row23(qt, row, r, ns, gp);
      continue;
    }
    for (int64_t s = 0; s < ns; ++s) {
      uint8_t* sp = gp + s * sb_bytes(qt);
      uint8_t* tail = sp + 8 * sub_bytes(qt);
      if (has_min(qt)) {    // the regrouped row (quant.py): [16-byte headers x ns][Q5_K: qh u32 a sub-block]
        const uint8_t* head = row + 16 * s;                     // [16 nibble bytes a sub-block]
        std::memcpy(tail + 2 * r, head, 2);
        std::memcpy(tail + 32 + 2 * r, head + 2, 2);
        for (int i = 0; i < 12; ++i) tail[64 + 16 * i + r] = head[4 + i];
        const int64_t qb = sub_bytes(qt), qs_at = (qt == kQ5_K ? 48 : 16) * ns;
        for (int sb = 0; sb < 8; ++sb) {
          const uint8_t* qs = row + qs_at + 16 * (8 * s + sb);
          uint32_t hb = 0;
          if (qt == kQ5_K) std::memcpy(&hb, row + 16 * ns + 4 * (8 * s + sb), 4);    // bit i: element i's
          for (int p = 0; p < 4; ++p)
            for (int t = 0; t < 4; ++t) sp[qb * sb + 64 * p + 4 * r + t] = qs[4 * p + t];
          for (int t = 0; t < 4 && qt == kQ5_K; ++t) sp[qb * sb + 256 + 4 * r + t] = q5_h_byte(hb, t);
        }
      } else {                     // the GGUF's Q6_K super-block
        const uint8_t* blk = row + 210 * s;
        uint8_t v[256];
        q6k_values(blk, v);
        for (int sb = 0; sb < 8; ++sb) {
          const uint8_t* e = v + 32 * sb;
          uint8_t* q = sp + 384 * sb;
          for (int p = 0; p < 4; ++p)
            for (int t = 0; t < 4; ++t) {
              const int i = 4 * p + t;
              q[64 * p + 4 * r + t] = (uint8_t)((e[i] & 15) | (e[16 + i] & 15) << 4);
              q[256 + 4 * r + t] |= (uint8_t)((e[i] >> 4) << (2 * p));
              q[320 + 4 * r + t] |= (uint8_t)((e[16 + i] >> 4) << (2 * p));
            }
        }
        for (int u = 0; u < 16; ++u) tail[16 * u + r] = blk[192 + u];
        std::memcpy(tail + 256 + 2 * r, blk + 208, 2);
      }
    }
  }
}

// Rows of x as the type's tiles read them: Q2_K / Q3_K per half (quantize_packed_x, Q3_K's offset 4), the K8 types
// per super-block (quantize_k8_x: Q6_K's sums per half, Q4_K / Q5_K's per sub-block).
KX round_x(const at::Tensor& x, int64_t qtype) {
  const int64_t K = x.size(1), nh = K / 16;
  if (k23(qtype)) {
    const PackedX px = quantize_packed_x(x, qtype == kQ3_K ? 4 : 0);
    return KX{px.q, px.dx, px.sxh, px.off, nullptr, nullptr, K, nh};
  }
  const K8X kx = quantize_k8_x(x, qtype == kQ6_K);
  return KX{kx.q, nullptr, nullptr, nullptr, kx.d, kx.bs, K, nh};
}

}  // namespace

// A Q6_K super-block (the GGUF's 210 bytes) as 256 values q + 32 in element order.
void q6k_values(const uint8_t* blk, uint8_t* v) {
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, t = (e % 128) / 32, l = e % 32;
    const int lo = (blk[64 * h + 32 * (t & 1) + l] >> (4 * (t >> 1))) & 15;
    const int hi = (blk[128 + 32 * h + l] >> (2 * t)) & 3;
    v[e] = (uint8_t)(lo | hi << 4);
  }
}

bool packable_k(int64_t qtype) { return k23(qtype) || qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K; }

at::Tensor pack_gemv_k(const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(K > 0 && K % 256 == 0, "tandem.pack_gemv: K must be a positive multiple of 256 for K-quants, got ", K);
  const int64_t ns = K / 256, rb = row_sb_bytes(qtype) * ns;
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == rb,
              "tandem.pack_gemv: w must be a contiguous uint8 [N, ", rb, "] tensor (QuantWeight.data)");
  const int64_t N = w.size(0), NG = (N + kG - 1) / kG, gbytes = ns * sb_bytes(qtype);
  at::Tensor out = at::zeros({NG, gbytes}, w.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  at::parallel_for(0, NG, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_group(qtype, wp, rb, ns, N, g, op + g * gbytes);
  });
  return out;
}

at::Tensor gemv_packed_k_q8act(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N,
                               const at::Tensor& bias, at::Tensor y, int body) {
  TORCH_CHECK(K > 0 && K % 256 == 0, "tandem.gemv_packed_q8act: K must be a positive multiple of 256 for K-quants");
  const int64_t ns = K / 256, NG = (N + kG - 1) / kG, gbytes = ns * sb_bytes(qtype);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == NG && packed.size(1) == gbytes,
              "tandem.gemv_packed_q8act: packed must be pack_gemv's uint8 [", NG, ", ", gbytes, "] for N = ", N);
  const int64_t M = x.size(0);
  if (M == 0) return y;
  const KX xr = round_x(x, qtype);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t per = body == 1 || M > 2 ? 1 : 4, chunks = (NG + per - 1) / per;
  stealing_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    const int64_t g0 = per * c0, g1 = std::min(per * c1, NG);
    switch (qtype) {
      case kQ2_K: kgroups<kQ2_K>(body, wp, gbytes, ns, xr, M, bp, yp, N, g0, g1); break;
      case kQ3_K: kgroups<kQ3_K>(body, wp, gbytes, ns, xr, M, bp, yp, N, g0, g1); break;
      case kQ4_K: kgroups<kQ4_K>(body, wp, gbytes, ns, xr, M, bp, yp, N, g0, g1); break;
      case kQ5_K: kgroups<kQ5_K>(body, wp, gbytes, ns, xr, M, bp, yp, N, g0, g1); break;
      default: kgroups<kQ6_K>(body, wp, gbytes, ns, xr, M, bp, yp, N, g0, g1); break;
    }
  });
  return y;
}


void gemv_packed_k_q8act_jobs(const at::Tensor& x, const at::Tensor& stacked, const std::vector<int64_t>& ids,
                              int64_t rep, int64_t qtype, int64_t K, int64_t N, float* y, int body) {
  TORCH_CHECK(K > 0 && K % 256 == 0, "tandem.gemv_packed_q8act: K must be a positive multiple of 256 for K-quants");
  const int64_t ns = K / 256, nh = K / 16, NG = (N + kG - 1) / kG, gbytes = ns * sb_bytes(qtype);
  const uint8_t* base = stacked_copies(stacked, ids, NG, gbytes, N);
  const int64_t J = (int64_t)ids.size();
  if (J == 0) return;
  const KX x0 = round_x(x, qtype);
  split_jobs(J, NG, body == 1 ? 1 : 4, [&](int64_t j, int64_t g0, int64_t g1) {   // gemv_packed_k_q8act's, one row
    const int64_t m = j / rep;
    const KX xr = k23(qtype) ? KX{x0.q + m * K, x0.dx + m * nh, x0.sxh + m * nh, x0.off + m * nh, nullptr, nullptr, K, nh}
                             : KX{x0.q + m * K, nullptr, nullptr, nullptr, x0.d8 + m * ns, x0.bs + 16 * m * ns, K, nh};
    const uint8_t* wp = base + ids[j] * NG * gbytes;
    float* yj = y + j * N;
    switch (qtype) {
      case kQ2_K: kgroups<kQ2_K>(body, wp, gbytes, ns, xr, 1, nullptr, yj, N, g0, g1); break;
      case kQ3_K: kgroups<kQ3_K>(body, wp, gbytes, ns, xr, 1, nullptr, yj, N, g0, g1); break;
      case kQ4_K: kgroups<kQ4_K>(body, wp, gbytes, ns, xr, 1, nullptr, yj, N, g0, g1); break;
      case kQ5_K: kgroups<kQ5_K>(body, wp, gbytes, ns, xr, 1, nullptr, yj, N, g0, g1); break;
      default: kgroups<kQ6_K>(body, wp, gbytes, ns, xr, 1, nullptr, yj, N, g0, g1); break;
    }
  });
}

}  // namespace tandem
