// race_noise(seeds [B], V) -> log E [B, V]: the exponential race's noise alone (race_argmax.cpp's header), for
// tests and the torch reference's check, computed by race_argmax's own score bodies on a zero row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "race.h"
#include "vec.h"

namespace tandem {

using namespace race;

at::Tensor race_noise(const at::Tensor& seeds_in, int64_t V, int64_t isa_req) {
  TORCH_CHECK(V > 0 && V < (1ll << 31), "tandem.race_noise: 0 < vocab < 2^31");
  at::Tensor seeds = checked_seeds(seeds_in, seeds_in.dim() == 1 ? seeds_in.size(0) : -1);
  const int64_t B = seeds.size(0);
  at::Tensor zeros = at::zeros({B, V}, seeds.options().dtype(at::kFloat));
  at::Tensor out = at::empty({B, V}, zeros.options());
  const int64_t* ps = seeds.data_ptr<int64_t>();
  const Isa isa = resolve_isa(isa_req);
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      TANDEM_BODY(isa, scores)(make_row(zeros.data_ptr<float>(), nullptr, ps, b, V), out.data_ptr<float>() + b * V);
      float* o = out.data_ptr<float>() + b * V;
      for (int64_t j = 0; j < V; ++j) o[j] = -o[j];      // scores are 0 - log E
    }
  });
  return out;
}

}  // namespace tandem
