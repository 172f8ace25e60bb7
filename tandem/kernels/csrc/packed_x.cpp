// The rows of x the packed GEMVs read (gemv_packed_q8act.cpp, gemv_packed_k_q8act.cpp), rounded as gemm_rows_q8act
// rounds them (quantize_act_row), with each half's sum of quants times what the type's unsigned weight bytes add
// (ops.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace tandem {

PackedX quantize_packed_x(const at::Tensor& x, int32_t unit) {
  const int64_t M = x.size(0), K = x.size(1), nh = K / 16, nb = K / 32;
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xs;
  static thread_local std::vector<int32_t> xo;
  if ((int64_t)xq.size() < M * K) xq.resize(M * K);
  if ((int64_t)xs.size() < 2 * M * nh) xs.resize(2 * M * nh);
  if ((int64_t)xo.size() < M * nh) xo.resize(M * nh);
  int8_t* xqp = xq.data();
  float *dxp = xs.data(), *sxhp = dxp + M * nh;                         // dx, sxh [M][nh]
  int32_t* xop = xo.data();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {       // rows are independent: any split, same bytes
    std::vector<float> sx(nb);
    for (int64_t m = r0; m < r1; ++m) {
      int8_t* q = xqp + m * K;
      quantize_act_row(xp + m * K, K, q, dxp + m * nh, sx.data(), sxhp + m * nh);
      for (int64_t u = 0; u < nh; ++u) {
        int32_t sum = 0;
        for (int i = 0; i < 16; ++i) sum += q[16 * u + i];
        xop[m * nh + u] = unit * sum;
      }
    }
  });
  return PackedX{xqp, dxp, sxhp, xop};
}


// The K8 rows of x: one super-block's max, d and 1 / d as scalars (the same in every body), its products x / d
// rounded to nearest even (vcvtps2dq under the default rounding mode = nearbyint) and saturated to int8 as
// vpmovsdb does, so every body writes the same bytes and sums.
// A super-block's sums as quantize_k8_x keeps them (ops.h): its halves' (per16) or its sub-blocks'.
inline void store_sums(const int* sums, bool per16, int16_t* bs) {
  for (int u = 0; u < 16; ++u) bs[u] = (int16_t)(per16 ? sums[u] : u < 8 ? sums[2 * u] + sums[2 * u + 1] : 0);
}

namespace scalar {
void quantize_k8_block(const float* x, int8_t* q, float* d, int16_t* bs, bool per16) {
  float amax = 0.f;
  for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
  int sums[16] = {};
  for (int i = 0; i < 256; ++i) {
    const int v = std::clamp((int)std::nearbyint(x[i] * id), -128, 127);
    q[i] = (int8_t)v;
    sums[i / 16] += v;
  }
  *d = dd;
  store_sums(sums, per16, bs);
}
}  // namespace scalar

namespace avx512 {
TANDEM_KERNEL_AVX512 void quantize_k8_block(const float* x, int8_t* q, float* d, int16_t* bs, bool per16) {
  __m512 m = _mm512_setzero_ps();
  for (int u = 0; u < 16; ++u) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + 16 * u)));
  const float amax = _mm512_reduce_max_ps(m), dd = amax / 127.f, id = dd > 0.f ? 1.f / dd : 0.f;
  int sums[16];
  for (int u = 0; u < 16; ++u) {
    const __m512i iv = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16 * u), _mm512_set1_ps(id)));
    const __m128i b = _mm512_cvtsepi32_epi8(iv);
    _mm_storeu_si128((__m128i*)(q + 16 * u), b);
    sums[u] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(b));
  }
  *d = dd;
  store_sums(sums, per16, bs);
}
}  // namespace avx512

namespace avx2 {
TANDEM_KERNEL_AVX2 void quantize_k8_block(const float* x, int8_t* q, float* d, int16_t* bs, bool per16) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int u = 0; u < 32; ++u) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * u)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))), dd = amax / 127.f;
  const float id = dd > 0.f ? 1.f / dd : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  int sums[16];
  for (int u = 0; u < 16; ++u) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * u), vid));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16 * u + 8), vid));
    const __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xd8);      // 16 int16 in order
    const __m128i b = _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1));
    _mm_storeu_si128((__m128i*)(q + 16 * u), b);
    const __m256i w = _mm256_cvtepi8_epi32(b), w1 = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
    const __m256i s8 = _mm256_add_epi32(w, w1);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    sums[u] = _mm_cvtsi128_si32(s4);
  }
  *d = dd;
  store_sums(sums, per16, bs);
}
}  // namespace avx2

K8X quantize_k8_x(const at::Tensor& x, bool per16) {
  const int64_t M = x.size(0), K = x.size(1), ns = K / 256;
  TORCH_CHECK(K % 256 == 0, "tandem: K-quant activations need K a multiple of 256, got ", K);
  static thread_local std::vector<int8_t> xq;
  static thread_local std::vector<float> xd;
  static thread_local std::vector<int16_t> xb;
  if ((int64_t)xq.size() < M * K) xq.resize(M * K);
  if ((int64_t)xd.size() < M * ns) xd.resize(M * ns);
  if ((int64_t)xb.size() < 16 * M * ns) xb.resize(16 * M * ns);
  int8_t* qp = xq.data();
  float* dp = xd.data();
  int16_t* bp = xb.data();
  const float* xp = x.data_ptr<float>();
  const Isa isa = best_isa();                 // the bytes: the same whichever body runs
  at::parallel_for(0, M * ns, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      TANDEM_BODY(isa, quantize_k8_block)(xp + 256 * b, qp + 256 * b, dp + b, bp + 16 * b, per16);
  });
  return K8X{qp, dp, bp, K, ns};
}

}  // namespace tandem
