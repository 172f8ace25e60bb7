// MXFP4 (ggml type 39, gpt-oss's experts), the pieces every kernel of the type shares. A 32-weight block is an
// E8M0 exponent e and 16 bytes of nibbles in Q4_0's order; a QuantWeight row holds [e x nb][qs 16 bytes x nb]
// (quant.py). Value i = kMxfp4Values[nibble i] * 2^(e - 127) / 2: the table holds the E2M1 values doubled (so
// they are integers, -12..12), hence the half in the scale (ggml's GGML_E8M0_TO_FP32_HALF).
//
// In the int8 kernels the values are reached by one 16-entry byte lookup (vpshufb) of the masked nibbles. The
// lookup gives the unsigned value + 12 (0..24) where a kernel multiplies unsigned weight bytes (vpdpbusd,
// pmaddubsw), the 12 taken back exactly as 12 sum(xq) (an int32 term, or -12 d sx per block as Q4_0's -8 d sx),
// and the signed value where the kernel takes signed quants (gemm_rows_q8act's unpacked rows).
#pragma once

#include <cstdint>
#include <cstring>

#include "vec.h"

namespace tandem {

constexpr int64_t kMXFP4 = 39;                                 // ggml type id
constexpr int kMxfp4Offset = 12;                               // -min of the values: unsigned = value + 12
constexpr int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// 2^(e - 128) as fp32 from the exponent's bits: (e - 1) << 23, and the subnormals 2^-128, 2^-127 for e < 2.
// Exact for every byte (2^127 at e = 255), so no byte is NaN (ggml does not treat 0xff as NaN either).
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// A row's block scales, once per row and call: dst[b] = e8m0_half(e[b]) for b < nb.
inline void e8m0_halves(const uint8_t* e, int64_t nb, float* dst) {
  for (int64_t b = 0; b < nb; ++b) dst[b] = e8m0_half(e[b]);
}

// The unsigned vpshufb table: kMxfp4Values + 12.
alignas(16) constexpr int8_t kMxfp4Unsigned[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// One block's 32 weights as fp32 for linear_rows' bodies (its dequant_block), in Vec512's / Vec256's register
// order. Each value times d is exact (a power of two times an integer below 16), so any body equals the scalar
// kMxfp4Values[q] * d bit for bit.
struct Mxfp4Vec512 {
  TANDEM_AVX512 void block(const uint8_t* qs, float d, __m512 out[2]) {       // the 16 levels scaled, vpermps
    const __m512 levels = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)kMxfp4Values)));
    Vec512::lookup(qs, _mm512_mul_ps(levels, _mm512_set1_ps(d)), out);
  }
};

struct Mxfp4Vec256 {
  TANDEM_AVX2 void block(const uint8_t* qs, float d, __m256 out[4]) {         // elements 0-7, 8-15, 16-23, 24-31
    const __m128i b = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0f);
    const __m128i table = _mm_loadu_si128((const __m128i*)kMxfp4Values);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, m));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])), _mm256_set1_ps(d));
  }
};

}  // namespace tandem
