// Opt-in int8-activation quantized linear (kernels_act="int8"), llama.cpp style: each row of x is quantized
// once per call to int8 blocks of 32 (dx = max|x| / 127, xq = round(x / dx)), and every weight block meets it
// in an integer dot product (AVX-512 VNNI vpdpbusd; AVX2 pmaddubsw + pmaddwd), scaled once per block:
//   Q4_0: y = sum_b d_b dx_b (sum_i q_i xq_i - 8 sum_i xq_i)
//   Q4_1: y = sum_b d_b dx_b sum_i q_i xq_i + m_b dx_b sum_i xq_i
//   Q8_0: y = sum_b d_b dx_b sum_i q_i xq_i
//   Q5_0, Q5_1: as Q4_0 (offset 16) and Q4_1, q_i the 5-bit value (0..31, still an unsigned byte for vpdpbusd)
// The integer sums are exact, so the bodies differ from the scalar specification only in fp32 summation order;
// the result differs from the fp32-activation kernel by the rounding of x (tests and kernels.md report it).
// Weights: the QuantWeight rows of quant_gemm.cpp. Q4 / Q5 activations are stored in the nibble order of the
// weights: a group of g blocks (g = 4 on AVX-512, 2 on AVX2, then 2 / 1 for the tail) holds the g blocks'
// elements 0-15, then their elements 16-31, so one load of 16 g quant bytes, masked and shifted (Q5: the fifth
// bits added from qh), lines up with two loads of x. Q8_0 activations stay in natural order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "vec.h"

namespace tandem {

#include "quant_gemm_ext.inc"

bool cpu_has_vnni();

namespace {

enum : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8 };

constexpr bool has_min(int64_t qtype) { return qtype == kQ4_1 || qtype == kQ5_1; }    // an m array beside d
constexpr bool is_q5(int64_t qtype) { return qtype == kQ5_0 || qtype == kQ5_1; }

struct QRow {             // one quantized row of x
  const int8_t* q;        // [K], layout above
  const float* dx;        // [nb]
  const float* sx;        // [nb] dx * sum(xq) of each block
  const float* dx4;       // [4 nb] dx of each block 4 times (the int32 lanes of a block's dot product)
};

// Group sizes along a row of nb blocks: g (the ISA's) while they fit, then 2, then 1.
template <typename F>
inline void for_groups(int64_t nb, int g, F&& f) {
  int64_t b = 0;
  for (; b + g <= nb; b += g) f(b, g);
  for (int h = g / 2; h >= 1; h /= 2)
    if (b + h <= nb) { f(b, h); b += h; }
}

// Quantizes x [K] into q / dx / sx / dx4; `group` 0: natural order (Q8_0), else the Q4 group order.
void quantize_row(const float* x, int64_t K, int group, int8_t* q, float* dx, float* sx, float* dx4) {
  const int64_t nb = K / 32;
  std::vector<int8_t> nat(group ? K : 0);
  int8_t* out = group ? nat.data() : q;
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      int v = (int)std::nearbyint(x[32 * b + i] * id);
      out[32 * b + i] = (int8_t)v;
      sum += v;
    }
    dx[b] = d;
    sx[b] = d * (float)sum;
    for (int l = 0; l < 4; ++l) dx4[4 * b + l] = d;
  }
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
namespace scalar {
constexpr int GROUP = 0;
void rows(const Q8Args& a, int64_t n0, int64_t n1) {
  const int64_t nb = a.K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = a.w + n * a.row_bytes;
    for (int64_t m = 0; m < a.M; ++m) {
      const QRow& x = a.x[m];
      float s = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const float d = fp16_to_fp32(load_u16(row + 2 * b));
        int dot = 0;
        if (a.qtype == kQ8_0) {
          for (int i = 0; i < 32; ++i) dot += (int8_t)row[2 * nb + 32 * b + i] * x.q[32 * b + i];
          s += d * x.dx[b] * (float)dot;
          continue;
        }
        const uint8_t* qh = row + (has_min(a.qtype) ? 4 : 2) * nb;     // Q5: [qh u32 x nb][qs x nb]
        const uint8_t* qs = qh + (is_q5(a.qtype) ? 4 * nb : 0) + 16 * b;
        uint32_t h = 0;
        if (is_q5(a.qtype)) std::memcpy(&h, qh + 4 * b, 4);
        for (int i = 0; i < 16; ++i) {
          const int lo = (qs[i] & 15) | (h >> i & 1) << 4, hi = (qs[i] >> 4) | (h >> (16 + i) & 1) << 4;
          dot += lo * x.q[32 * b + i] + hi * x.q[32 * b + 16 + i];
        }
        s += d * x.dx[b] * (float)dot;
        s += has_min(a.qtype) ? fp16_to_fp32(load_u16(row + 2 * nb + 2 * b)) * x.sx[b]
                              : (is_q5(a.qtype) ? -16.f : -8.f) * d * x.sx[b];
      }
      a.y[m * a.N + n] = s + (a.bias ? a.bias[n] : 0.f);
    }
  }
}
}  // namespace scalar

// ---- SIMD bodies: one integer dot-product step per vector width, the rest shared -------------------------
#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define T256 __attribute__((target("avx2,fma,f16c")))

namespace avx512 {
constexpr int GROUP = 4;
T512 inline __m512i dot(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
T512 inline __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
T512 inline __m128i dot(__m128i acc, __m128i u, __m128i s) { return _mm_dpbusd_epi32(acc, u, s); }
#define TGT T512
#define Q8_GROUP4 1
#include "quant_gemm_q8_simd.inc"
#undef Q8_GROUP4
#undef TGT
}  // namespace avx512

namespace avx2 {
constexpr int GROUP = 2;
T256 inline __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
T256 inline __m128i dot(__m128i acc, __m128i u, __m128i s) {
  return _mm_add_epi32(acc, _mm_madd_epi16(_mm_maddubs_epi16(u, s), _mm_set1_epi16(1)));
}
#define TGT T256
#define Q8_GROUP4 0
#include "quant_gemm_q8_simd.inc"
#undef Q8_GROUP4
#undef TGT
}  // namespace avx2

}  // namespace

at::Tensor qlinear_q8(const at::Tensor& x_in, const at::Tensor& w, int64_t qtype, int64_t K,
                      const std::optional<at::Tensor>& bias_in, int64_t isa_req) {
  TORCH_CHECK(qtype == kQ4_0 || qtype == kQ4_1 || qtype == kQ5_0 || qtype == kQ5_1 || qtype == kQ8_0,
              "tandem.qlinear_q8: int8 activations support Q4_0=2, Q4_1=3, Q5_0=6, Q5_1=7 and Q8_0=8, got ggml type ",
              qtype);
  const int64_t bytes = qtype == kQ8_0 ? 34 : qtype == kQ5_1 ? 24 : qtype == kQ5_0 ? 22 : qtype == kQ4_1 ? 20 : 18;
  TORCH_CHECK(K > 0 && K % 32 == 0, "tandem: K must be a positive multiple of 32, got ", K);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous() && w.size(1) == K / 32 * bytes,
              "tandem.qlinear_q8: w must be a contiguous uint8 [N, ", K / 32 * bytes, "] tensor");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) == K,
              "tandem.qlinear_q8: x must be fp32 [M, ", K, "]");
  at::Tensor x = x_in.contiguous();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->contiguous();
  const int64_t M = x.size(0), N = w.size(0), nb = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Isa isa = resolve_isa(isa_req);
  if (isa == kAvx512 && !cpu_has_vnni()) isa = kAvx2;       // AVX-512 without VNNI: the AVX2 body
  using Rows = void (*)(const Q8Args&, int64_t, int64_t);
  Rows fn = isa == kAvx512 ? avx512::rows : isa == kAvx2 ? avx2::rows : scalar::rows;
  const int group = qtype == kQ8_0 ? 0 : isa == kAvx512 ? avx512::GROUP : isa == kAvx2 ? avx2::GROUP : 0;
  std::vector<int8_t> xq((size_t)(M * K));
  std::vector<float> xs((size_t)(M * nb * 6));
  std::vector<QRow> rows((size_t)M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float* s = xs.data() + m * nb * 6;
    quantize_row(xp + m * K, K, group, xq.data() + m * K, s, s + nb, s + 2 * nb);
    rows[m] = QRow{xq.data() + m * K, s, s + nb, s + 2 * nb};
  }
  Q8Args a{qtype, M, N, K, w.size(1), rows.data(), w.data_ptr<uint8_t>(),
           bias.defined() ? bias.data_ptr<float>() : nullptr, y.data_ptr<float>()};
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t t0, int64_t t1) { fn(a, t0 * 4, std::min(t1 * 4, N)); });
  return y;
}

}  // namespace tandem
