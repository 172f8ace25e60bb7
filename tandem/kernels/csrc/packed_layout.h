// The packed layout's sizes for the 32-weight types (gemv_packed_q8act.cpp's header describes the layout): shared
// by the op that packs a weight (pack_gemv.cpp) and the one that reads it (gemv_packed_q8act.cpp).
#pragma once

#include <cstdint>

#include "mxfp4.h"

namespace tandem {
namespace {

enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8 };
constexpr int kG = 16;                      // output rows of a group: the int32 / fp32 lanes

constexpr int64_t quant_bytes(int64_t qt) { return qt == kQ8_0 ? 512 : qt == kQ5_0 ? 320 : 256; }   // QB
constexpr int64_t scale_bytes(int64_t qt) { return qt == kQ4_1 ? 64 : 32; }                          // SB
constexpr int64_t row_block_bytes(int64_t qt) {
  return qt == kQ4_0 ? 18 : qt == kQ4_1 ? 20 : qt == kQ5_0 ? 22 : qt == kMXFP4 ? 17 : 34;
}
bool packable(int64_t qt) { return qt == kQ4_0 || qt == kQ4_1 || qt == kQ5_0 || qt == kQ8_0 || qt == kMXFP4; }
// What the unsigned weight bytes add to a half's sum, in units of sum(x) (quantize_packed_x's unit).
constexpr int32_t x_offset(int64_t qt) {
  return qt == kQ4_0 ? 8 : qt == kQ5_0 ? 16 : qt == kQ8_0 ? 128 : qt == kMXFP4 ? kMxfp4Offset : 0;
}

}  // namespace
}  // namespace tandem
