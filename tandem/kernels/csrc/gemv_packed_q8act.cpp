// The int8 GEMV on weights repacked at load (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4; an AVX-512 VNNI and an AVX2 body): for the rows
// of x of a decode step or a speculative verify step (up to gemv_packed_q8act_max_rows()), each output computed by
// gemm_rows_q8act's operations in gemm_rows_q8act's order (gemm_rows_q8act.cpp's header), so its rows are bit for bit
// the GEMM's and gemv_rows_q8act's at any row count.
//
// Why another layout: gemv_rows_q8act reads the weight rows as they are (lanes over 16 rows, 64 bytes of one row a
// load), so each vpdpbusd leaves 4-product partials of one row that must be summed across lanes and transposed
// (reduce4, lanes4: ~2.7 shuffle or add per vpdpbusd, all on the one 512-bit shuffle port of Intel cores), and
// all of it again for every row of x. Here a group of 16 output rows is interleaved once at load so that one
// vector holds, for each of the 16 rows, 4 consecutive quants along K in its int32 lane: a vpdpbusd against 4
// bytes of x broadcast adds 4 products to each row's own lane, so 4 of them give a half's 16 exact sums in
// output order, with no reduction; the unpacked quants of a block serve every row of x.
//
// Packed tensor: uint8 [ceil(N / 16), nb * (QB + SB)], group g = output rows 16 g .. 16 g + 15 (rows past N zero):
//   [quants, QB bytes a block] x nb, then [d fp16 x 16] x nb, then (Q4_1) [m fp16 x 16] x nb.
//   Q4_0 / Q4_1, QB = 256: 4 vectors p of 64 bytes; byte 4 r + t of vector p is byte 4 p + t of row r's 16 qs
//     bytes of the block (GGUF order: low nibble element 4 p + t, high nibble element 16 + 4 p + t), so the low
//     nibbles of vector p are half 0's quants 4 p .. 4 p + 3 of every row and the high nibbles half 1's.
//   Q5_0, QB = 320: Q4_0's 4 vectors, then H, the block's 64 bytes of fifth bits (packed_q5.h).
//   MXFP4, QB = 256: Q4_0's 4 vectors, looked up as value + 12; its scales bf16 where Q4_0's d is (packed_mxfp4.h).
//   Q8_0, QB = 512: vector 4 h + p holds byte 16 h + 4 p + t of row r's 32 quants at 4 r + t, xor 0x80 (w + 128,
//     unsigned for vpdpbusd).
// The operand vpdpbusd takes unsigned is the weight: Q4_1's nibbles are its quants; Q4_0's are q + 8, so a half's
// sum loses 8 sum(x) (Q5_0's 5-bit values q + 16: 16 sum(x)); Q8_0's bytes are q + 128, so it loses 128 sum(x)
// (sum(x) exact per half and row of x).
// Then, half after half: f = fma(float(isum_u), dx_u dw_u, f), Q4_1 f = fma(sxh_u, m_u, f); y = f + bias.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "ops.h"
#include "packed_layout.h"
#include "packed_mxfp4.h"
#include "packed_q5.h"
#include "vec.h"

namespace tandem {

bool cpu_has_vnni();

namespace {

struct XRows {              // rows of x rounded as gemm_rows_q8act rounds them (quantize_act_row), natural order
  const int8_t* q;              // [M][K]
  const float *dx, *sxh;        // [M][nh]
  const int32_t* off;           // [M][nh]: what the unsigned weight bytes add to a half's sum (Q4_0 8 sum(x),
                                // Q5_0 16 sum(x), Q8_0 128 sum(x); Q4_1 none)
  int64_t K, nh;
};

// Output rows of GT consecutive groups against rows m0 .. m0 + MT - 1 of x. The GT x MT fp32 chains are
// independent, so their fma latencies overlap (one row alone, GT = 4; several rows, their chains).
template <int64_t QT, int GT, int MT>
TANDEM_KERNEL_VNNI void tile(const uint8_t* gp, int64_t gbytes, int64_t nb, const XRows& x, int64_t m0,
                             const float* bias, float* y, int64_t ldy, int64_t n0, int64_t N) {
  constexpr int64_t QB = quant_bytes(QT);
  const __m512i m4 = _mm512_set1_epi8(0x0f);
  __m512 f[GT][MT];
  for (int g = 0; g < GT; ++g)
    for (int j = 0; j < MT; ++j) f[g][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int g = 0; g < GT; ++g) {
      const uint8_t* q = gp + g * gbytes + b * QB;
      const uint8_t* sc = gp + g * gbytes + nb * QB + 32 * b;
      __m512i w[8];
      if constexpr (QT == kQ8_0) {
        for (int i = 0; i < 8; ++i) w[i] = _mm512_loadu_si512(q + 64 * i);
      } else {
        for (int p = 0; p < 4; ++p) {
          const __m512i v = _mm512_loadu_si512(q + 64 * p);
          w[p] = packed_values512<QT>(_mm512_and_si512(v, m4));
          w[4 + p] = packed_values512<QT>(_mm512_and_si512(_mm512_srli_epi16(v, 4), m4));
        }
      }
      if constexpr (QT == kQ5_0) {
        const __m512i hb = _mm512_loadu_si512(q + 256);
        for (int p = 0; p < 4; ++p) w[p] = q5_bits512(w[p], hb, p, 0), w[4 + p] = q5_bits512(w[4 + p], hb, p, 1);
      }
      const __m512 d = packed_scales512<QT>(sc);
      __m512 mn = _mm512_setzero_ps();
      if constexpr (QT == kQ4_1) mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sc + 32 * nb)));
      for (int j = 0; j < MT; ++j) {
        const int64_t m = m0 + j;
        const int8_t* xb = x.q + m * x.K + 32 * b;
        for (int h = 0; h < 2; ++h) {
          const int64_t u = 2 * b + h;
          __m512i s = _mm512_setzero_si512();
          for (int p = 0; p < 4; ++p) {
            int32_t xv;
            std::memcpy(&xv, xb + 16 * h + 4 * p, 4);
            s = _mm512_dpbusd_epi32(s, w[4 * h + p], _mm512_set1_epi32(xv));
          }
          if constexpr (QT != kQ4_1) s = _mm512_sub_epi32(s, _mm512_set1_epi32(x.off[m * x.nh + u]));
          f[g][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(x.dx[m * x.nh + u]), d),
                                    f[g][j]);
          if constexpr (QT == kQ4_1) f[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(x.sxh[m * x.nh + u]), mn, f[g][j]);
        }
      }
    }
  }
  for (int g = 0; g < GT; ++g) {
    const int64_t n = n0 + g * kG;
    if (n >= N) break;
    const int nr = (int)std::min<int64_t>(kG, N - n);
    const __mmask16 keep = nr >= kG ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + n) : _mm512_setzero_ps();
    for (int j = 0; j < MT; ++j)
      _mm512_mask_storeu_ps(y + (m0 + j) * ldy + n, keep, bias ? _mm512_add_ps(f[g][j], bv) : f[g][j]);
  }
}


// One row of x (m) against half u of a block, for the 8 output rows of one ymm: the half's exact sums from its
// 4 weight vectors w (Q4: the nibbles; Q8_0: the signed quants, aw their magnitudes, or null: taken here, which
// keeps tile_avx2's 8 vectors of quants from spilling a copy of their magnitudes) and the row's 16 bytes xb,
// then the GEMM's fp32 step(s) on the rows' chain f. Both AVX2 tiles run it, so they give the same bits.
template <int64_t QT>
TANDEM_KERNEL_AVX2 inline __attribute__((always_inline)) __m256 half_step_avx2(__m256 f, const __m256i* w,
                                                                                const __m256i* aw, const int8_t* xb,
                                                                                const XRows& x, int64_t m, int64_t u,
                                                                                __m256 d, __m256 mn) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc;
  if constexpr (QT == kQ8_0) {
    acc = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      int32_t xv;
      std::memcpy(&xv, xb + 4 * p, 4);
      const __m256i a = aw ? aw[p] : _mm256_abs_epi8(w[p]);
      const __m256i pr = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(xv), w[p]));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pr, ones));
    }
  } else {
    __m256i s16 = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {
      int32_t xv;
      std::memcpy(&xv, xb + 4 * p, 4);
      s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[p], _mm256_set1_epi32(xv)));
    }
    acc = _mm256_madd_epi16(s16, ones);
    if constexpr (QT != kQ4_1) acc = _mm256_sub_epi32(acc, _mm256_set1_epi32(x.off[m * x.nh + u]));
  }
  f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_mul_ps(_mm256_set1_ps(x.dx[m * x.nh + u]), d), f);
  if constexpr (QT == kQ4_1) f = _mm256_fmadd_ps(_mm256_set1_ps(x.sxh[m * x.nh + u]), mn, f);
  return f;
}

// The AVX2 body (CPUs without AVX-512 VNNI): the same layout, each 64-byte vector as two ymm (rows 0-7, 8-15),
// each a fp32 chain of its own. vpdpbusd's work by pmaddubsw (weights unsigned, x signed) and pmaddwd by ones:
// Q4_0 / Q4_1 / Q5_0 add a half's 4 pmaddubsw outputs in int16 first (8 products a lane, |x| <= 127: at most
// 8 x 31 x 127 < 2^15); Q8_0's
// w + 128 would saturate pmaddubsw, so its bytes are turned back into w and it runs |w| against x with w's sign
// (|pair| <= 2 x 128 x 128), each pmaddubsw widened at once, and its sums need no offset.
template <int64_t QT, int MT>
TANDEM_KERNEL_AVX2 void tile_avx2(const uint8_t* gp, int64_t nb, const XRows& x, int64_t m0, const float* bias,
                                  float* y, int64_t ldy, int64_t n0, int64_t N) {
  constexpr int64_t QB = quant_bytes(QT);
  const __m256i m4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
  __m256 f[MT][2];
  for (int j = 0; j < MT; ++j) f[j][0] = f[j][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = gp + b * QB;
    const uint8_t* sc = gp + nb * QB + 32 * b;
    for (int s = 0; s < 2; ++s) {                    // rows 8 s .. 8 s + 7
      __m256i w[8];
      if constexpr (QT == kQ8_0) {
        for (int i = 0; i < 8; ++i)
          w[i] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + 64 * i + 32 * s)), flip);
      } else {
        for (int p = 0; p < 4; ++p) {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 64 * p + 32 * s));
          w[p] = packed_values256<QT>(_mm256_and_si256(v, m4));
          w[4 + p] = packed_values256<QT>(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
        }
      }
      if constexpr (QT == kQ5_0) {
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(q + 256 + 32 * s));
        for (int p = 0; p < 4; ++p) w[p] = q5_bits256(w[p], hb, p, 0), w[4 + p] = q5_bits256(w[4 + p], hb, p, 1);
      }
      const __m256 d = packed_scales256<QT>(sc + 16 * s);
      __m256 mn = _mm256_setzero_ps();
      if constexpr (QT == kQ4_1) mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32 * nb + 16 * s)));
      for (int j = 0; j < MT; ++j) {
        const int64_t m = m0 + j;
        const int8_t* xb = x.q + m * x.K + 32 * b;
        for (int h = 0; h < 2; ++h)
          f[j][s] = half_step_avx2<QT>(f[j][s], w + 4 * h, nullptr, xb + 16 * h, x, m, 2 * b + h, d, mn);
      }
    }
  }
  for (int s = 0; s < 2; ++s) {
    const int64_t n = n0 + 8 * s;
    for (int j = 0; j < MT; ++j) {
      alignas(32) float out[8];
      _mm256_store_ps(out, f[j][s]);
      for (int i = 0; i < 8 && n + i < N; ++i) y[(m0 + j) * ldy + n + i] = bias ? out[i] + bias[n + i] : out[i];
    }
  }
}

// The AVX2 body for more than 2 rows of x: one half of a group (output rows 8 s .. 8 s + 7, one ymm)
// against MT rows of x, so a half's 4 weight vectors are unpacked once for MT rows (tile_avx2 unpacks all 8 for
// every 2 rows: a quarter of its work at many rows) and the MT fp32 chains overlap. The same integer sums and
// the same fp32 operations in the same order as tile_avx2 (so the same bits).
template <int64_t QT, int MT>
TANDEM_KERNEL_AVX2 void tile_avx2_rows(const uint8_t* gp, int64_t nb, const XRows& x, int64_t m0, const float* bias,
                                       float* y, int64_t ldy, int64_t n, int64_t N, int s) {
  constexpr int64_t QB = quant_bytes(QT);
  const __m256i m4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8((char)0x80);
  __m256 f[MT];
  for (int j = 0; j < MT; ++j) f[j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = gp + b * QB + 32 * s;
    const uint8_t* sc = gp + nb * QB + 32 * b + 16 * s;
    const __m256 d = packed_scales256<QT>(sc);
    __m256 mn = _mm256_setzero_ps();
    if constexpr (QT == kQ4_1) mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sc + 32 * nb)));
    for (int h = 0; h < 2; ++h) {
      __m256i w[4], aw[4];
      for (int p = 0; p < 4; ++p) {
        if constexpr (QT == kQ8_0) {
          w[p] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + 64 * (4 * h + p))), flip);
          aw[p] = _mm256_abs_epi8(w[p]);
        } else {
          const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 64 * p));
          w[p] = packed_values256<QT>(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4));
          if constexpr (QT == kQ5_0) w[p] = q5_bits256(w[p], _mm256_loadu_si256((const __m256i*)(q + 256)), p, h);
        }
      }
      for (int j = 0; j < MT; ++j)
        f[j] = half_step_avx2<QT>(f[j], w, aw, x.q + (m0 + j) * x.K + 32 * b + 16 * h, x, m0 + j, 2 * b + h, d, mn);
    }
  }
  const int nr = (int)std::min<int64_t>(8, N - n);
  for (int j = 0; j < MT; ++j) {
    float* yr = y + (m0 + j) * ldy + n;
    if (nr == 8 && !bias) {
      _mm256_storeu_ps(yr, f[j]);
      continue;
    }
    alignas(32) float out[8];
    _mm256_store_ps(out, f[j]);
    for (int i = 0; i < nr; ++i) yr[i] = bias ? out[i] + bias[n + i] : out[i];
  }
}

// Rows of x a tile_avx2_rows call takes: Q4's 4 weight vectors leave registers for 6 fp32 chains, Q8_0's
// 8 (the signed quants and their magnitudes) for 5 (measured best, TANDEM_ISA=avx2 on a Sapphire Rapids core:
// 4, 5, 6 and 8 tried; 16 ymm registers either way).
template <int64_t QT>
constexpr int kAvx2Rows = QT == kQ8_0 ? 5 : 6;

// Rows m0 .. M - 1 of x against half s of a group, MT rows a tile and the last < MT by narrower ones.
template <int64_t QT, int MT>
void rows_avx2(const uint8_t* gp, int64_t nb, const XRows& x, int64_t m0, int64_t M, const float* bias, float* y,
               int64_t n, int64_t N, int s) {
  for (; M - m0 >= MT; m0 += MT) tile_avx2_rows<QT, MT>(gp, nb, x, m0, bias, y, N, n, N, s);
  if constexpr (MT > 1) {
    if (M > m0) rows_avx2<QT, MT - 1>(gp, nb, x, m0, M, bias, y, n, N, s);
  }
}

// Groups g0 .. g1 - 1 against every row of x: rows 4 at a time over one group; fewer than 4 rows take 2 or 4
// groups at a time (GT), where that many are left.
template <int64_t QT>
void groups(int body, const uint8_t* wp, int64_t gbytes, int64_t nb, const XRows& x, int64_t M, const float* bias,
            float* y, int64_t N, int64_t g0, int64_t g1) {
  for (int64_t g = g0; g < g1;) {
    const uint8_t* gp = wp + g * gbytes;
    const int64_t n0 = g * kG, left = g1 - g;
    // The groups the next iteration takes, requested into L1 now (as many as this one takes: 1, or 2 / 4 for a
    // row or two of x): the weights stream from memory once a step (a model's are past L3), and the tiles' own
    // loads left the misses exposed. SmolLM2's 30 layers (66 MB packed), 2 threads, AMD EPYC with AVX-512, against
    // the build without it: 8 rows of x 5.14 -> 3.09 ms a step, 32 rows 10.2 -> 9.2, 64 rows 17.5 -> 16.9 (the same
    // calls on one layer's L3-resident weights: 2.6 / 7.7 / 14.9); the AVX2 body 1 row 3.70 -> 1.78, 8 rows 7.3 ->
    // 5.3, 32 rows 19.2 -> 17.2. Measured no better: into L2, two or four iterations ahead, 2 MB pages.
    const int64_t take = body == 2 && M == 1 && left >= 4 ? 4 : body == 2 && M == 2 && left >= 2 ? 2 : 1;
    if (g + take < g1) {
      const char* pf = (const char*)(gp + take * gbytes);
      const int64_t lines = (std::min(take, g1 - g - take) * gbytes + 63) / 64;
      for (int64_t l = 0; l < lines; ++l) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
    }
    if (body == 1 && M > 2) {              // AVX2, many rows: each 8-row half of the group (none past N)
      for (int s = 0; s < 2 && n0 + 8 * s < N; ++s) {
        rows_avx2<QT, kAvx2Rows<QT>>(gp, nb, x, 0, M, bias, y, n0 + 8 * s, N, s);
      }
      g += 1;
      continue;
    }
    if (body == 1) {                       // AVX2: a group at a time, rows of x 2 at a time (16 ymm registers)
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2) tile_avx2<QT, 2>(gp, nb, x, m0, bias, y, N, n0, N);
        else tile_avx2<QT, 1>(gp, nb, x, m0, bias, y, N, n0, N);
      }
      g += 1;
      continue;
    }
    if (M == 1 && left >= 4) {
      tile<QT, 4, 1>(gp, gbytes, nb, x, 0, bias, y, N, n0, N);
      g += 4;
      continue;
    }
    if (M == 2 && left >= 2) {
      tile<QT, 2, 2>(gp, gbytes, nb, x, 0, bias, y, N, n0, N);
      g += 2;
      continue;
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      switch (std::min<int64_t>(4, M - m0)) {
        case 4: tile<QT, 1, 4>(gp, gbytes, nb, x, m0, bias, y, N, n0, N); break;
        case 3: tile<QT, 1, 3>(gp, gbytes, nb, x, m0, bias, y, N, n0, N); break;
        case 2: tile<QT, 1, 2>(gp, gbytes, nb, x, m0, bias, y, N, n0, N); break;
        default: tile<QT, 1, 1>(gp, gbytes, nb, x, m0, bias, y, N, n0, N); break;
      }
    }
    g += 1;
  }
}

// The body gemv_packed_q8act runs for this ISA request: 2 AVX-512 VNNI, 1 AVX2 (also AVX-512 without VNNI), 0 none.
int packed_body(int64_t isa_req) {
  const Isa isa = resolve_isa(isa_req);
  return isa == kAvx512 && cpu_has_vnni() ? 2 : isa >= kAvx2 ? 1 : 0;
}

}  // namespace

// Rows of x up to which a model runs this op where it holds a packed copy (past them linear_rows_q8act /
// gemm_rows_q8act, the same bits); 0: not this type, or a CPU with neither body (then no copy is made). Measured on one
// thread, an Intel Xeon with AMX, SmolLM2's shapes (results/packed_gemv.md): the VNNI body 2.2-2.6x gemv_rows_q8act at
// 1-16 rows and 1.2-2.2x gemm_rows_q8act's AMX body at 16-256 (level or ahead up to 1024: prefill keeps the GEMM past
// 256); the AVX2 body (TANDEM_ISA=avx2 there) 1.8-2.7x linear_rows_q8act's AVX2 body at 1-16 rows; with tile_avx2_rows
// past 2 rows (1.05-1.5x the 2-row tiles) 1.2-11x the AVX2 GEMM at 3-128 rows and 0.93-1.24x at 256-1024
// (results/packed_gemv_avx2_rows.md), so on AVX2 it takes every row count, prefill chunks included (kAllRows).
// On AVX-512 VNNI without AMX (an AMD EPYC, 2 threads, results/packed_gemv_vnni_rows.md) the GEMM runs its VNNI
// body, and the packed one is 1.08-1.86x it at 256-2048 rows on every shape, 1.02-1.29x at 4096 and 0.89-1.23x at
// 8192 (the outputs and x no longer stay in cache for either): it takes prefill chunks up to kVnniRows.
constexpr int64_t kAllRows = int64_t(1) << 40;
constexpr int64_t kVnniRows = 4096;

bool cpu_has_amx();

// The K-quants (gemv_packed_k_q8act.cpp) take every row count wherever a body runs: there the packed copy is the
// weight's only one (QLinear releases the row layout), so no other op is left to take longer chunks.
int64_t gemv_packed_q8act_max_rows(int64_t qtype) {
  const int body = packed_body(-1);
  if (packable_k(qtype)) return body ? kAllRows : 0;
  if (!packable(qtype)) return 0;
  return body == 2 ? (cpu_has_amx() ? 256 : kVnniRows) : body == 1 ? kAllRows : 0;
}

at::Tensor gemv_packed_q8act(const at::Tensor& x_in, const at::Tensor& packed, int64_t qtype, int64_t K, int64_t N,
                             const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  TORCH_CHECK(packable(qtype) || packable_k(qtype),
              "tandem.gemv_packed_q8act: Q4_0, Q4_1, Q5_0, Q8_0, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K or Q6_K (ggml types 2, 3, "
              "6, 8, 39, 10-14), got ", qtype);
  const int body = packed_body(isa_req);
  TORCH_CHECK(body > 0, "tandem.gemv_packed_q8act needs AVX2 (or AVX-512 VNNI)");
  TORCH_CHECK(N > 0, "tandem.gemv_packed_q8act: N must be > 0");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == K,
              "tandem.gemv_packed_q8act: x must be fp32 [M, ", K, "]");
  TORCH_CHECK(!bias_in.has_value() || (bias_in->scalar_type() == at::kFloat && bias_in->numel() == N),
              "tandem.gemv_packed_q8act: bias must be fp32 [N]");
  if (packable_k(qtype)) {
    auto [x, bias, y] = linear_io(x_in, bias_in, N);
    return gemv_packed_k_q8act(x, packed, qtype, K, N, bias, y, body);
  }
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0, "tandem.gemv_packed_q8act: K must be a positive multiple of 32 and N > 0");
  const int64_t nb = K / 32, nh = 2 * nb, NG = (N + kG - 1) / kG;
  const int64_t gbytes = nb * (quant_bytes(qtype) + scale_bytes(qtype));
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              packed.size(0) == NG && packed.size(1) == gbytes,
              "tandem.gemv_packed_q8act: packed must be pack_gemv's uint8 [", NG, ", ", gbytes, "] for N = ", N);
  auto [x, bias, y] = linear_io(x_in, bias_in, N);
  const int64_t M = x.size(0);
  if (M == 0) return y;
  const PackedX px = quantize_packed_x(x, x_offset(qtype));
  const XRows xr{px.q, px.dx, px.sxh, px.off, K, nh};
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Chunks of 4 groups (a one-row tile's width), so a thread's share never splits a tile; AVX2 past 2 rows takes
  // a group at a time, so chunks of one (SmolLM2's 576 outputs are 36 groups: 9 chunks of 4 split 5 / 4).
  const int64_t per = body == 1 && M > 2 ? 1 : 4, chunks = (NG + per - 1) / per;
  stealing_for(chunks, 1, [&](int64_t c0, int64_t c1) {
    const int64_t g0 = per * c0, g1 = std::min(per * c1, NG);
    if (qtype == kQ4_1) groups<kQ4_1>(body, wp, gbytes, nb, xr, M, bp, yp, N, g0, g1);
    else if (qtype == kQ4_0) groups<kQ4_0>(body, wp, gbytes, nb, xr, M, bp, yp, N, g0, g1);
    else if (qtype == kQ5_0) groups<kQ5_0>(body, wp, gbytes, nb, xr, M, bp, yp, N, g0, g1);
    else if (qtype == kMXFP4) groups<kMXFP4>(body, wp, gbytes, nb, xr, M, bp, yp, N, g0, g1);
    else groups<kQ8_0>(body, wp, gbytes, nb, xr, M, bp, yp, N, g0, g1);
  });
  return y;
}

void gemv_packed_q8act_jobs(const at::Tensor& x, const at::Tensor& stacked, const std::vector<int64_t>& ids,
                            int64_t rep, int64_t qtype, int64_t K, int64_t N, float* y, int64_t isa_req) {
  const int body = packed_body(isa_req);
  TORCH_CHECK(body > 0, "tandem.gemv_packed_q8act needs AVX2 (or AVX-512 VNNI)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) == K && rep > 0 &&
              x.size(0) * rep == (int64_t)ids.size(),
              "tandem.gemv_packed_q8act: x must be contiguous fp32 [jobs / rep, ", K, "]");
  if (packable_k(qtype)) return gemv_packed_k_q8act_jobs(x, stacked, ids, rep, qtype, K, N, y, body);
  TORCH_CHECK(packable(qtype), "tandem.gemv_packed_q8act: no packed layout for ggml type ", qtype);
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0, "tandem.gemv_packed_q8act: K must be a positive multiple of 32 and N > 0");
  const int64_t nb = K / 32, nh = 2 * nb, NG = (N + kG - 1) / kG;
  const int64_t gbytes = nb * (quant_bytes(qtype) + scale_bytes(qtype));
  const uint8_t* base = stacked_copies(stacked, ids, NG, gbytes, N);
  const int64_t J = (int64_t)ids.size();
  if (J == 0) return;
  const PackedX px = quantize_packed_x(x, x_offset(qtype));
  split_jobs(J, NG, 4, [&](int64_t j, int64_t g0, int64_t g1) {     // gemv_packed_q8act's chunks for one row
    const int64_t m = j / rep;
    const XRows xr{px.q + m * K, px.dx + m * nh, px.sxh + m * nh, px.off + m * nh, K, nh};
    const uint8_t* wp = base + ids[j] * NG * gbytes;
    float* yj = y + j * N;
    if (qtype == kQ4_1) groups<kQ4_1>(body, wp, gbytes, nb, xr, 1, nullptr, yj, N, g0, g1);
    else if (qtype == kQ4_0) groups<kQ4_0>(body, wp, gbytes, nb, xr, 1, nullptr, yj, N, g0, g1);
    else if (qtype == kQ5_0) groups<kQ5_0>(body, wp, gbytes, nb, xr, 1, nullptr, yj, N, g0, g1);
    else if (qtype == kMXFP4) groups<kMXFP4>(body, wp, gbytes, nb, xr, 1, nullptr, yj, N, g0, g1);
    else groups<kQ8_0>(body, wp, gbytes, nb, xr, 1, nullptr, yj, N, g0, g1);
  });
}

}  // namespace tandem
