// The race's rows and their scores (race_argmax.cpp), shared with race_noise.cpp, whose op returns the noise
// alone: a row's scores are x / t - log E, so a zero row without t scores -log E.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "vec.h"

namespace tandem {
namespace race {

struct Row {
  const float* x;
  float t;
  bool div;           // divide by t
  bool noise;         // subtract log E
  uint32_t k0, k1;    // the row's seed, low and high halves
  int64_t V;
};

inline Row make_row(const float* x, const float* t, const int64_t* seeds, int64_t b, int64_t V) {
  const uint64_t seed = seeds ? (uint64_t)seeds[b] : 0;
  return Row{x ? x + b * V : nullptr, t ? t[b] : 1.f, t != nullptr, seeds != nullptr, (uint32_t)seed,
             (uint32_t)(seed >> 32), V};
}

// seeds [rows] as contiguous int64, or undefined where absent (no noise).
at::Tensor checked_seeds(const std::optional<at::Tensor>& s_in, int64_t B);

// scores(r, s): s[j] = x[j] (/ t) (- log E[j]) over the row's V tokens, in each body's arithmetic.
namespace scalar {
void scores(const Row& r, float* s);
}  // namespace scalar
namespace avx2 {
TANDEM_KERNEL_AVX2 void scores(const Row& r, float* s);
}  // namespace avx2
namespace avx512 {
TANDEM_KERNEL_AVX512 void scores(const Row& r, float* s);
}  // namespace avx512

}  // namespace race
}  // namespace tandem
