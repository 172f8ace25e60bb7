// The q8_0 KV cache's format (kv_cache_dtype="q8_0", llama.cpp's -ctk q8_0 -ctv q8_0): a head's K or V row of D
// elements is D / 32 blocks of 34 bytes, llama.cpp's block_q8_0: an fp16 scale d, then 32 int8 quants q; the
// element is d * q. A slot's row per layer is [2, KVH, D / 32 * 34] bytes, so the cache is a uint8 tensor
// [S + 1, L, 2, KVH, D / 32 * 34] and every slot-indexed copy (gathers, the prefix cache) moves it as bytes.
//
// Readers widen an element to fp32 exactly (an int8 times an fp16 needs 7 + 11 bits of mantissa), so the
// attention over a q8_0 cache is the attention over its dequantized values, whatever body reads it. Writers
// round as the torch reference (kernels/kv_quant.py) does, bit for bit: d = max|x| / 127 in fp32, q =
// round-half-even(x * (1 / d)) (0 where d is 0), d stored rounded to fp16 (llama.cpp quantizes with the fp32 d
// too; it rounds halves away from zero).
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tandem {

struct KvQ8 { uint8_t byte; };           // one byte of a q8_0 row: pointer arithmetic in bytes

constexpr int64_t Q8_BLOCK = 32, Q8_BYTES = 34;

// Elements of the cache's type a head's row of D takes (the row stride of every pointer over the cache).
template <typename T> constexpr int64_t row_elems(int64_t D) { return D; }
template <> constexpr int64_t row_elems<KvQ8>(int64_t D) { return D / Q8_BLOCK * Q8_BYTES; }

inline float q8_scale(const KvQ8* block) {
  uint16_t h;
  std::memcpy(&h, block, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Element i of a head's row, widened to fp32 (the scalar bodies' and the SIMD tails' read).
template <typename T> inline float elem(const T* row, int64_t i) { return static_cast<float>(row[i]); }
inline float elem(const KvQ8* row, int64_t i) {
  const KvQ8* b = row + i / Q8_BLOCK * Q8_BYTES;
  return static_cast<float>(static_cast<int8_t>(b[2 + i % Q8_BLOCK].byte)) * q8_scale(b);
}

// Store n floats into a head's row of the cache's type, rounded as torch rounds (c10's constructors).
template <typename T> inline void put_row(const float* x, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(x[i]);
}
inline void put_row(const float* x, int64_t n, KvQ8* out) {      // n % 32 == 0
  for (int64_t b = 0; b < n / Q8_BLOCK; ++b, x += Q8_BLOCK, out += Q8_BYTES) {
    float amax = 0.f;
    for (int64_t i = 0; i < Q8_BLOCK; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f, id = d != 0.f ? 1.f / d : 0.f;
    const uint16_t h = c10::Half(d).x;
    std::memcpy(out, &h, 2);
    for (int64_t i = 0; i < Q8_BLOCK; ++i) {
      const float r = std::nearbyint(x[i] * id);      // the default rounding mode: half to even, as torch.round
      out[2 + i].byte = static_cast<uint8_t>(static_cast<int8_t>(r));
    }
  }
}

}  // namespace tandem
