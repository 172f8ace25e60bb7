// int8-activation quantized linear (kernels_act="int8", the default decode path), after llama.cpp: each row of
// x is quantized once per call to int8 halves of 16 (dx = max|x| / 127 per half, xq = round(x / dx)), and
// every weight block meets it in integer dot products (AVX-512 VNNI vpdpbusd; AVX2 pmaddubsw + pmaddwd), one
// per half, each scaled by its own dx. llama.cpp rounds x in blocks of 32 (Q8_0 / Q8_1); halves of 16 halve
// the KL divergence of the next-token distributions from the exact mode (benchmarks/results/kl_divergence.md)
// at the price of one more conversion and fma per half-block. With i over a half h of block b (sx: the
// rounded x's sums, dx xq summed):
//   Q4_0: y = sum_b d_b (sum_h dx_bh sum_i q_i xq_i - 8 sx_b)
//   Q4_1: y = sum_b d_b sum_h dx_bh sum_i q_i xq_i + m_b sx_b
//   Q8_0: y = sum_b d_b sum_h dx_bh sum_i q_i xq_i
//   Q5_0, Q5_1: as Q4_0 (offset 16) and Q4_1, q_i the 5-bit value (0..31, still an unsigned byte for vpdpbusd)
//   Q4_K, Q5_K: a sub-block is a Q4_1 / Q5_1 block with d = d sc_j and m = -dmin m_j (fp32, k_scales.inc)
//   MXFP4: q_i = its value + 12 (0..24, one vpshufb of the nibbles), a Q4_1 block with d = 2^(e - 128) and
//     m = -12 d (fp32 row scales as the K-quants', mxfp4.h)
//   Q6_K, Q3_K, Q2_K: the unsigned q (0..63, 0..7, 0..3) of each 16-weight sub-block u = one half, scale s_u:
//     y = sum_u s_u dx_u (sum_i q_i xq_i) - c_u sx_u, c_u = 32 s_u (Q6_K), 4 s_u (Q3_K), dmin m_u (Q2_K)
// The integer sums are exact, so the bodies differ from the scalar specification only in fp32 summation order;
// the result differs from the fp32-activation kernel by the rounding of x (tests/kernels/test_int8_act.py bounds it,
// benchmarks/kl_divergence.py measures it against llama.cpp's own).
// Weights: the QuantWeight rows of linear_rows.cpp. Q4 / Q5 (and Q4_K / Q5_K) activations are stored in the
// nibble order of the weights: a group of g blocks (g = 4 on AVX-512, 2 on AVX2, then 2 / 1 for the tail) holds
// the g blocks' elements 0-15, then their elements 16-31, so one load of 16 g quant bytes, masked and shifted
// (Q5: the fifth bits added from qh), lines up with two loads of x. Q8_0, Q2_K, Q3_K and Q6_K activations stay
// in natural order: a K-quant's 32 weights of one (h, t) field are 32 consecutive elements.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "mxfp4.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

#include "vec_ext.inc"

bool cpu_has_vnni();

namespace {

enum : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14
};

#include "k_scales.inc"

// An m term beside d (Q4_K / Q5_K: -dmin m_j).
constexpr bool has_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1 || qtype == kQ4_K || qtype == kQ5_K; }
constexpr bool is_q5(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ5_K; }
constexpr bool is_k(int64_t qtype) { return qtype >= kQ2_K && qtype <= kQ6_K; }
constexpr bool is_k16(int64_t qtype) { return qtype == kQ2_K || qtype == kQ3_K || qtype == kQ6_K; }  // 16-weight scales
constexpr bool natural_order(int64_t qtype) { return qtype == kQ8_0 || is_k16(qtype); }
// fp32 scales decoded once per row and call (row_scales): the K-quants' sub-blocks', MXFP4's exponents.
constexpr bool has_row_scales(int64_t qtype) { return is_k(qtype) || qtype == kMXFP4; }
constexpr int64_t k16_bytes(int64_t qtype) { return qtype == kQ2_K ? 84 : qtype == kQ3_K ? 110 : 210; }

// The unsigned q of element i < 32 of 32-weight block j < 8 of a Q2_K / Q3_K / Q6_K super-block (h = j / 4,
// t = j % 4; element 128 h + 32 t + i of the super-block, linear_rows.cpp's formats), and its offset:
// the weight is s_u (q - offset) (Q2_K: d sc_u q - dmin m_u, offset 0 and the min apart).
inline int k16_q(int64_t qtype, const uint8_t* blk, int j, int i) {
  const int h = j / 4, t = j % 4;
  if (qtype == kQ2_K) return blk[16 + 32 * h + i] >> 2 * t & 3;
  if (qtype == kQ3_K) return (blk[32 + 32 * h + i] >> 2 * t & 3) | (blk[i] >> j & 1) << 2;
  return (blk[64 * h + 32 * (t % 2) + i] >> 4 * (t / 2) & 15) | (blk[128 + 32 * h + i] >> 2 * t & 3) << 4;
}
constexpr float k16_offset(int64_t qtype) { return qtype == kQ6_K ? 32.f : qtype == kQ3_K ? 4.f : 0.f; }

struct QRow {             // one quantized row of x
  const int8_t* q;        // [K], layout above
  const float* dx;        // [2 nb] dx of each 16-element half of a block (elements 0-15, then 16-31)
  const float* sx;        // [nb] sum of the rounded x of each block (dx xq summed over both halves)
  const float* sxh;       // [2 nb] the same of each half
};
constexpr int64_t kRowFloats = 5;    // floats of a QRow's arrays per block
// (The bodies spread a half's dx over the 4 int32 lanes of its dot product with a permute: a [8 nb] array of
// them repeated cost the many-row case its cache bandwidth, 2.6 bytes of x read per weight and row.)

// Group sizes along a row of nb blocks: g (the ISA's) while they fit, then 2, then 1.
template <typename F>
inline void for_groups(int64_t nb, int g, F&& f) {
  int64_t b = 0;
  for (; b + g <= nb; b += g) f(b, g);
  for (int h = g / 2; h >= 1; h /= 2)
    if (b + h <= nb) { f(b, h); b += h; }
}

namespace scalar {
// Halves [0, nh) of x: half u is elements [16 u, 16 u + 16), its bytes q, its scale dx[u] and its sum sxh[u].
void quantize_halves(const float* x, int64_t nh, int8_t* q, float* dx, float* sxh) {
  for (int64_t u = 0; u < nh; ++u) {
    float amax = 0.f;
    for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(x[16 * u + i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 16; ++i) {
      int v = (int)std::nearbyint(x[16 * u + i] * id);
      q[16 * u + i] = (int8_t)v;
      sum += v;
    }
    dx[u] = d;
    sxh[u] = d * (float)sum;
  }
}
}  // namespace scalar

// The halves with SIMD: the same max, the same scalar d and 1 / d, the same fp32 products rounded to nearest
// even (vcvtps2dq under the default rounding mode = nearbyint), so the same bytes and sums (measured: the
// scalar loop was 2.4 ms of a 6 ms int8 GEMM at 512 x 1536, ~3 ns an element).
namespace avx512 {
TANDEM_KERNEL_AVX512 void quantize_halves(const float* x, int64_t nh, int8_t* q, float* dx, float* sxh) {
  for (int64_t u = 0; u < nh; ++u) {
    const __m512 v = _mm512_loadu_ps(x + 16 * u), a = _mm512_abs_ps(v);
    __m256 m8 = _mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m512i iv = _mm512_cvtps_epi32(_mm512_mul_ps(v, _mm512_set1_ps(id)));
    _mm_storeu_si128((__m128i*)(q + 16 * u), _mm512_cvtsepi32_epi8(iv));
    __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(iv), _mm512_extracti64x4_epi64(iv, 1));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    dx[u] = d;
    sxh[u] = d * (float)_mm_cvtsi128_si32(s4);
  }
}

}  // namespace avx512

namespace avx2 {
TANDEM_KERNEL_AVX2 void quantize_halves(const float* x, int64_t nh, int8_t* q, float* dx, float* sxh) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t u = 0; u < nh; ++u) {
    const __m256 v0 = _mm256_loadu_ps(x + 16 * u), v1 = _mm256_loadu_ps(x + 16 * u + 8);
    const __m256 m8 = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    const __m256 vid = _mm256_set1_ps(id);
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
    const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);      // 16 int16 in order
    _mm_storeu_si128((__m128i*)(q + 16 * u), _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
    const __m256i s8 = _mm256_add_epi32(i0, i1);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    dx[u] = d;
    sxh[u] = d * (float)_mm_cvtsi128_si32(s4);
  }
}
}  // namespace avx2

// Quantizes x [K] into q / dx / sx / sxh; `group` 0: natural order, else the Q4 group order.
void quantize_row(const float* x, int64_t K, int group, int8_t* q, float* dx, float* sx, float* sxh) {
  const int64_t nb = K / 32;
  std::vector<int8_t> nat(group ? K : 0);
  int8_t* out = group ? nat.data() : q;
  const Isa isa = best_isa();                 // the activations' bytes: the same whichever body runs
  TANDEM_BODY(isa, quantize_halves)(x, 2 * nb, out, dx, sxh);
  for (int64_t b = 0; b < nb; ++b) sx[b] = sxh[2 * b] + sxh[2 * b + 1];
  if (!group) return;
  for_groups(nb, group, [&](int64_t b, int g) {
    for (int p = 0; p < 2; ++p)
      for (int j = 0; j < g; ++j)
        std::memcpy(q + 32 * b + 16 * (p * g + j), nat.data() + 32 * (b + j) + 16 * p, 16);
  });
}

struct Q8Args {
  int64_t qtype, M, N, K, row_bytes;
  const QRow* x;        // [M]
  const uint8_t* w;     // [N, row_bytes]
  const float* bias;    // [N] or null
  float* y;             // [M, N]
};

// Scalar specification (natural-order activations).
// A K-quant row's sub-block scales as fp32 (k_scales' layout), once per row and call.
// MXFP4: [d x nb][-12 d x nb], read as a Q4_K row's [d sc x nb][-dmin m x nb].
TANDEM_KERNEL_F16C void row_scales(int64_t qtype, const uint8_t* row, int64_t nb, float* sc) {
  if (qtype != kMXFP4) return k_scales(qtype, row, nb, sc);
  e8m0_halves(row, nb, sc);
  for (int64_t b = 0; b < nb; ++b) sc[nb + b] = -(float)kMxfp4Offset * sc[b];
}

// Where a row's 5th bits (qh) and quants (qs) start: [d][m][qh][qs] (legacy), [headers][qh][qs] (Q4_K / Q5_K),
// [e][qs] (MXFP4).
constexpr int64_t qh_offset(int64_t qtype, int64_t nb) {
  return qtype == kMXFP4 ? nb : (is_k(qtype) ? 2 : has_min(qtype) ? 4 : 2) * nb;
}

// Scalar specification (natural-order activations). sc: the row's K-quant scales (4 nb floats), or unused.
namespace scalar {
constexpr int GROUP = 0;
void rows(const Q8Args& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32;
  std::vector<float> sc(4 * nb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    if (has_row_scales(a.qtype)) row_scales(a.qtype, row, nb, sc.data());
    for (int64_t m = 0; m < a.M; ++m) {
      const QRow& x = a.x[m];
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        if (is_k16(a.qtype)) {
          const uint8_t* blk = row + k16_bytes(a.qtype) * (b / 8);
          for (int half = 0; half < 2; ++half) {
            const int64_t u = 2 * b + half;
            int dot = 0;
            for (int i = 16 * half; i < 16 * half + 16; ++i) dot += k16_q(a.qtype, blk, (int)(b % 8), i) * x.q[32 * b + i];
            s += sc[u] * x.dx[u] * (float)dot - k16_offset(a.qtype) * sc[u] * x.sxh[u];
            if (a.qtype == kQ2_K) s -= sc[2 * nb + u] * x.sxh[u];
          }
          continue;
        }
        const float d = has_row_scales(a.qtype) ? sc[b] : fp16_to_fp32(load_u16(row + 2 * b));
        int dot[2] = {0, 0};                                            // the block's two halves
        if (a.qtype == kQ8_0) {
          for (int i = 0; i < 32; ++i) dot[i / 16] += (int8_t)row[2 * nb + 32 * b + i] * x.q[32 * b + i];
          s += d * (x.dx[2 * b] * (float)dot[0] + x.dx[2 * b + 1] * (float)dot[1]);
          continue;
        }
        const uint8_t* qh = row + qh_offset(a.qtype, nb);
        const uint8_t* qs = qh + (is_q5(a.qtype) ? 4 * nb : 0) + 16 * b;
        uint32_t h = 0;
        if (is_q5(a.qtype)) std::memcpy(&h, qh + 4 * b, 4);
        for (int i = 0; i < 16; ++i) {
          int lo = (qs[i] & 15) | (h >> i & 1) << 4, hi = (qs[i] >> 4) | (h >> (16 + i) & 1) << 4;
          if (a.qtype == kMXFP4) lo = kMxfp4Unsigned[lo], hi = kMxfp4Unsigned[hi];
          dot[0] += lo * x.q[32 * b + i];
          dot[1] += hi * x.q[32 * b + 16 + i];
        }
        s += d * (x.dx[2 * b] * (float)dot[0] + x.dx[2 * b + 1] * (float)dot[1]);
        if (has_row_scales(a.qtype)) s += sc[nb + b] * x.sx[b];
        else s += has_min(a.qtype) ? fp16_to_fp32(load_u16(row + 2 * nb + 2 * b)) * x.sx[b]
                                   : (is_q5(a.qtype) ? -16.f : -8.f) * d * x.sx[b];
      }
      a.y[m * a.N + n] = s + (a.bias ? a.bias[n] : 0.f);
    }
  }
}
}  // namespace scalar

// ---- SIMD bodies: one integer dot-product step per vector width, the rest shared -------------------------

namespace avx512 {
constexpr int GROUP = 4;
TANDEM_KERNEL_VNNI inline __m512i dot(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
TANDEM_KERNEL_VNNI inline __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
TANDEM_KERNEL_VNNI inline __m128i dot(__m128i acc, __m128i u, __m128i s) { return _mm_dpbusd_epi32(acc, u, s); }
#define TGT TANDEM_KERNEL_VNNI
#define Q8_GROUP4 1
#include "linear_rows_q8act_simd.inc"
#undef Q8_GROUP4
#undef TGT
}  // namespace avx512

namespace avx2 {
constexpr int GROUP = 2;
TANDEM_KERNEL_AVX2 inline __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
TANDEM_KERNEL_AVX2 inline __m128i dot(__m128i acc, __m128i u, __m128i s) {
  return _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(u, s), _mm_set1_epi16(1)));
}
#define TGT TANDEM_KERNEL_AVX2
#define Q8_GROUP4 0
#include "linear_rows_q8act_simd.inc"
#undef Q8_GROUP4
#undef TGT
}  // namespace avx2

}  // namespace

void quantize_act_row(const float* x, int64_t K, int8_t* q, float* dx, float* sx, float* sxh) {
  quantize_row(x, K, 0, q, dx, sx, sxh);
}

void check_int8_args(const char* op, const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t K,
                     const std::optional<at::Tensor>& bias) {
  int64_t bytes = 0, qk = 32;        // bytes and weights along K of one block
  switch (qtype) {
    case kQ4_0: bytes = 18; break;
    case kQ4_1: bytes = 20; break;
    case kQ5_0: bytes = 22; break;
    case kQ5_1: bytes = 24; break;
    case kQ8_0: bytes = 34; break;
    case kQ2_K: bytes = 84, qk = 256; break;
    case kQ3_K: bytes = 110, qk = 256; break;
    case kQ4_K: bytes = 144, qk = 256; break;
    case kQ5_K: bytes = 176, qk = 256; break;
    case kQ6_K: bytes = 210, qk = 256; break;
    case kMXFP4: bytes = 17; break;
    default:
      TORCH_CHECK(false, op, ": int8 activations support Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7, Q8_0=8, ",
                  "Q2_K=10, Q3_K=11, Q4_K=12, Q5_K=13, Q6_K=14 and MXFP4=39, got ggml type ", qtype);
  }
  TORCH_CHECK(K > 0 && K % qk == 0, op, ": K must be a positive multiple of ", qk, " for ggml type ", qtype,
              ", got ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == K / qk * bytes,
              op, ": w must be a contiguous uint8 [N, ", K / qk * bytes, "] tensor");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == K, op, ": x must be fp32 [M, ", K, "]");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->numel() == w.size(0)), op,
              ": bias must be fp32 [N]");
}

at::Tensor linear_rows_q8act(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                             const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  check_int8_args("tandem.linear_rows_q8act", x_in, w, qtype, K, bias_in);
  if (k8_type(qtype)) return k8_rows_spec(x_in, w, qtype, K, bias_in);     // Q4_K / Q5_K / Q6_K: the K8 contract
  // Q4_1 / Q8_0 / Q5_0 / MXFP4 with AVX-512 VNNI: the GEMM's arithmetic at every row count
  // (gemv_rows_q8act.cpp), so a row's output is the same bits at any M and in any step; the bodies below otherwise.
  if (const int64_t gv = gemv_rows_q8act_max_rows_isa(qtype, isa_req); gv > 0)
    return x_in.size(0) <= gv ? gemv_rows_q8act(x_in, w, qtype, K, bias_in, isa_req)
                              : gemm_rows_q8act(x_in, w, qtype, K, bias_in, isa_req);
  auto [x, bias, y] = linear_io(x_in, bias_in, w.size(0));
  const int64_t M = x.size(0), N = w.size(0), nb = K / 32;
  if (M == 0 || N == 0) return y;
  Isa isa = resolve_isa(isa_req);
  if (isa == kAvx512 && !cpu_has_vnni()) isa = kAvx2;       // AVX-512 without VNNI: the AVX2 body
  using Rows = void (*)(const Q8Args&, int64_t, int64_t);
  Rows fn = TANDEM_BODY(isa, rows);
  const int group = natural_order(qtype) ? 0 : TANDEM_BODY(isa, GROUP);
  // Reused per thread, grow-only (as gemm_rows_q8act's tiles: a fresh buffer of MBs is mapped and unmapped each call).
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xs;
  static thread_local std::vector<QRow> rows;
  if ((int64_t)xq.size() < M * K) xq.resize(M * K);
  if ((int64_t)xs.size() < M * nb * kRowFloats) xs.resize(M * nb * kRowFloats);
  if ((int64_t)rows.size() < M) rows.resize(M);
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data();            // (the workers below must not name the thread_locals: theirs are others)
  float* xsp = xs.data();
  QRow* rp = rows.data();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {       // rows are independent: any split, same bytes
    for (int64_t m = m0; m < m1; ++m) {
      float* s = xsp + m * nb * kRowFloats;
      quantize_row(xp + m * K, K, group, xqp + m * K, s, s + 2 * nb, s + 3 * nb);
      rp[m] = QRow{xqp + m * K, s, s + 2 * nb, s + 3 * nb};
    }
  });
  Q8Args a{qtype, M, N, K, w.size(1), rp, w.data_ptr<uint8_t>(),
           bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>()};
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t t0, int64_t t1) { fn(a, t0 * 4, std::min(t1 * 4, N)); });
  return y;
}

}  // namespace tandem
