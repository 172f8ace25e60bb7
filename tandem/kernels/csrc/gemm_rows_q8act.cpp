// int8 GEMM over GGUF blocks for many rows of x (kernels_act="int8" past small_m() rows: prefill chunks and
// large decode batches), in place of dequantize-to-fp32 + MKL's fp32 GEMM, which ran at the fp32 rate and made
// every row re-decode the same weights (issue 22's profile).
//
// The rows of x are rounded to int8 halves of 16 exactly as linear_rows_q8act rounds them (quantize_act_row: the same
// xq, dx and sums), then laid out for the micro-kernel in tiles of 16 tokens: the 16 int32 lanes of a register
// are 16 tokens, and one vpdpbusd adds 4 products of 4 consecutive k for all of them against one weight row's
// 4 signed quants broadcast from memory (the x bytes ride unsigned, as xq + 128). A tile of 12 weight rows is
// unpacked once per pass of up to 256 tokens into natural-order signed bytes with a scale (and a min) per
// 16-weight half, so each weight is decoded once for all the tokens of the pass, and no weight layout changes
// at load time (the same QuantWeight rows serve linear_rows, linear_rows_q8act, the embedding and tensor parallelism).
//
// With q the unpacked signed quant of a weight (weight = dw_u q + mh_u over half u; mh = 0 without a min), an
// output is, for every half u in order, then the bias:
//   isum_u = sum_i (xq_i + 128) q_i - 128 sum_i q_i      (exact in int32: the true sum of xq_i q_i)
//   f = fma(float(isum_u), dx_u * dw_u, f);  f = fma(sxh_u, mh_u, f)   (the second for Q4_1 / Q5_1 / Q4_K /
//   Q5_K / Q2_K; sxh_u = dx_u sum_i xq_i)
// The same operations in the same order run in the scalar, AVX2 and AVX-512 bodies, whatever M is and whichever
// tile a token lands in, so the op's rows are bit for bit the same across bodies, batch sizes and threads. They
// differ from linear_rows_q8act's (which sums 4-product partials per lane) in fp32 rounding only: the integer sums are
// the same exact values, so the gap to the float64 specification is of the same size
// (tests/kernels/test_gemm_rows_q8act.py). Measured (one thread, AMD EPYC with AVX-512 VNNI, SmolLM2's shapes):
// 1.6-2.1x MKL's fp32 GEMM plus the dequantization at 128-512 rows; the AVX2 body 1.1-3x MKL past 16 rows on an
// AVX2-only Zen 3 (quant.py). End to end, 16 prompts x 1000 tokens prefill in 1.41x less time. The micro-kernels:
// gemm_rows_q8act_tiles.inc. Q4_K / Q5_K / Q6_K are not computed here: they run the K8 contract (k8_spec.cpp, x
// rounded per super-block), whose specification this op returns for them.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

#include "mxfp4.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

bool cpu_has_vnni();

namespace {

enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

#include "k_scales.inc"
#include "vec_ext.inc"

constexpr int kTok = 16;              // tokens of a tile: the int32 lanes of one AVX-512 register
constexpr int kRows = 12;             // weight rows of a tile: 12 int32 and 12 fp32 accumulators of the kernel
constexpr int64_t kPass = 256;        // tokens per pass over the weights (each weight tile unpacked once a pass)
constexpr int64_t kKHalves = 24;      // halves of K per block: a tile's 12 x 384 quants (4.5 KB) stay in L1
                                      // while the pass's token tiles stream by

constexpr bool has_min(int64_t qt) { return qt == kQ4_1 || qt == kQ5_1 || qt == kQ4_K || qt == kQ5_K || qt == kQ2_K; }

// A K-quant row's scales (k_scales' layout), called from the unpacking below (which has no F16C target).
TANDEM_KERNEL_F16C void row_k_scales(int64_t qt, const uint8_t* row, int64_t nb, float* sc) {
  k_scales(qt, row, nb, sc);
}

// One QuantWeight row -> q [K] signed quants in natural order, dw / mh [2 nb] per half (mh only with a min).
// The formats are linear_rows.cpp's (regrouped rows, quant.py's docstring); sc: scratch of 4 nb floats.
void unpack_row(int64_t qt, const uint8_t* row, int64_t nb, int8_t* q, float* dw, float* mh, float* sc) {
  // (q null: the scales only, the quants having come from unpack_quants_avx2.)
  if (qt == kQ2_K || qt == kQ3_K || qt == kQ6_K) {
    row_k_scales(qt, row, nb, sc);
    const int64_t bytes = qt == kQ2_K ? 84 : qt == kQ3_K ? 110 : 210;
    const int off = qt == kQ6_K ? 32 : qt == kQ3_K ? 4 : 0;
    for (int64_t b = 0; q && b < nb; ++b) {
      const uint8_t* blk = row + bytes * (b / 8);
      const int j = (int)(b % 8), h = j / 4, t = j % 4;
      int8_t* o = q + 32 * b;
      if (qt == kQ2_K) {
        for (int i = 0; i < 32; ++i) o[i] = (int8_t)(blk[16 + 32 * h + i] >> 2 * t & 3);
      } else if (qt == kQ3_K) {
        for (int i = 0; i < 32; ++i) o[i] = (int8_t)(((blk[32 + 32 * h + i] >> 2 * t & 3) | (blk[i] >> j & 1) << 2) - off);
      } else {
        for (int i = 0; i < 32; ++i)
          o[i] = (int8_t)(((blk[64 * h + 32 * (t % 2) + i] >> 4 * (t / 2) & 15) | (blk[128 + 32 * h + i] >> 2 * t & 3) << 4) - off);
      }
    }
    for (int64_t u = 0; u < 2 * nb; ++u) {
      dw[u] = sc[u];
      if (qt == kQ2_K) mh[u] = -sc[2 * nb + u];
    }
    return;
  }
  if (qt == kMXFP4) {                 // [e x nb][qs x nb]: the signed values, the scale 2^(e - 128) a block
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* s = row + nb + 16 * b;
      for (int i = 0; q && i < 16; ++i) {
        q[32 * b + i] = kMxfp4Values[s[i] & 15];
        q[32 * b + 16 + i] = kMxfp4Values[s[i] >> 4];
      }
      dw[2 * b] = dw[2 * b + 1] = e8m0_half(row[b]);
    }
    return;
  }
  const bool k = qt == kQ4_K || qt == kQ5_K, q5 = qt == kQ5_0 || qt == kQ5_1 || qt == kQ5_K;
  if (k) row_k_scales(qt, row, nb, sc);
  if (qt == kQ8_0) {
    if (q) std::memcpy(q, row + 2 * nb, 32 * nb);
    for (int64_t b = 0; b < nb; ++b) dw[2 * b] = dw[2 * b + 1] = fp16_to_fp32(load_u16(row + 2 * b));
    return;
  }
  // [d][m][qh][qs] (legacy) or [headers][qh][qs] (Q4_K / Q5_K): where the 5th bits and the nibbles start.
  const uint8_t* qh = row + (k ? 2 : has_min(qt) ? 4 : 2) * nb;
  const uint8_t* qs = qh + (q5 ? 4 * nb : 0);
  const int off = has_min(qt) ? 0 : q5 ? 16 : 8;
  for (int64_t b = 0; b < nb; ++b) {
    uint32_t hb = 0;
    if (q5) std::memcpy(&hb, qh + 4 * b, 4);
    const uint8_t* s = qs + 16 * b;
    int8_t* o = q + 32 * b;
    for (int i = 0; q && i < 16; ++i) {
      o[i] = (int8_t)(((s[i] & 15) | (hb >> i & 1) << 4) - off);
      o[16 + i] = (int8_t)(((s[i] >> 4) | (hb >> (16 + i) & 1) << 4) - off);
    }
    const float d = k ? sc[b] : fp16_to_fp32(load_u16(row + 2 * b));
    dw[2 * b] = dw[2 * b + 1] = d;
    if (has_min(qt)) mh[2 * b] = mh[2 * b + 1] = k ? sc[nb + b] : fp16_to_fp32(load_u16(row + 2 * nb + 2 * b));
  }
}


// unpack_row's quants with AVX2, 32 a block (the scales and mins still from unpack_row's scalar code paths,
// which are 1/16 of the work): Q4 / Q5 nibbles spread to bytes (Q5: the fifth bits from qh as a byte mask),
// Q8_0 as is, Q6_K by q6_k_bytes, MXFP4's nibbles looked up as signed values (vpshufb); Q2_K / Q3_K stay scalar. hs [2 nb]: each half's sum of q.
TANDEM_KERNEL_AVX2 bool unpack_quants_avx2(int64_t qt, const uint8_t* row, int64_t nb, int8_t* q, int32_t* hs) {
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const bool k = qt == kQ4_K || qt == kQ5_K, q5 = qt == kQ5_0 || qt == kQ5_1 || qt == kQ5_K, mx = qt == kMXFP4;
  const uint8_t* qh = row + (mx ? 1 : k ? 2 : has_min(qt) ? 4 : 2) * nb;
  const uint8_t* qs = qh + (q5 ? 4 * nb : 0);
  const __m256i off = _mm256_set1_epi8((char)(has_min(qt) || mx ? 0 : q5 ? 16 : 8));
  const __m128i mx_table = _mm_loadu_si128((const __m128i*)kMxfp4Values);
  const __m256i bias = _mm256_set1_epi8((char)0x80);
  if (qt == kQ2_K || qt == kQ3_K) return false;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v;
    if (qt == kQ8_0) {
      v = _mm256_loadu_si256((const __m256i*)(row + 2 * nb + 32 * b));
    } else if (qt == kQ6_K) {
      const uint8_t* blk = row + 210 * (b / 8);
      const int j = (int)(b % 8), h = j / 4, t = j % 4;
      v = q6_k_bytes(blk + 64 * h + 32 * (t % 2), 4 * (t / 2), blk + 128 + 32 * h, 2 * t);
    } else {
      const __m128i raw = _mm_loadu_si128((const __m128i*)(qs + 16 * b));
      v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
      if (mx) v = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(mx_table), v);
      if (q5) {
        uint32_t hb;
        std::memcpy(&hb, qh + 4 * b, 4);
        v = _mm256_or_si256(v, _mm256_and_si256(Vec256Ext::bits_set(hb), _mm256_set1_epi8(16)));
      }
      v = _mm256_sub_epi8(v, off);
    }
    _mm256_storeu_si256((__m256i*)(q + 32 * b), v);
    // Sums of 8 bytes of q + 128 (unsigned) per 64-bit lane; a half is two lanes, less 16 * 128.
    // The odd lane added onto the even one in each 128-bit half: two extracts, not four.
    const __m256i sad = _mm256_sad_epu8(_mm256_xor_si256(v, bias), _mm256_setzero_si256());
    const __m256i pair = _mm256_add_epi64(sad, _mm256_srli_si256(sad, 8));
    hs[2 * b] = _mm256_cvtsi256_si32(pair) - 2048;
    hs[2 * b + 1] = _mm256_extract_epi32(pair, 4) - 2048;
  }
  return true;
}

// unpack_row's scales for the legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one fp16 d, and m with a min, per
// block, each for both halves) by F16C, 8 blocks a conversion: unpack_row's software fp16 conversion was ~1/5
// of a call at a few rows. The same values (both conversions are exact).
TANDEM_KERNEL_AVX2 void f16_halves(const uint8_t* src, int64_t nb, float* dst) {   // dst[2 b] = dst[2 b + 1] = src[b]
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(src + 2 * b)));
    const __m256 lo = _mm256_unpacklo_ps(d, d), hi = _mm256_unpackhi_ps(d, d);   // d0 d0 d1 d1 | d4 d4 d5 d5 ...
    _mm256_storeu_ps(dst + 2 * b, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(dst + 2 * b + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  for (; b < nb; ++b) dst[2 * b] = dst[2 * b + 1] = _cvtsh_ss(load_u16(src + 2 * b));
}

TANDEM_KERNEL_AVX2 bool legacy_scales_f16c(int64_t qt, const uint8_t* row, int64_t nb, float* dw, float* mh) {
  if (qt != kQ4_0 && qt != kQ4_1 && qt != kQ5_0 && qt != kQ5_1 && qt != kQ8_0) return false;
  f16_halves(row, nb, dw);
  if (has_min(qt)) f16_halves(row + 2 * nb, nb, mh);
  return true;
}

// One weight row (src; null: a row past N, all zero) for a tile: natural-order signed quants q [K], the
// per-half scales dw / mh and sums of q hs [2 nb]; sc: scratch of 4 nb floats. avx2: unpack_quants_avx2 where
// it has the type.
void unpack_weight_row(int64_t qt, const uint8_t* src, int64_t nb, bool avx2, int8_t* q, float* dw, float* mh,
                       float* sc, int32_t* hs) {
  const int64_t nh = 2 * nb;
  if (src == nullptr) {
    std::fill_n(q, 32 * nb, 0);
    std::fill_n(dw, nh, 0.f);
    std::fill_n(mh, nh, 0.f);
    std::fill_n(hs, nh, 0);
    return;
  }
  const bool fast = avx2 && unpack_quants_avx2(qt, src, nb, q, hs);
  if (!fast || !legacy_scales_f16c(qt, src, nb, dw, mh)) unpack_row(qt, src, nb, fast ? nullptr : q, dw, mh, sc);
  for (int64_t u = 0; !fast && u < nh; ++u) {
    int sum = 0;
    for (int i = 0; i < 16; ++i) sum += q[16 * u + i];
    hs[u] = sum;
  }
}

struct WTile {            // kRows unpacked weight rows, interleaved (rows past N: zero quants and scales)
  static constexpr int kR = kRows;
  std::vector<int8_t> q;      // [K / 4][kRows][4]: the 4 quants of each row at k = 4 g .. 4 g + 3
  std::vector<float> dw, mh;  // [2 nb][kRows] per half
  std::vector<int32_t> ncorr; // [2 nb][kRows] -128 * the half's sum of q (x rides as xq + 128)
  std::vector<int8_t> row;    // scratch: one row in natural order
  std::vector<float> rdw, rmh, sc;
  std::vector<int32_t> hs;
  bool avx2;
  WTile(int64_t K, bool avx2)
      : q(kRows * K), dw(kRows * K / 16), mh(kRows * K / 16), ncorr(kRows * K / 16), row(K), rdw(K / 16),
        rmh(K / 16), sc(K / 8), hs(K / 16), avx2(avx2) {}

  void unpack(int64_t qt, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t N, int64_t K) {
    const int64_t nb = K / 32, nh = 2 * nb;
    for (int r = 0; r < kRows; ++r) {
      unpack_weight_row(qt, n0 + r < N ? w + (n0 + r) * row_bytes : nullptr, nb, avx2, row.data(), rdw.data(),
                        rmh.data(), sc.data(), hs.data());
      // Local restrict pointers (declared after the row is written): through the vectors' own the compiler
      // reloaded q's data pointer at every 4-byte move (int8_t stores may alias anything), and this
      // interleave was ~1/5 of a call at a few rows.
      int8_t* __restrict qd = q.data();
      const int8_t* __restrict rq = row.data();
      float *__restrict dwd = dw.data(), *__restrict mhd = mh.data();
      int32_t* __restrict nc = ncorr.data();
      const float *__restrict rd = rdw.data(), *__restrict rm = rmh.data();
      const int32_t* __restrict hsd = hs.data();
      for (int64_t g = 0; g < K / 4; ++g) {
        int32_t v;
        std::memcpy(&v, rq + 4 * g, 4);
        std::memcpy(qd + (g * kRows + r) * 4, &v, 4);
      }
      for (int64_t u = 0; u < nh; ++u) {
        nc[u * kRows + r] = -128 * hsd[u];
        dwd[u * kRows + r] = rd[u];
        mhd[u * kRows + r] = rm[u];
      }
    }
  }
};

struct XTiles {           // rows of x rounded (quantize_act_row) and laid out in tiles of kTok tokens
  uint8_t* xu;                // [tiles][K / 4][kTok][4]: xq + 128 (padding tokens: 128, i.e. xq = 0)
  float* dx;                  // [tiles][2 nb][kTok] (padding: 0)
  float* sxh;                 // the same layout
};

// The tiles live in buffers reused across calls on this thread (grow-only): fresh vectors of a prefill chunk's
// size (MBs) were mapped and unmapped by every call, and the page faults and unmaps slowed the whole step
// (measured: its norms and index ops ~3x slower, the step ~10 %, with the GEMM itself level with MKL's).
// signed_x (the AMX body): the bytes are xq itself, padding 0.
XTiles tile_x(const float* x, int64_t M, int64_t K, bool signed_x) {
  const int64_t nb = K / 32, nh = 2 * nb, tiles = (M + kTok - 1) / kTok;
  static thread_local std::vector<uint8_t> xu_buf;
  static thread_local std::vector<float> f_buf;
  if ((int64_t)xu_buf.size() < tiles * K * kTok) xu_buf.resize(tiles * K * kTok);
  if ((int64_t)f_buf.size() < 2 * tiles * nh * kTok) f_buf.resize(2 * tiles * nh * kTok);
  XTiles t{xu_buf.data(), f_buf.data(), f_buf.data() + tiles * nh * kTok};
  if (M % kTok) {                                          // the last tile's padding tokens
    std::memset(t.xu + (tiles - 1) * K * kTok, signed_x ? 0 : 128, K * kTok);
    std::fill_n(t.dx + (tiles - 1) * nh * kTok, nh * kTok, 0.f);
    std::fill_n(t.sxh + (tiles - 1) * nh * kTok, nh * kTok, 0.f);
  }
  const uint32_t flip = signed_x ? 0u : 0x80808080u;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    std::vector<int8_t> q(K);
    std::vector<float> dx(nh), sx(nb), sxh(nh);
    for (int64_t m = m0; m < m1; ++m) {
      quantize_act_row(x + m * K, K, q.data(), dx.data(), sx.data(), sxh.data());
      const int64_t tile = m / kTok, lane = m % kTok;
      uint8_t* xu = t.xu + tile * K * kTok;
      for (int64_t g = 0; g < K / 4; ++g) {                 // 4 bytes at a time, xq + 128 = xq ^ 0x80
        uint32_t v;
        std::memcpy(&v, q.data() + 4 * g, 4);
        v ^= flip;
        std::memcpy(xu + (g * kTok + lane) * 4, &v, 4);
      }
      for (int64_t u = 0; u < nh; ++u) {
        t.dx[(tile * nh + u) * kTok + lane] = dx[u];
        t.sxh[(tile * nh + u) * kTok + lane] = sxh[u];
      }
    }
  });
  return t;
}

#include "gemm_rows_q8act_tiles.inc"
#include "gemm_rows_q8act_amx.inc"

// The GEMM over weight tiles W (WTile: kRows interleaved rows for the scalar, AVX2 and VNNI micro-kernels;
// WTileAmx: 16 natural-order rows for the AMX one). fn: out [W::kR][kTok] += the halves [u0, u1) of the tile's
// products (each output's fp32 chain continued in order, so splitting K into blocks changes no result).
// fn_tail: the same for a token tile of at most kTok / 2 real tokens (the AVX2 body's, which skips the
// padding half; the others pass fn).
template <class W>
using TileFn = void (*)(int64_t, int64_t, int64_t, const W&, const uint8_t*, const float*, const float*, float*);

template <class W>
void run_gemm(const XTiles& xt, int64_t qtype, const uint8_t* wp, int64_t row_bytes, int64_t M, int64_t N,
              int64_t K, const float* bp, float* yp, bool avx2, TileFn<W> fn, TileFn<W> fn_tail) {
  constexpr int R = W::kR;
  const int64_t nh = K / 16, wtiles = (N + R - 1) / R;
  for (int64_t p0 = 0; p0 < M; p0 += kPass) {            // a pass: up to kPass tokens against every weight tile
    const int64_t p1 = std::min(M, p0 + kPass);
    at::parallel_for(0, wtiles, 1, [&](int64_t t0, int64_t t1) {
      W wt(K, avx2);
      const int64_t ntok = (p1 - p0 + kTok - 1) / kTok;
      std::vector<float> acc(ntok * R * kTok);                    // the pass's token tiles' [R][kTok] sums
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * R, nr = std::min<int64_t>(R, N - n0);
        wt.unpack(qtype, wp, row_bytes, n0, N, K);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t u0 = 0; u0 < nh; u0 += kKHalves)            // a K block's weights stay in L1 over the tiles
          for (int64_t i = 0; i < ntok; ++i) {
            const int64_t tile = p0 / kTok + i;
            (p1 - p0 - i * kTok <= kTok / 2 ? fn_tail : fn)(K, u0, std::min(nh, u0 + kKHalves), wt,
                xt.xu + tile * K * kTok, xt.dx + tile * nh * kTok, xt.sxh + tile * nh * kTok, acc.data() + i * R * kTok);
          }
        for (int64_t i = 0; i < ntok; ++i) {
          const float* out = acc.data() + i * R * kTok;
          const int64_t m0 = p0 + i * kTok, mt = std::min<int64_t>(kTok, p1 - m0);
          for (int64_t j = 0; j < mt; ++j)
            for (int64_t r = 0; r < nr; ++r) yp[(m0 + j) * N + n0 + r] = out[r * kTok + j] + (bp ? bp[n0 + r] : 0.f);
        }
      }
    });
  }
}

// The AVX2 tiles for a type (full, tail): the narrow types' |q| <= 16 lets a half's sums stay int16.
template <bool MIN, int MODE>
std::pair<TileFn<WTile>, TileFn<WTile>> avx2_pair() { return {tile_avx2<MIN, MODE, 2>, tile_avx2<MIN, MODE, 1>}; }

std::pair<TileFn<WTile>, TileFn<WTile>> avx2_tiles(int64_t qt) {
  const bool narrow = qt == kQ4_0 || qt == kQ4_1 || qt == kQ4_K || qt == kQ2_K || qt == kQ3_K || qt == kMXFP4;
  if (qt == kQ8_0) return avx2_pair<false, kQ8>();
  if (has_min(qt)) return narrow ? avx2_pair<true, kNarrow>() : avx2_pair<true, kWide>();
  return narrow ? avx2_pair<false, kNarrow>() : avx2_pair<false, kWide>();
}

}  // namespace

bool cpu_has_amx();

int64_t gemm_rows_q8act_body(int64_t qtype, int64_t isa_req) {
  switch (qtype) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0:
    case kQ2_K: case kQ3_K: case kMXFP4: break;      // Q4_K / Q5_K / Q6_K: k8_spec.cpp, no tiles here
    default: return 0;
  }
  const Isa isa = resolve_isa(isa_req);
  if (isa == kAvx512 && cpu_has_vnni()) return (isa_req < 0 || isa_req >= 3) && cpu_has_amx() ? 3 : 2;
  return isa >= kAvx2 ? 1 : 0;
}

at::Tensor gemm_rows_q8act(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                           const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  check_int8_args("tandem.gemm_rows_q8act", x_in, w, qtype, K, bias_in);
  if (k8_type(qtype)) return k8_rows_spec(x_in, w, qtype, K, bias_in);     // Q4_K / Q5_K / Q6_K: the K8 contract
  auto [x, bias, y] = linear_io(x_in, bias_in, w.size(0));
  const int64_t M = x.size(0), N = w.size(0);
  if (M == 0 || N == 0) return y;
  const Isa isa = resolve_isa(isa_req);
  const bool mn = has_min(qtype);
  const int64_t body = gemm_rows_q8act_body(qtype, isa_req);
  const XTiles xt = tile_x(x.data_ptr<float>(), M, K, body == 3);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  if (body == 3) {
    const TileFn<WTileAmx> fn = mn ? tile_amx<true> : tile_amx<false>;
    run_gemm<WTileAmx>(xt, qtype, wp, w.size(1), M, N, K, bp, yp, true, fn, fn);
    return y;
  }
  TileFn<WTile> fn = mn ? tile_scalar<true> : tile_scalar<false>, fn_tail = fn;
  if (body == 2) fn = fn_tail = mn ? tile_avx512<true> : tile_avx512<false>;
  else if (body == 1) std::tie(fn, fn_tail) = avx2_tiles(qtype);
  run_gemm<WTile>(xt, qtype, wp, w.size(1), M, N, K, bp, yp, isa >= kAvx2, fn, fn_tail);
  return y;
}

}  // namespace tandem
