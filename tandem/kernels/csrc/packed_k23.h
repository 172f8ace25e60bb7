// The packed super-block of Q2_K and Q3_K (16 rows, gemv_packed_q8act_k23.inc's tiles), shared by the pack
// (gemv_packed_k_q8act.cpp) and packed_gather.cpp's inverse: where each byte of a row's GGUF super-block lands.
//
// GGUF super-blocks, 256 weights, element e = 128 h + 32 t + l (h < 2, t < 4, l < 32) has its low two bits at
// bits 2 t of qs[32 h + l]; 16-weight half u = e / 16 has its own scale:
//   Q2_K, 84 bytes: scales[16] (low nibble scale, high nibble min of half u), qs[64], d fp16, dmin fp16.
//   Q3_K, 110 bytes: hmask[32] (bit e / 32 of byte l: e's third bit), qs[64], scales[12] (6-bit, q3_k_scale),
//     d fp16. The unsigned value low | third << 2 (0..7) is the quant + 4.
// Packed (SB = 16 x the row's bytes; i = e % 16 = 4 p + t, p, t < 4):
//   quants: Q2_K 16 vectors L_u of 64 bytes, L_u at 64 u; Q3_K 8 sub-blocks of 192 bytes [L_2j L_2j+1 H_j] (j =
//     u / 2). Byte 4 r + t of L_u holds, at bits 2 p, 2 p + 1, the low bits of row r's element 16 u + 4 p + t,
//     so one shift and one mask give vector p: 4 quants of each row's int32 lane, vpdpbusd's operand. H_j holds
//     the third bits of the sub-block as packed_q5.h holds fifth bits (element 4 p + t at bit p, 16 + 4 p + t at
//     bit 4 + p of byte 4 r + t).
//   then the header bytes transposed (header byte i of row r at 16 i + r: Q2_K's 16 scale bytes, Q3_K's 12), then
//     d fp16 x 16, then (Q2_K) dmin fp16 x 16.
#pragma once

#include <cstdint>

namespace tandem {

constexpr int64_t kK23Q2 = 10, kK23Q3 = 11;   // ggml ids of Q2_K, Q3_K

constexpr int64_t k23_row_bytes(int64_t qt) { return qt == kK23Q2 ? 84 : 110; }        // a row's super-block
constexpr int64_t k23_quant_bytes(int64_t qt) { return qt == kK23Q2 ? 1024 : 1536; }    // a group's quants
// The GGUF bytes holding quants ([begin, end)); the others are the header, transposed in the tail.
constexpr int k23_quants_begin(int64_t qt) { return qt == kK23Q2 ? 16 : 0; }
constexpr int k23_quants_end(int64_t qt) { return qt == kK23Q2 ? 80 : 96; }
constexpr int k23_scale_bytes(int64_t qt) { return qt == kK23Q2 ? 16 : 12; }
constexpr int k23_scales_at(int64_t qt) { return qt == kK23Q2 ? 0 : 96; }             // in the GGUF block

// Offsets in a packed super-block: vector L_u, the sub-block's H, d x 16 (then Q2_K's dmin x 16), header byte j
// of row r (j: a scale byte, or a byte of d or dmin).
constexpr int64_t k23_low_at(int64_t qt, int u) { return qt == kK23Q2 ? 64 * u : 192 * (u / 2) + 64 * (u % 2); }
constexpr int64_t k23_high_at(int u) { return 192 * (u / 2) + 128; }
constexpr int64_t k23_d_at(int64_t qt) { return k23_quant_bytes(qt) + 16 * k23_scale_bytes(qt); }
inline int64_t k23_head_at(int64_t qt, int j, int r) {
  const int sc = k23_scales_at(qt), d = sc + k23_scale_bytes(qt);       // the GGUF's scale bytes [sc, d)
  if (j >= sc && j < d) return k23_quant_bytes(qt) + 16 * (j - sc) + r;
  const int dj = j - (qt == kK23Q2 ? 80 : d);                             // d's bytes 0, 1, then dmin's 2, 3
  return k23_d_at(qt) + 32 * (dj / 2) + 2 * r + dj % 2;
}

// Element e's unsigned value in a GGUF super-block, and its bits set into a zeroed one.
inline int k23_value(int64_t qt, const uint8_t* blk, int e) {
  const int h = e / 128, t = e % 128 / 32, l = e % 32;
  const int low = blk[k23_quants_end(qt) - 64 + 32 * h + l] >> 2 * t & 3;
  return qt == kK23Q2 ? low : low | (blk[l] >> e / 32 & 1) << 2;
}
inline void k23_set_value(int64_t qt, uint8_t* blk, int e, int v) {
  const int h = e / 128, t = e % 128 / 32, l = e % 32;
  blk[k23_quants_end(qt) - 64 + 32 * h + l] |= (uint8_t)((v & 3) << 2 * t);
  if (qt == kK23Q3) blk[l] |= (uint8_t)((v >> 2 & 1) << e / 32);
}

// Row r's element e in a packed super-block sp, and back: the value's bits at their places (sp zeroed first).
inline void k23_put(int64_t qt, uint8_t* sp, int r, int e, int v) {
  const int u = e / 16, p = e % 16 / 4, t = e % 4;
  sp[k23_low_at(qt, u) + 4 * r + t] |= (uint8_t)((v & 3) << 2 * p);
  if (qt == kK23Q3) sp[k23_high_at(u) + 4 * r + t] |= (uint8_t)((v >> 2 & 1) << (p + 4 * (u % 2)));
}
inline int k23_get(int64_t qt, const uint8_t* sp, int r, int e) {
  const int u = e / 16, p = e % 16 / 4, t = e % 4;
  const int low = sp[k23_low_at(qt, u) + 4 * r + t] >> 2 * p & 3;
  return qt == kK23Q2 ? low : low | (sp[k23_high_at(u) + 4 * r + t] >> (p + 4 * (u % 2)) & 1) << 2;
}

}  // namespace tandem
