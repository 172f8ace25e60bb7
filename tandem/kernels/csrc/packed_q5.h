// The fifth bits of a 32-weight block (Q5_0's block, Q5_K's sub-block) in a packed group of 16 rows, shared by
// the packs (gemv_packed_q8act.cpp, gemv_packed_k_q8act.cpp), their tiles and packed_gather.cpp's inverse: 64 bytes H
// after the block's 4 nibble vectors, byte 4 r + t of H holding row r's fifth bit of element 4 p + t at bit p and of
// element 16 + 4 p + t at bit 4 + p (qh: bit i element i's, quant.py's row layout). So vector p's fifth bits
// reach bit 4 of its bytes by one 16-bit shift (none for p = 0 of the high nibbles) and one masked OR.
#pragma once

#include <immintrin.h>

#include "vec.h"

#include <cstdint>

namespace tandem {

// Byte 4 r + t of H from row r's qh, and back: the bits of qh that byte t of every row's H holds.
inline uint8_t q5_h_byte(uint32_t qh, int t) {
  uint32_t h = 0;
  for (int p = 0; p < 4; ++p) h |= (qh >> (4 * p + t) & 1) << p | (qh >> (16 + 4 * p + t) & 1) << (4 + p);
  return (uint8_t)h;
}
inline uint32_t q5_qh_bits(uint8_t h, int t) {
  uint32_t qh = 0;
  for (int p = 0; p < 4; ++p)
    qh |= (uint32_t)(h >> p & 1) << (4 * p + t) | (uint32_t)(h >> (4 + p) & 1) << (16 + 4 * p + t);
  return qh;
}

// Vector p's nibbles of half h (lo, 0..15) with their fifth bits from the block's H vector hb: the 5-bit values.
TANDEM_KERNEL_AVX512 inline __m512i q5_bits512(__m512i lo, __m512i hb, int p, int h) {
  const __m512i hi = h ? (p ? _mm512_srli_epi16(hb, p) : hb) : _mm512_slli_epi16(hb, 4 - p);
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi8(0x10), 0xf8);         // lo | (hi & 0x10)
}
TANDEM_KERNEL_AVX2 inline __m256i q5_bits256(__m256i lo, __m256i hb, int p, int h) {
  const __m256i hi = h ? (p ? _mm256_srli_epi16(hb, p) : hb) : _mm256_slli_epi16(hb, 4 - p);
  return _mm256_or_si256(lo, _mm256_and_si256(hi, _mm256_set1_epi8(0x10)));
}

}  // namespace tandem
