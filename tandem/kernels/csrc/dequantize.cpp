// dequantize / dequantize_out: a row-layout weight (QuantWeight.data, linear_rows.cpp's header gives the block
// formats) as fp32 [N, K]: QuantWeight.dequantize, prefill's fp32 GEMM on fp32 activations (quant.py), and
// packed_gather's rows.
// The values are linear_rows' own: its weight check and each ISA body's dequant_row (linear_rows.cpp,
// linear_rows_simd.inc), the bits the tiled path multiplies, d * q + m unfused as gguf-py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <vector>

#include "ops.h"
#include "vec.h"

namespace tandem {

void check_weight(const at::Tensor& w, int64_t qtype, int64_t K);
// dst [nb * 32] = the row's weights; sc: scratch of 4 * nb floats.
namespace scalar {
void dequant_row(int64_t qtype, const uint8_t* row, int64_t nb, float* dst, float* sc);
}  // namespace scalar
namespace avx2 {
TANDEM_KERNEL_AVX2 void dequant_row(int64_t qtype, const uint8_t* row, int64_t nb, float* dst, float* sc);
}  // namespace avx2
namespace avx512 {
TANDEM_KERNEL_AVX512 void dequant_row(int64_t qtype, const uint8_t* row, int64_t nb, float* dst, float* sc);
}  // namespace avx512

using DequantRow = void (*)(int64_t, const uint8_t*, int64_t, float*, float*);

at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K, int64_t isa_req) {
  at::Tensor out = at::empty({w.size(0), K}, w.options().dtype(at::kFloat));
  dequantize_out(w, qtype, K, out, isa_req);
  return out;
}

// Into a caller's buffer: prefill dequantizes a layer per call, and a fresh multi-MB tensor each time
// costs its page faults (the CPU allocator returns large blocks to the OS).
void dequantize_out(const at::Tensor& w, int64_t qtype, int64_t K, const at::Tensor& out, int64_t isa_req) {
  check_weight(w, qtype, K);
  const int64_t N = w.size(0), row_bytes = w.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == N * K,
              "tandem.dequantize_out: out must be a contiguous fp32 tensor of N * K elements");
  Isa isa = resolve_isa(isa_req);
  DequantRow fn = TANDEM_BODY(isa, dequant_row);
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> sc(4 * (K / 32));
    for (int64_t n = n0; n < n1; ++n) fn(qtype, src + n * row_bytes, K / 32, dst + n * K, sc.data());
  });
}

}  // namespace tandem
