// Vector helpers shared by the kernels, and the one place that picks an ISA.
//
// Each ISA is a struct of static inline functions over one register type (Vec512: 16 fp32 lanes,
// Vec256: 8 lanes). Every function carries its own target attribute, so this header compiles at the
// baseline (x86-64) and nothing here runs unless best_isa() said the CPU has it. The SIMD kernel bodies
// are written once over `V` and compiled once per ISA with its target attribute (simd_namespaces.inc).
// Vec1 is the same interface over one plain float, for scalar bodies that share a polynomial with the SIMD
// ones. exp and log (vec_math.inc) are written once and included into each of the three structs.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

// The one target string of each ISA a function is compiled for; nothing else in csrc names a target. A
// function carries TANDEM_KERNEL_<ISA> (TANDEM_<ISA> where it is a static inline helper); a body written once
// over `V` gets its ISA's through KERNEL (simd_namespaces.inc).
#define TANDEM_TARGET_F16C "sse4.1,f16c"                                       // block scales' conversions
#define TANDEM_TARGET_AVX2 "avx2,fma,f16c"
#define TANDEM_TARGET_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"
#define TANDEM_TARGET_VNNI "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c"    // int8 dot products
#define TANDEM_TARGET_BF16 TANDEM_TARGET_AVX512 ",avx512bf16"                   // bf16 dot products
#define TANDEM_TARGET_AMX "amx-tile,amx-int8," TANDEM_TARGET_AVX512              // int8 tiles
#define TANDEM_KERNEL_F16C __attribute__((target(TANDEM_TARGET_F16C)))
#define TANDEM_KERNEL_AVX2 __attribute__((target(TANDEM_TARGET_AVX2)))
#define TANDEM_KERNEL_AVX512 __attribute__((target(TANDEM_TARGET_AVX512)))
#define TANDEM_KERNEL_VNNI __attribute__((target(TANDEM_TARGET_VNNI)))
#define TANDEM_KERNEL_BF16 __attribute__((target(TANDEM_TARGET_BF16)))
#define TANDEM_KERNEL_AMX __attribute__((target(TANDEM_TARGET_AMX)))
#define TANDEM_F16C TANDEM_KERNEL_F16C __attribute__((always_inline)) static inline
#define TANDEM_AVX512 __attribute__((target(TANDEM_TARGET_AVX512), always_inline)) static inline
#define TANDEM_AVX2 __attribute__((target(TANDEM_TARGET_AVX2), always_inline)) static inline
// The ISA dispatch: the body `name` of the level `isa` picks, each level's in a namespace of its own (avx512::,
// avx2::, scalar::; simd_namespaces.inc makes the first two of one body written over `V`).
#define TANDEM_BODY(isa, name) \
  ((isa) == ::tandem::kAvx512 ? avx512::name : (isa) == ::tandem::kAvx2 ? avx2::name : scalar::name)

namespace tandem {

enum Isa : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best body this CPU runs, capped by TANDEM_ISA=scalar|avx2|avx512 (for tests and comparisons).
Isa best_isa();
// `requested` < 0: best_isa(); otherwise min(requested, what the CPU supports).
Isa resolve_isa(int64_t requested);
const char* isa_name(Isa isa);

// IEEE half -> float without F16C (the scalar body's specification of the block scales).
inline float fp16_to_fp32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);                      // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);             // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;                                                 // +-0
  } else {                                                       // subnormal: normalize
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400));
    bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// Q6_K: 32 signed 6-bit quants as int8, from 32 bytes of low nibbles (ql >> lshift) and 32 bytes holding
// 2 high bits each (qh >> hshift); both bodies share it (AVX2 integer ops).
TANDEM_AVX2 __m256i q6_k_bytes(const uint8_t* ql, int lshift, const uint8_t* qh, int hshift) {
  __m256i l = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)ql), lshift);
  __m256i h = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i*)qh), hshift);
  l = _mm256_and_si256(l, _mm256_set1_epi8(0x0f));
  h = _mm256_and_si256(h, _mm256_set1_epi8(0x03));
  return _mm256_sub_epi8(_mm256_or_si256(l, _mm256_slli_epi16(h, 4)), _mm256_set1_epi8(32));
}

struct Vec512 {
  using reg = __m512;
  static constexpr int W = 16;
  TANDEM_AVX512 reg zero() { return _mm512_setzero_ps(); }
  TANDEM_AVX512 reg set1(float v) { return _mm512_set1_ps(v); }
  TANDEM_AVX512 reg load(const float* p) { return _mm512_loadu_ps(p); }
  TANDEM_AVX512 void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  // 16 bf16 / fp16 values -> fp32 (exact: a bf16 is the top half of an fp32; fp16 by the F16C conversion).
  TANDEM_AVX512 reg load_bf16(const void* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
  TANDEM_AVX512 reg load_f16(const void* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  TANDEM_AVX512 reg load_i8(const void* p) {                 // 16 int8 -> fp32 (exact)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
  // The 16 horizontal sums of a[0..16) in one register (lane j: the sum of a[j]'s lanes), by transposing adds:
  // ~3 instructions a sum where hsum takes ~8 (the decode attention's scores).
  TANDEM_AVX512 reg reduce_lanes(const reg* a) {
    reg b[8], c[4], d[2];
    for (int p = 0; p < 8; ++p)            // lanes of each 128-bit quarter: [x0+x2, y0+y2, x1+x3, y1+y3]
      b[p] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm512_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int p = 0; p < 4; ++p)            // each quarter: the 4 vectors 4p..4p+3 summed over its 4 elements
      c[p] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm512_shuffle_ps(b[2 * p], b[2 * p + 1], 0xEE));
    for (int p = 0; p < 2; ++p)
      d[p] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0x88),
                           _mm512_shuffle_f32x4(c[2 * p], c[2 * p + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
  }
  // The 4-chain scores (decode_attention_simd.inc's score_block): a register holds W / 4 keys x 4 elements.
  TANDEM_AVX512 reg bcast4(const float* p) { return _mm512_broadcast_f32x4(_mm_loadu_ps(p)); }   // into each quarter
  // r[k]: 16 elements d .. d + 16 of key k < 4 -> s[i]: elements d + 4 i .. d + 4 i + 4 of keys 0-3, a quarter each.
  TANDEM_AVX512 void keys_to_steps(const reg* r, reg* s) {
    const reg x = _mm512_shuffle_f32x4(r[0], r[1], 0x44), y = _mm512_shuffle_f32x4(r[2], r[3], 0x44);
    const reg z = _mm512_shuffle_f32x4(r[0], r[1], 0xEE), w = _mm512_shuffle_f32x4(r[2], r[3], 0xEE);
    s[0] = _mm512_shuffle_f32x4(x, y, 0x88);
    s[1] = _mm512_shuffle_f32x4(x, y, 0xDD);
    s[2] = _mm512_shuffle_f32x4(z, w, 0x88);
    s[3] = _mm512_shuffle_f32x4(z, w, 0xDD);
  }
  // a[g]: keys 4 g .. 4 g + 4, a quarter each holding its 4 chains c0-c3 -> the 16 keys' ((c0 + c1) + c2) + c3.
  TANDEM_AVX512 reg fold4(const reg* a) {
    const reg la = _mm512_unpacklo_ps(a[0], a[1]), lb = _mm512_unpacklo_ps(a[2], a[3]);
    const reg ha = _mm512_unpackhi_ps(a[0], a[1]), hb = _mm512_unpackhi_ps(a[2], a[3]);
    reg r = _mm512_add_ps(_mm512_shuffle_ps(la, lb, 0x44), _mm512_shuffle_ps(la, lb, 0xEE));
    r = _mm512_add_ps(r, _mm512_shuffle_ps(ha, hb, 0x44));
    r = _mm512_add_ps(r, _mm512_shuffle_ps(ha, hb, 0xEE));            // lane 4 k + g: key 4 g + k
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutex2var_ps(r, idx, r);
  }
  TANDEM_AVX512 reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  TANDEM_AVX512 reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  TANDEM_AVX512 reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  TANDEM_AVX512 float hsum(reg v) { return _mm512_reduce_add_ps(v); }
  TANDEM_AVX512 reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  TANDEM_AVX512 reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  TANDEM_AVX512 reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a * b
  TANDEM_AVX512 reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  TANDEM_AVX512 reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  // Lanes where a == b take x, the others y; whether every lane of a equals b's.
  TANDEM_AVX512 reg select_eq(reg a, reg b, reg x, reg y) {
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ), y, x);
  }
  TANDEM_AVX512 bool all_eq(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ) == 0xFFFF; }
  TANDEM_AVX512 float hmax(reg v) { return _mm512_reduce_max_ps(v); }
  // 32-bit integer lanes (the sampler's counter-based hash, race_noise_simd.inc).
  using ireg = __m512i;
  TANDEM_AVX512 ireg iset1(uint32_t v) { return _mm512_set1_epi32((int)v); }
  TANDEM_AVX512 ireg iota_i() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  TANDEM_AVX512 ireg iadd(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
  TANDEM_AVX512 ireg imul(ireg a, ireg b) { return _mm512_mullo_epi32(a, b); }          // the low 32 bits
  TANDEM_AVX512 ireg ixor(ireg a, ireg b) { return _mm512_xor_si512(a, b); }
  TANDEM_AVX512 ireg ishr(ireg a, int n) { return _mm512_srli_epi32(a, n); }            // logical
  TANDEM_AVX512 reg to_float(ireg a) { return _mm512_cvtepi32_ps(a); }                  // signed lanes
  TANDEM_AVX512 reg round(reg v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TANDEM_AVX512 reg ldexp(reg v, reg n) { return _mm512_scalef_ps(v, n); }       // v 2^n, n integral
  TANDEM_AVX512 reg zero_below(reg x, reg lo, reg v) {                          // x < lo ? 0 : v
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), v);
  }
  // log of a positive normal x: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then log_poly.
  TANDEM_AVX512 reg log(reg x) {
    reg e = _mm512_getexp_ps(x);
    reg m = _mm512_getmant_ps(x, _MM_MANT_NORM_1_2, _MM_MANT_SIGN_src);
    __mmask16 big = _mm512_cmp_ps_mask(m, set1(1.41421356f), _CMP_GT_OQ);
    m = _mm512_mask_mul_ps(m, big, m, set1(0.5f));
    e = _mm512_mask_add_ps(e, big, e, set1(1.f));
    return log_poly(m, e);
  }
#define TANDEM_VEC_FN TANDEM_AVX512
#include "vec_math.inc"
#undef TANDEM_VEC_FN
  TANDEM_AVX512 void halves(const uint8_t* src, float* dst, int64_t n) {   // n fp16 -> fp32
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(src + 2 * i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(load_u16(src + 2 * i));
  }
  // One block's 32 weights (element i < 16: low nibble of byte i, i >= 16: high nibble of byte i - 16).
  // The 16 levels of the block are a table in one register, and vpermps looks each nibble up in it (it
  // reads only the low 4 bits of each index lane), so no per-element int -> float conversion is needed.
  // Values equal gguf-py's: d * (q - 8) for Q4_0, d * q + m (unfused) for Q4_1, d * q for Q8_0.
  TANDEM_AVX512 void lookup(const uint8_t* qs, reg table, reg out[2]) {
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)qs));
    out[0] = _mm512_permutexvar_ps(v, table);
    out[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table);
  }
  TANDEM_AVX512 reg iota(float offset) {
    return _mm512_add_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), set1(offset));
  }
  TANDEM_AVX512 void q4_0(const uint8_t* qs, float d, reg out[2]) {
    lookup(qs, _mm512_mul_ps(iota(-8.f), set1(d)), out);
  }
  TANDEM_AVX512 void q4_1(const uint8_t* qs, float d, float m, reg out[2]) {
    lookup(qs, _mm512_add_ps(_mm512_mul_ps(iota(0.f), set1(d)), set1(m)), out);
  }
  TANDEM_AVX512 void q8_0(const int8_t* qs, float d, reg out[2]) {
    reg vd = set1(d);
    out[0] = mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)qs))), vd);
    out[1] = mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(qs + 16)))), vd);
  }
  // Q6_K 32 weights: (4 bits of ql >> lshift) | (2 bits of qh >> hshift) << 4, minus 32; elements 0-15
  // scaled by d0, 16-31 by d1.
  TANDEM_AVX512 void q6_k(const uint8_t* ql, int lshift, const uint8_t* qh, int hshift, float d0, float d1,
                          reg out[2]) {
    __m256i q = q6_k_bytes(ql, lshift, qh, hshift);
    out[0] = mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), set1(d0));
    out[1] = mul(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), set1(d1));
  }
};

struct Vec256 {
  using reg = __m256;
  static constexpr int W = 8;
  TANDEM_AVX2 reg zero() { return _mm256_setzero_ps(); }
  TANDEM_AVX2 reg set1(float v) { return _mm256_set1_ps(v); }
  TANDEM_AVX2 reg load(const float* p) { return _mm256_loadu_ps(p); }
  TANDEM_AVX2 void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  TANDEM_AVX2 reg load_bf16(const void* p) {                 // 8 bf16 / fp16 values -> fp32 (exact)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
  }
  TANDEM_AVX2 reg load_f16(const void* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  TANDEM_AVX2 reg load_i8(const void* p) {                   // 8 int8 -> fp32 (exact)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
  TANDEM_AVX2 reg reduce_lanes(const reg* a) {     // the 8 horizontal sums of a[0..8), as Vec512's
    reg b[4], c[2];
    for (int p = 0; p < 4; ++p)
      b[p] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * p], a[2 * p + 1]), _mm256_unpackhi_ps(a[2 * p], a[2 * p + 1]));
    for (int p = 0; p < 2; ++p)
      c[p] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0x44), _mm256_shuffle_ps(b[2 * p], b[2 * p + 1], 0xEE));
    return _mm256_add_ps(_mm256_permute2f128_ps(c[0], c[1], 0x20), _mm256_permute2f128_ps(c[0], c[1], 0x31));
  }
  // The 4-chain scores, as Vec512's: a register holds 2 keys x 4 elements.
  TANDEM_AVX2 reg bcast4(const float* p) { return _mm256_broadcast_ps((const __m128*)p); }
  TANDEM_AVX2 void keys_to_steps(const reg* r, reg* s) {   // r[k]: 8 elements of key k < 2 -> 2 steps of 4
    s[0] = _mm256_permute2f128_ps(r[0], r[1], 0x20);
    s[1] = _mm256_permute2f128_ps(r[0], r[1], 0x31);
  }
  TANDEM_AVX2 reg fold4(const reg* a) {                    // a[g]: keys 2 g, 2 g + 1 -> 8 scores in key order
    const reg la = _mm256_unpacklo_ps(a[0], a[1]), lb = _mm256_unpacklo_ps(a[2], a[3]);
    const reg ha = _mm256_unpackhi_ps(a[0], a[1]), hb = _mm256_unpackhi_ps(a[2], a[3]);
    reg r = _mm256_add_ps(_mm256_shuffle_ps(la, lb, 0x44), _mm256_shuffle_ps(la, lb, 0xEE));
    r = _mm256_add_ps(r, _mm256_shuffle_ps(ha, hb, 0x44));
    r = _mm256_add_ps(r, _mm256_shuffle_ps(ha, hb, 0xEE));            // lane 4 h + g: key 2 g + h
    return _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  }
  TANDEM_AVX2 reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  TANDEM_AVX2 reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  TANDEM_AVX2 reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  TANDEM_AVX2 float hsum(reg v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  TANDEM_AVX2 reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  TANDEM_AVX2 reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  TANDEM_AVX2 reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }     // c - a * b
  TANDEM_AVX2 reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  TANDEM_AVX2 reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  TANDEM_AVX2 reg select_eq(reg a, reg b, reg x, reg y) {
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(a, b, _CMP_EQ_OQ));
  }
  TANDEM_AVX2 bool all_eq(reg a, reg b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)) == 0xFF; }
  TANDEM_AVX2 float hmax(reg v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // 32-bit integer lanes, as Vec512's.
  using ireg = __m256i;
  TANDEM_AVX2 ireg iset1(uint32_t v) { return _mm256_set1_epi32((int)v); }
  TANDEM_AVX2 ireg iota_i() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  TANDEM_AVX2 ireg iadd(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
  TANDEM_AVX2 ireg imul(ireg a, ireg b) { return _mm256_mullo_epi32(a, b); }
  TANDEM_AVX2 ireg ixor(ireg a, ireg b) { return _mm256_xor_si256(a, b); }
  TANDEM_AVX2 ireg ishr(ireg a, int n) { return _mm256_srli_epi32(a, n); }
  TANDEM_AVX2 reg to_float(ireg a) { return _mm256_cvtepi32_ps(a); }
  TANDEM_AVX2 reg round(reg v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  TANDEM_AVX2 reg ldexp(reg v, reg n) {     // v 2^n for integral n in [-126, 127]: n + 127 is 2^n's exponent field
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(v, _mm256_castsi256_ps(e));
  }
  TANDEM_AVX2 reg zero_below(reg x, reg lo, reg v) { return _mm256_and_ps(_mm256_cmp_ps(x, lo, _CMP_GE_OQ), v); }
  TANDEM_AVX2 reg log(reg x) {              // as Vec512::log, the exponent and mantissa from the bits
    __m256i b = _mm256_castps_si256(x);
    reg e = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(127)));
    reg m = _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x007fffff)),
                                                _mm256_set1_epi32(0x3f800000)));
    reg big = _mm256_cmp_ps(m, set1(1.41421356f), _CMP_GT_OQ);
    m = _mm256_blendv_ps(m, mul(m, set1(0.5f)), big);
    e = add(e, _mm256_and_ps(big, set1(1.f)));
    return log_poly(m, e);
  }
#define TANDEM_VEC_FN TANDEM_AVX2
#include "vec_math.inc"
#undef TANDEM_VEC_FN
  TANDEM_AVX2 void halves(const uint8_t* src, float* dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 2 * i))));
    for (; i < n; ++i) dst[i] = _cvtsh_ss(load_u16(src + 2 * i));
  }
  // One block's 32 weights as Vec512's, in 4 registers: elements 0-7, 8-15 (low nibbles of bytes 0-7,
  // 8-15), 16-23, 24-31 (high nibbles). AVX2's vpermps indexes only 8 lanes, so nibbles are converted.
  TANDEM_AVX2 void nibbles(const uint8_t* qs, reg out[4]) {
    __m128i b = _mm_loadu_si128((const __m128i*)qs), m = _mm_set1_epi8(0x0f);
    __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
  TANDEM_AVX2 void q4_0(const uint8_t* qs, float d, reg out[4]) {
    nibbles(qs, out);
    reg vd = set1(d), eight = set1(8.f);
    for (int i = 0; i < 4; ++i) out[i] = mul(_mm256_sub_ps(out[i], eight), vd);
  }
  TANDEM_AVX2 void q4_1(const uint8_t* qs, float d, float m, reg out[4]) {
    nibbles(qs, out);
    reg vd = set1(d), vm = set1(m);
    for (int i = 0; i < 4; ++i) out[i] = add(mul(out[i], vd), vm);
  }
  TANDEM_AVX2 void q8_0(const int8_t* qs, float d, reg out[4]) {
    reg vd = set1(d);
    for (int i = 0; i < 4; ++i)
      out[i] = mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(qs + 8 * i)))), vd);
  }
  TANDEM_AVX2 void q6_k(const uint8_t* ql, int lshift, const uint8_t* qh, int hshift, float d0, float d1,
                        reg out[4]) {
    __m256i q = q6_k_bytes(ql, lshift, qh, hshift);
    __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      out[i] = mul(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[i])), set1(i < 2 ? d0 : d1));
  }
};

// One lane, plain C++ at the baseline ISA (no FMA: fma rounds twice, so its results may differ from the SIMD
// structs' in the last bits).
struct Vec1 {
  using reg = float;
  static constexpr int W = 1;
  static inline reg set1(float v) { return v; }
  static inline reg add(reg a, reg b) { return a + b; }
  static inline reg sub(reg a, reg b) { return a - b; }
  static inline reg mul(reg a, reg b) { return a * b; }
  static inline reg fma(reg a, reg b, reg c) { return a * b + c; }
  static inline reg fnmadd(reg a, reg b, reg c) { return c - a * b; }
  static inline reg min(reg a, reg b) { return b < a ? b : a; }
  static inline reg max(reg a, reg b) { return a < b ? b : a; }
  static inline reg select_eq(reg a, reg b, reg x, reg y) { return a == b ? x : y; }
  static inline bool all_eq(reg a, reg b) { return a == b; }
  static inline reg round(reg v) { return std::nearbyint(v); }
  static inline reg ldexp(reg v, reg n) { return std::ldexp(v, (int)n); }
  static inline reg zero_below(reg x, reg lo, reg v) { return x >= lo ? v : 0.f; }
  static inline reg log(reg x) {            // as Vec256::log
    uint32_t b;
    std::memcpy(&b, &x, 4);
    float e = (float)((int)(b >> 23) - 127);
    b = (b & 0x007fffffu) | 0x3f800000u;
    float m;
    std::memcpy(&m, &b, 4);
    if (m > 1.41421356f) { m *= 0.5f; e += 1.f; }
    return log_poly(m, e);
  }
#define TANDEM_VEC_FN static inline
#include "vec_math.inc"
#undef TANDEM_VEC_FN
};

}  // namespace tandem
