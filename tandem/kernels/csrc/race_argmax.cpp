// The sampler's exponential race in one pass over each row, noise included:
//   race_argmax(x [B, V], t [B]?, seeds [B]?) -> int64 [B],  out[i] = argmax_j (x[i, j] / t[i] - log E[i, j])
//   race_noise(seeds [B], V) -> log E [B, V]      (the noise alone, for tests and the reference's check:
//                                                  race_noise.cpp)
// t absent: no division; seeds absent: no noise (plain argmax, the greedy rows). E[i, j] ~ Exp(1) comes from
// a counter-based hash of (seeds[i], j): v = (hash24 + 1) / 2^24 in (0, 1], E = max(-log v, FLT_MIN), so a
// row's noise is a pure function of its seed, computed lane-parallel. A row of 49,152 tokens, one thread:
// ~130 us with AVX-512 (the hash and two logs are most of it; no noise: 10-20 us), ~360 us with AVX2, where
// torch took ~650 us (mt19937 uniform_ ~200 us, argmax ~100 us, then ~7 passes). The first index wins a
// tie and a NaN counts as the largest value, as torch.argmax does. The torch reference (sampler.py) computes
// the same hash exactly; its log is torch's, ours Cephes' polynomial (~1 ulp; Vec1 / Vec256 / Vec512::log in
// vec.h, one body), so a draw can differ only where two tokens' scores lie within ~1e-6 of each other. One pass
// writes the scores and finds the maximum, a second returns its index.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "race.h"
#include "vec.h"

namespace tandem {
namespace race {   // named, not anonymous: race_noise.cpp reads its rows' scores (race.h)

constexpr uint32_t kGolden = 0x9E3779B9u, kMul1 = 0x7feb352du, kMul2 = 0x846ca68bu;  // lowbias32's constants

inline uint32_t mix(uint32_t x) {
  x ^= x >> 16; x *= kMul1; x ^= x >> 15; x *= kMul2; x ^= x >> 16;
  return x;
}

inline uint32_t noise_bits(uint32_t k0, uint32_t k1, uint32_t j) { return mix(mix(j * kGolden + k0) ^ k1); }

inline float log_noise_scalar(uint32_t k0, uint32_t k1, uint32_t j) {
  const float v = (float)((noise_bits(k0, k1, j) >> 8) + 1) * (1.f / 16777216.f);
  float E = -Vec1::log(v);
  return Vec1::log(E < FLT_MIN ? FLT_MIN : E);
}

inline float value(const Row& r, int64_t j) {
  float v = r.div ? r.x[j] / r.t : r.x[j];
  return r.noise ? v - log_noise_scalar(r.k0, r.k1, (uint32_t)j) : v;
}

namespace scalar {
// First index of the maximum of s[0..V) (a NaN is the largest, the first one wins), plainly.
int64_t first_max(const float* s, int64_t V) {
  int64_t best = 0;
  float bv = s[0];
  if (std::isnan(bv)) return 0;
  for (int64_t j = 1; j < V; ++j) {
    if (std::isnan(s[j])) return j;
    if (s[j] > bv) { bv = s[j]; best = j; }
  }
  return best;
}

void scores(const Row& r, float* s) {
  for (int64_t j = 0; j < r.V; ++j) s[j] = value(r, j);
}
}  // namespace scalar

#define TANDEM_SIMD_BODY "race_noise_simd.inc"            // avx2::log_noise, avx512::log_noise
#include "simd_namespaces.inc"

// ---- AVX-512 ----
namespace avx512 {
TANDEM_KERNEL_AVX512 void scores(const Row& r, float* s) {
  const __m512 t = _mm512_set1_ps(r.t);
  for (int64_t j = 0; j < r.V; j += 16) {
    __mmask16 m = r.V - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (r.V - j)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(m, r.x + j);
    if (r.div) v = _mm512_div_ps(v, t);
    if (r.noise) v = _mm512_sub_ps(v, log_noise(r, j));
    _mm512_mask_storeu_ps(s + j, m, v);
  }
}

// First index of the maximum (NaN: the plain scan's answer).
TANDEM_KERNEL_AVX512 int64_t first_max(const float* s, int64_t V) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 mx = ninf;
  __mmask16 nan = 0;
  for (int64_t j = 0; j < V; j += 16) {
    __mmask16 m = V - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - j)) - 1);
    __m512 v = _mm512_mask_loadu_ps(ninf, m, s + j);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  if (nan) return scalar::first_max(s, V);
  const __m512 best = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  for (int64_t j = 0; j < V; j += 16) {
    __mmask16 m = V - j >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - j)) - 1);
    __mmask16 hit = _mm512_mask_cmp_ps_mask(m, _mm512_maskz_loadu_ps(m, s + j), best, _CMP_EQ_OQ);
    if (hit) return j + __builtin_ctz(hit);
  }
  return 0;                                       // unreachable: the maximum is some element
}
}  // namespace avx512

// ---- AVX2 ----
namespace avx2 {
TANDEM_KERNEL_AVX2 void scores(const Row& r, float* s) {
  const __m256 t = _mm256_set1_ps(r.t);
  const int64_t body = r.V / 8 * 8;
  for (int64_t j = 0; j < body; j += 8) {
    __m256 v = _mm256_loadu_ps(r.x + j);
    if (r.div) v = _mm256_div_ps(v, t);
    if (r.noise) v = _mm256_sub_ps(v, log_noise(r, j));
    _mm256_storeu_ps(s + j, v);
  }
  for (int64_t j = body; j < r.V; ++j) s[j] = value(r, j);
}

TANDEM_KERNEL_AVX2 int64_t first_max(const float* s, int64_t V) {
  const int64_t body = V / 8 * 8;
  __m256 mx = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  for (int64_t j = 0; j < body; j += 8) {
    __m256 v = _mm256_loadu_ps(s + j);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, mx);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
  for (int64_t j = body; j < V; ++j) {
    if (std::isnan(s[j])) return scalar::first_max(s, V);
    m = s[j] > m ? s[j] : m;
  }
  if (_mm256_movemask_ps(nan)) return scalar::first_max(s, V);
  const __m256 best = _mm256_set1_ps(m);
  for (int64_t j = 0; j < body; j += 8) {
    int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + j), best, _CMP_EQ_OQ));
    if (hit) return j + __builtin_ctz(hit);
  }
  for (int64_t j = body; j < V; ++j)
    if (s[j] == m) return j;
  return 0;
}
}  // namespace avx2

at::Tensor checked_seeds(const std::optional<at::Tensor>& s_in, int64_t B) {
  if (!s_in.has_value()) return at::Tensor();
  at::Tensor s = s_in->contiguous();
  TORCH_CHECK(s.dim() == 1 && s.size(0) == B && s.scalar_type() == at::kLong,
              "tandem.race_argmax: seeds must be int64 [rows]");
  return s;
}

}  // namespace race

using namespace race;

at::Tensor race_argmax(const at::Tensor& x_in, const std::optional<at::Tensor>& t_in,
                       const std::optional<at::Tensor>& seeds_in, int64_t isa_req) {
  at::Tensor x = x_in.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0 && x.size(1) < (1ll << 31),
              "tandem.race_argmax: x must be fp32 [rows, vocab] with 0 < vocab < 2^31");
  const int64_t B = x.size(0), V = x.size(1);
  at::Tensor t;
  if (t_in.has_value()) {
    t = t_in->contiguous();
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == at::kFloat,
                "tandem.race_argmax: t must be fp32 [rows]");
  }
  at::Tensor seeds = checked_seeds(seeds_in, B);
  at::Tensor out = at::empty({B}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  const float* pt = t.defined() ? t.data_ptr<float>() : nullptr;
  const int64_t* ps = seeds.defined() ? seeds.data_ptr<int64_t>() : nullptr;
  int64_t* po = out.data_ptr<int64_t>();
  const Isa isa = resolve_isa(isa_req);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf(pt || ps ? V : 0);
    for (int64_t b = b0; b < b1; ++b) {
      const Row r = make_row(px, pt, ps, b, V);
      const float* s = r.x;
      if (pt || ps) {
        TANDEM_BODY(isa, scores)(r, buf.data());
        s = buf.data();
      }
      po[b] = TANDEM_BODY(isa, first_max)(s, V);
    }
  });
  return out;
}

}  // namespace tandem
