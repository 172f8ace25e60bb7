// MXFP4 in the packed layout (gemv_packed_q8act.cpp's header), shared by the pack (pack_gemv.cpp), the tiles and
// packed_gather.cpp's inverse. The quants are Q4_0's 4 nibble vectors; a block's 16 scales, where Q4_0 keeps its fp16
// d, are the bf16 of 2^(e - 128): exact for every exponent byte (bf16 has fp32's exponent range, subnormals
// included: 2^-128 is 0x0020), so the tiles widen them with one shift, as cvtph widens Q4_0's. The tiles look the
// masked nibbles up as value + 12 (kMxfp4Unsigned) and take 12 sum(x) off each half's sum, as Q4_0 takes 8.
#pragma once

#include <cstdint>

#include "mxfp4.h"
#include "vec.h"

namespace tandem {

inline uint16_t mxfp4_packed_scale(uint8_t e) {          // the bf16 bits of e8m0_half(e)
  return (uint16_t)(e < 2 ? 0x0020u << e : (uint32_t)(e - 1) << 7);
}
inline uint8_t mxfp4_exponent(uint16_t s) {              // the inverse
  return (uint8_t)(s >= 0x80 ? (s >> 7) + 1 : s == 0x0040 ? 1 : 0);
}

// A packed block's 16 scales (fp16 for Q4_0 / Q5_0 / Q8_0 / Q4_1's d, bf16 for MXFP4) as fp32 lanes.
template <int64_t QT>
TANDEM_KERNEL_VNNI inline __m512 packed_scales512(const uint8_t* sc) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)sc);
  if constexpr (QT == kMXFP4) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}
template <int64_t QT>
TANDEM_KERNEL_AVX2 inline __m256 packed_scales256(const uint8_t* sc) {       // 8 of them
  const __m128i h = _mm_loadu_si128((const __m128i*)sc);
  if constexpr (QT == kMXFP4) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

// Masked nibbles -> the bytes vpdpbusd / pmaddubsw take: MXFP4's value + 12, the others' nibbles as they are.
template <int64_t QT>
TANDEM_KERNEL_VNNI inline __m512i packed_values512(__m512i nibbles) {
  if constexpr (QT == kMXFP4)
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)kMxfp4Unsigned)), nibbles);
  else return nibbles;
}
template <int64_t QT>
TANDEM_KERNEL_AVX2 inline __m256i packed_values256(__m256i nibbles) {
  if constexpr (QT == kMXFP4)
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128((const __m128i*)kMxfp4Unsigned)), nibbles);
  else return nibbles;
}

}  // namespace tandem
