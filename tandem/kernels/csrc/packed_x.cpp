// The rows of x the packed GEMVs read (gemv_packed_q8act.cpp, gemv_packed_k_q8act.cpp), rounded as gemm_rows_q8act
// rounds them (quantize_act_row), with each half's sum of quants times what the type's unsigned weight bytes add
// (ops.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"

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


}  // namespace tandem
