// The int8 GEMV with the GEMM's arithmetic (Q4_1, Q8_0 and, VNNI only, Q5_0 and MXFP4; an AVX-512 VNNI body here,
// an AVX2 one in gemv_rows_q8act_avx2.inc): for a few rows of x, each
// output computed by gemm_rows_q8act's operations in gemm_rows_q8act's order (gemm_rows_q8act.cpp's header), so its
// rows are bit for bit the GEMM's at any row count. That is what would let one arithmetic serve every row count (the
// decode kernel linear_rows_q8act scales 4-product partials per lane instead, so its rows differ from the GEMM's in
// the last bits, and in the int8 mode those bits grow into ~0.01-0.07 of a logprob over 30 layers).
//
// Lanes over 16 weight rows. One step reads 64 quant bytes of each row: Q4_1 / Q4_K, 4 blocks' (sub-blocks')
// nibbles, two vpdpbusd
// (the 4 blocks' elements 0-15 against x's, then 16-31); Q8_0, 2 blocks in natural order, one vpdpbusd (|w|
// against x with w's sign). Either way a half's 16 products land in 4 int32 partials; four rows' partials
// are reduced exactly and transposed at once (reduce4), four such groups' 128-bit lanes transposed again
// (lanes4), so each half's 16 rows' exact sums sit in one register, and the fp32 chain runs half after half
// with lanes over the rows: f = fma(float(isum_u), dx_u dw_u, f), then (Q4_1, Q4_K) f = fma(sxh_u, mh_u, f); y = f +
// bias: gemm_rows_q8act's operands and order (its scalar tile_scalar), so tests/kernels/test_gemm_rows_q8act.py asserts
// equality.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

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
constexpr int kG = 16;      // weight rows of a group: the 16 lanes of the fp32 chain
constexpr int kMx = 4;      // rows of x per pass over a group's weights

// The bodies' type tags: a ggml type, or minus a nibble type whose values are read from the group's predecoded
// copy (predecode; only Q5_0 takes it, see `predecoded` in gemv_rows_q8act).
constexpr int64_t base_of(int64_t qt) { return qt < 0 ? -qt : qt; }
constexpr bool gv_min(int64_t qt) { return base_of(qt) == kQ4_1; }   // a second fma a half
// Types whose bytes ride unsigned with an offset taken off each half's exact sum (x.hs_off): Q5_0's 5-bit
// values (v - 16), MXFP4's looked-up values + 12 (mxfp4.h).
constexpr bool has_offset(int64_t qt) { return base_of(qt) == kQ5_0 || base_of(qt) == kMXFP4; }


// Four weight rows' [4 halves x 4 partials] int32 sums -> [4 halves][4 rows]: each 128-bit lane a half, its 4
// int32 the 4 rows' exact sums.
TANDEM_KERNEL_VNNI inline __m512i reduce4(__m512i t0, __m512i t1, __m512i t2, __m512i t3) {
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(t0, t1), _mm512_unpackhi_epi32(t0, t1));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(t2, t3), _mm512_unpackhi_epi32(t2, t3));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
}

// u[s] = [4 halves][rows 4 s .. 4 s + 3] -> o[i] = half i's 16 rows in order.
TANDEM_KERNEL_VNNI inline void lanes4(const __m512i u[4], __m512i o[4]) {
  const __m512i a = _mm512_shuffle_i32x4(u[0], u[1], 0x44), b = _mm512_shuffle_i32x4(u[0], u[1], 0xee);
  const __m512i c = _mm512_shuffle_i32x4(u[2], u[3], 0x44), d = _mm512_shuffle_i32x4(u[2], u[3], 0xee);
  o[0] = _mm512_shuffle_i32x4(a, c, 0x88), o[1] = _mm512_shuffle_i32x4(a, c, 0xdd);
  o[2] = _mm512_shuffle_i32x4(b, d, 0x88), o[3] = _mm512_shuffle_i32x4(b, d, 0xdd);
}

// m [16 rows][16] -> [16][16 rows] (unpack, 128-bit shuffles).
TANDEM_KERNEL_VNNI inline void transpose16(__m512 m[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) t[i] = _mm512_unpacklo_ps(m[i], m[i + 1]), t[i + 1] = _mm512_unpackhi_ps(m[i], m[i + 1]);
  for (int i = 0; i < 16; i += 4) {
    m[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    m[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xee);
    m[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    m[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(m[i], m[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(m[i], m[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_f32x4(m[i + 8], m[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(m[i + 8], m[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    m[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    m[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
}

// The group's scales with lanes over its rows, as gemm_rows_q8act unpacks them (both halves of a block share them):
// dw [nb][kG], mh [nb][kG]: Q4_1 the fp16 d at the row's start and the fp16 m after them; MXFP4 its blocks'
// 2^(e - 128) (into tmp [kG][4 nb] first).
// 16 blocks of the 16 rows at a time, transposed.
TANDEM_KERNEL_VNNI void group_scales(int64_t qt, const uint8_t* const* rows, int64_t nb, float* dw, float* mh,
                                     float* tmp) {
  const bool mx = qt == kMXFP4;
  for (int r = 0; mx && r < kG; ++r) e8m0_halves(rows[r], nb, tmp + r * 4 * nb);
  for (int part = 0; part < (gv_min(qt) ? 2 : 1); ++part) {
    float* out = part ? mh : dw;
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 mk = nb - b >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (nb - b)) - 1);
      __m512 m[16];
      for (int r = 0; r < kG; ++r)
        m[r] = mx ? _mm512_maskz_loadu_ps(mk, tmp + r * 4 * nb + part * nb + b)
                  : _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, rows[r] + 2 * (part * nb + b)));
      transpose16(m);
      for (int i = 0; i < 16 && b + i < nb; ++i) _mm512_storeu_ps(out + (b + i) * kG, m[i]);
    }
  }
}

struct Group {            // kG weight rows (past N: a zero row) and their transposed scales
  const uint8_t* const* rows;
  int64_t nb;
  const float *dw, *mh;
  const uint8_t* pre = nullptr;   // Q5_0, several rows of x: the rows' values decoded once (predecode)
  int64_t pstride = 0;            // bytes of a row there: 128 a step (64 low-nibble bytes, then 64 high)
  const char* pf = nullptr;       // a later group's rows (contiguous), prefetched a slice a step
  int64_t pf_lines = 0;
};

// A nibble type's unsigned values of 4 blocks from b, in step_sums' two vectors: lo the 4 blocks' elements 0-15,
// hi 16-31 (bytes past nb zero). Q4_1 [d][m][qs], Q4_K [headers][qs]: the nibbles. Q5_0 [d][qh][qs]: nibble |
// fifth bit << 4, the fifth bits from qh of 4 blocks (4 bytes each, bit j = element j) as byte masks over the 64
// nibble bytes, bits 0-15 of each block's word for lo, 16-31 for hi (16 bytes from qh + 4 b stay inside the
// row: qs follows qh). MXFP4 [e][qs]: the nibbles looked up as value + 12 (bytes past nb: zero).
template <int64_t QT>
TANDEM_KERNEL_VNNI inline void nibble_values(const uint8_t* row, int64_t nb, int64_t b, __m512i& lo, __m512i& hi) {
  const __mmask64 mk = nb - b >= 4 ? ~(__mmask64)0 : (((__mmask64)1 << (16 * (nb - b))) - 1);
  const __m512i m16 = _mm512_set1_epi8(0x0f);
  const __m512i v = _mm512_maskz_loadu_epi8(mk, row + (QT == kQ4_1 ? 4 : QT == kQ5_0 ? 6 : QT == kMXFP4 ? 1 : 2) * nb + 16 * b);
  lo = _mm512_and_si512(v, m16);
  hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m16);
  if constexpr (QT == kMXFP4) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)kMxfp4Unsigned));
    lo = _mm512_maskz_shuffle_epi8(mk, table, lo);
    hi = _mm512_maskz_shuffle_epi8(mk, table, hi);
  }
  if constexpr (QT == kQ5_0) {
    const __m512i b16 = _mm512_set1_epi8(0x10);
    const __m128i qh_order = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m128i h = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i*)(row + 2 * nb + 4 * b)), qh_order);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64((uint64_t)_mm_cvtsi128_si64(h)) & mk, lo, b16);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64((uint64_t)_mm_extract_epi64(h, 1)) & mk, hi, b16);
  }
}

// A group's values decoded once for all rows of x, [kG][steps][lo 64 bytes, hi 64 bytes].
template <int64_t QT>
TANDEM_KERNEL_VNNI void predecode(const uint8_t* const* rows, int64_t nb, uint8_t* pre, int64_t pstride) {
  for (int r = 0; r < kG; ++r)
    for (int64_t b = 0; b < nb; b += 4) {
      __m512i lo, hi;
      nibble_values<QT>(rows[r], nb, b, lo, hi);
      _mm512_storeu_si512(pre + r * pstride + 32 * b, lo);
      _mm512_storeu_si512(pre + r * pstride + 32 * b + 64, hi);
    }
}

// Step b of a group for one row of x: the exact sums of the halves the step covers (Q4_1 / Q4_K / Q5_0: blocks
// b .. b + 3, o[0..3] elements 0-15, o[4..7] 16-31; Q8_0: blocks b, b + 1, o[0..3] their 4 halves in order).
// Q5_0's sums here are of its unsigned 5-bit values (nibble | fifth bit << 4), MXFP4's of value + 12: group_rows
// takes 16 (12) sum(x) off.
template <int64_t QT>
TANDEM_KERNEL_VNNI inline void step_sums(const Group& g, int64_t b, const int8_t* xp, __m512i o[8]) {
  const int64_t nb = g.nb;
  const __m512i z = _mm512_setzero_si512();
  if constexpr (QT != kQ8_0) {       // the nibble types (nibble_values), or their predecoded values
    const __m512i xl = _mm512_loadu_si512(xp), xh = _mm512_loadu_si512(xp + 64);
    __m512i ul[4], uh[4];
    for (int s = 0; s < 4; ++s) {
      __m512i tl[4], th[4];
      for (int r = 0; r < 4; ++r) {
        __m512i lo, hi;
        if constexpr (QT < 0) {
          lo = _mm512_loadu_si512(g.pre + (4 * s + r) * g.pstride + 32 * b);
          hi = _mm512_loadu_si512(g.pre + (4 * s + r) * g.pstride + 32 * b + 64);
        } else {
          nibble_values<QT>(g.rows[4 * s + r], nb, b, lo, hi);
        }
        tl[r] = _mm512_dpbusd_epi32(z, lo, xl);
        th[r] = _mm512_dpbusd_epi32(z, hi, xh);
      }
      ul[s] = reduce4(tl[0], tl[1], tl[2], tl[3]);
      uh[s] = reduce4(th[0], th[1], th[2], th[3]);
    }
    lanes4(ul, o);
    lanes4(uh, o + 4);
  } else {
    const __mmask64 mk = nb - b >= 2 ? ~(__mmask64)0 : (((__mmask64)1 << 32) - 1);
    const __m512i xv = _mm512_loadu_si512(xp);
    __m512i u[4];
    for (int s = 0; s < 4; ++s) {
      __m512i t[4];
      for (int r = 0; r < 4; ++r) {
        const __m512i w = _mm512_maskz_loadu_epi8(mk, g.rows[4 * s + r] + 2 * nb + 32 * b);   // [d][qs]
        const __mmask64 neg = _mm512_movepi8_mask(w);
        t[r] = _mm512_dpbusd_epi32(z, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(xv, neg, z, xv));
      }
      u[s] = reduce4(t[0], t[1], t[2], t[3]);
    }
    lanes4(u, o);
  }
}

// One half of the fp32 chain: f = fma(float(isum), dx dw, f) (Q4_1 / Q4_K: then fma(sxh, mh, f)).
template <int64_t QT>
TANDEM_KERNEL_VNNI inline __m512 chain(__m512 f, __m512i isum, float dx, float sxh, const Group& g, int64_t u) {
  f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(dx), _mm512_loadu_ps(g.dw + (u / 2) * kG)), f);
  if constexpr (gv_min(QT)) f = _mm512_fmadd_ps(_mm512_set1_ps(sxh), _mm512_loadu_ps(g.mh + (u / 2) * kG), f);
  return f;
}

struct XRows {            // rows of x rounded as gemm_rows_q8act rounds them, in the layout step_sums reads
  const int8_t* q;            // [M][stride]: Q4_1 / Q4_K / Q5_0, per 4 blocks their elements 0-15 then 16-31;
                              // Q8_0 natural
  const float *dx, *sxh;      // [M][2 nb]
  int64_t stride;
  const int32_t* hs_off;      // [M][2 nb] the offset x each half's sum of q (Q5_0: 16, its quants are v - 16;
                              // MXFP4: 12, its bytes value + 12)
};

// y [mt][kG] (nr real rows) of one group against rows m0 .. m0 + mt - 1 of x, the chains of the mt rows of x
// interleaved (each alone would wait on the fma latency).
template <int64_t QT, int MT>
TANDEM_KERNEL_VNNI void group_rows(const Group& g, const XRows& x, int64_t m0, const float* bias, float* y, int64_t ldy,
                                   int nr) {
  const int64_t nb = g.nb, nh = 2 * nb, bstep = base_of(QT) == kQ8_0 ? 2 : 4;
  __m512 f[MT];
  for (int j = 0; j < MT; ++j) f[j] = _mm512_setzero_ps();
  const int64_t nsteps = (nb + bstep - 1) / bstep, per = (g.pf_lines + nsteps - 1) / nsteps;
  for (int64_t b = 0; b < nb; b += bstep) {
    const int64_t u0 = 2 * b, halves = std::min<int64_t>(2 * bstep, nh - u0);
    if (g.pf && m0 == 0)
      for (int64_t l = (b / bstep) * per, le = std::min(l + per, g.pf_lines); l < le; ++l)
        _mm_prefetch(g.pf + 64 * l, _MM_HINT_T0);
    for (int j = 0; j < MT; ++j) {
      const int64_t m = m0 + j;
      const float *dx = x.dx + m * nh, *sxh = x.sxh + m * nh;
      __m512i o[8];
      step_sums<QT>(g, b, x.q + m * x.stride + 32 * b, o);
      for (int64_t h = 0; h < halves; ++h) {           // halves in order: Q4_1 o[i] is block b + i's first half
        const int64_t u = u0 + h;
        __m512i isum = QT != kQ8_0 ? o[(h / 2) + 4 * (h % 2)] : o[h];
        if constexpr (has_offset(QT)) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(x.hs_off[m * nh + u]));
        f[j] = chain<QT>(f[j], isum, dx[u], sxh[u], g, u);
      }
    }
  }
  const __mmask16 keep = nr >= kG ? (__mmask16)0xffff : (__mmask16)((1u << nr) - 1);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
  for (int j = 0; j < MT; ++j) _mm512_mask_storeu_ps(y + j * ldy, keep, bias ? _mm512_add_ps(f[j], bv) : f[j]);
}

template <int64_t QT>
void group_all(const Group& g, const XRows& x, int64_t M, const float* bias, float* y, int64_t N, int nr) {
  for (int64_t m0 = 0; m0 < M; m0 += kMx) {
    const int64_t mt = std::min<int64_t>(kMx, M - m0);
    float* yo = y + m0 * N;
    if (mt == 4) group_rows<QT, 4>(g, x, m0, bias, yo, N, nr);
    else if (mt == 3) group_rows<QT, 3>(g, x, m0, bias, yo, N, nr);
    else if (mt == 2) group_rows<QT, 2>(g, x, m0, bias, yo, N, nr);
    else group_rows<QT, 1>(g, x, m0, bias, yo, N, nr);
  }
}

#include "gemv_rows_q8act_avx2.inc"

// The body gemv_rows_q8act runs for this ISA request: 2 AVX-512 VNNI, 1 AVX2 (also AVX-512 without VNNI), 0 none.
int gemv_body(int64_t isa_req) {
  const Isa isa = resolve_isa(isa_req);
  return isa == kAvx512 && cpu_has_vnni() ? 2 : isa >= kAvx2 ? 1 : 0;
}

}  // namespace

// Rows of x up to which linear_rows_q8act runs this GEMV on these types, past which gemm_rows_q8act (the same bits), by
// the body: measured on one thread, SmolLM2's and Gemma 3's shapes (benchmarks/results/unified_int8.md). AVX-512
// VNNI: Q4_1 and Q4_K ahead of the GEMM up to 16 rows (1.0-1.4x linear_rows_q8act's former body at 1 row), Q8_0 up to
// 8; Q5_0 (Gemma 3's q / k / gate / up) up to 16, 1.1-1.5x its former body at 1-16 rows (AMD EPYC, one
// thread), so the GEMM can take over from 17 rows (2.3x the former body at 64). AVX2: Q4_K up to 16 rows
// (1.0-1.25x the decode body); Q4_1 and Q8_0 not (0.7-1.0x it; benchmarks/results/avx2_session.md); Q5_0 has
// no AVX2 body. MXFP4 (gpt-oss's experts) up to 16 as Q5_0, whose arithmetic it shares (unsigned bytes, an offset
// off each half's exact sum; one vpshufb where Q5_0 adds its fifth bits): at 1 row it runs in 0.92-1.04x the time
// of Q4_0's own decode body on gpt-oss-20b's expert shapes (benchmarks/results/mxfp4_gemv.md; Intel Xeon with AMX,
// 2 threads; its row counts past 1 not measured);
// AVX2: no body (linear_rows_q8act's own up to small_m()). 0: not this type or CPU (the scalar fallback keeps linear_rows_q8act's
// own body).
int64_t gemv_rows_q8act_max_rows_isa(int64_t qtype, int64_t isa_req) {
  const int body = gemv_body(isa_req);
  if (body == 2) return qtype == kQ4_1 || qtype == kQ5_0 || qtype == kMXFP4 ? 16 : qtype == kQ8_0 ? 8 : 0;
  return 0;
}

int64_t gemv_rows_q8act_max_rows(int64_t qtype) { return gemv_rows_q8act_max_rows_isa(qtype, -1); }

at::Tensor gemv_rows_q8act(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                           const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  check_int8_args("tandem.gemv_rows_q8act", x_in, w, qtype, K, bias_in);
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0 || qtype == kQ5_0 || qtype == kMXFP4,
              "tandem.gemv_rows_q8act: Q4_1, Q8_0, Q5_0 or MXFP4 (ggml types 3, 8, 6, 39; Q4_K / Q5_K / Q6_K run the K8 ",
              "contract, k8_spec.cpp), got ", qtype);
  const int body = gemv_body(isa_req);
  TORCH_CHECK(body > 0, "tandem.gemv_rows_q8act needs AVX2 (or AVX-512 VNNI)");
  TORCH_CHECK((qtype != kQ5_0 && qtype != kMXFP4) || body == 2,
              "tandem.gemv_rows_q8act: Q5_0 and MXFP4 need AVX-512 VNNI (the AVX2 body has neither)");
  auto [x, bias, y] = linear_io(x_in, bias_in, w.size(0));
  const int64_t M = x.size(0), N = w.size(0), nb = K / 32, nh = 2 * nb, row_bytes = w.size(1);
  if (M == 0 || N == 0) return y;
  // x rounded as linear_rows_q8act / gemm_rows_q8act round it (quantize_act_row); Q4_1's bytes per xg blocks (a step's:
  // 4 VNNI, 2 AVX2): elements 0-15 of each, then 16-31 (blocks past nb zero). Padded by a step so the last
  // step's loads stay in the buffer.
  const bool q4 = qtype != kQ8_0;
  const int64_t xg = body == 2 ? 4 : 2, stride = q4 ? (nb + xg - 1) / xg * 32 * xg : (nb + 1) / 2 * 64;
  std::vector<int8_t> xq(M * stride, 0);
  std::vector<float> dx(M * nh), sxh(M * nh);
  const int32_t offset = qtype == kQ5_0 ? 16 : qtype == kMXFP4 ? kMxfp4Offset : 0;
  std::vector<int32_t> hs_off(offset ? M * nh : 0);
  {
    std::vector<int8_t> q(K);
    std::vector<float> sx(nb);
    for (int64_t m = 0; m < M; ++m) {
      int8_t* row = xq.data() + m * stride;
      quantize_act_row(x.data_ptr<float>() + m * K, K, q4 ? q.data() : row, dx.data() + m * nh, sx.data(),
                       sxh.data() + m * nh);
      for (int64_t u = 0; u < (int64_t)hs_off.size() / M; ++u) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * u + i];
        hs_off[m * nh + u] = offset * sum;
      }
      for (int64_t b = 0; q4 && b < nb; ++b) {
        int8_t* g = row + (b / xg) * 32 * xg + (b % xg) * 16;
        std::memcpy(g, q.data() + 32 * b, 16);
        std::memcpy(g + 16 * xg, q.data() + 32 * b + 16, 16);
      }
    }
  }
  const XRows xr{xq.data(), dx.data(), sxh.data(), stride, hs_off.data()};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int G = body == 2 ? kG : kG2;                  // weight rows of a group: the fp32 chain's lanes
  at::parallel_for(0, (N + G - 1) / G, 1, [&](int64_t g0, int64_t g1) {
    std::vector<uint8_t> zero(row_bytes, 0);
    std::vector<float> dw(nb * G), mh(nb * G), tmp(qtype == kMXFP4 ? G * 4 * nb : 0);
    // Q5_0 with several rows of x on the VNNI body: its values decoded once a group (predecode). Measured, one
    // thread, Gemma 3's 2048 x 640: 1.2x / 1.4x / 1.5x at 2 / 8 / 16 rows against decoding them for each row of x
    // (Q4_1 / Q4_K, whose decode is two ops, lose at 2 rows and gain nothing at 4-16: they decode inline).
    const bool predecoded = qtype == kQ5_0 && body == 2 && M > 1;
    const int64_t pstride = (nb + 3) / 4 * 128;
    std::vector<uint8_t> pre(predecoded ? kG * pstride : 0);
    const uint8_t* rows[kG];
    for (int64_t gi = g0; gi < g1; ++gi) {
      const int64_t n0 = gi * G;
      const int nr = (int)std::min<int64_t>(G, N - n0);
      for (int r = 0; r < G; ++r) rows[r] = r < nr ? wp + (n0 + r) * row_bytes : zero.data();
      // The next group's rows (contiguous), a slice each step of this one's first pass (group_rows): a group
      // reads 16 rows 64 bytes at a time, 16 streams the hardware prefetcher follows badly. AMD EPYC with
      // AVX-512, Gemma 3's 262,144 x 640 Q8_0 head, 2 threads: 14.6 -> 12.9 ms at 2 rows, 17.4 -> 13.2 at 4
      // (1 row: no change, ~11.8 ms; a burst of the whole next group at once, or two and four groups ahead, no
      // better).
      const char* pf = gi + 1 < g1 ? (const char*)(wp + (n0 + G) * row_bytes) : nullptr;
      const int64_t pf_lines = pf ? (std::min<int64_t>(G, N - n0 - G) * row_bytes + 63) / 64 : 0;
      if (body == 2) group_scales(qtype, rows, nb, dw.data(), mh.data(), tmp.data());
      else group_scales_avx2(qtype, rows, nb, dw.data(), mh.data());
      if (predecoded) predecode<kQ5_0>(rows, nb, pre.data(), pstride);
      const Group g{rows, nb, dw.data(), mh.data(), predecoded ? pre.data() : nullptr, pstride, pf, pf_lines};
      const float* bn = bp ? bp + n0 : nullptr;
      if (body == 2) {
        if (predecoded) group_all<-kQ5_0>(g, xr, M, bn, yp + n0, N, nr);
        else if (qtype == kQ4_1) group_all<kQ4_1>(g, xr, M, bn, yp + n0, N, nr);
        else if (qtype == kQ5_0) group_all<kQ5_0>(g, xr, M, bn, yp + n0, N, nr);
        else if (qtype == kMXFP4) group_all<kMXFP4>(g, xr, M, bn, yp + n0, N, nr);
        else group_all<kQ8_0>(g, xr, M, bn, yp + n0, N, nr);
      } else {
        if (qtype == kQ4_1) group_all_avx2<kQ4_1>(g, xr, M, bn, yp + n0, N, nr);
        else group_all_avx2<kQ8_0>(g, xr, M, bn, yp + n0, N, nr);
      }
    }
  });
  return y;
}

}  // namespace tandem
