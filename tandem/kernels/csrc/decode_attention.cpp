// Paged decode attention: one query token per row, reading K/V in place from the paged cache.
//
//   q        fp32 [B, H, D]                 this step's queries (after RoPE)
//   cache    fp32 [S + 1, L, 2, KVH, D]     every slot holds all layers' K (index 0) and V (index 1)
//   kv_index int64 [B, Lk]                  slot of each key position (only the first seq_lens[b] are read)
//   seq_lens int64 [B]                      keys per row (>= 1)
//   out      fp32 [B, H, D]                 softmax(q k^T * scale) v over the row's keys
// Query heads are grouped by KV head (G = H / KVH share one K/V read). Thread split: at::parallel_for over
// (row, KV head, chunk of CHUNK keys); each task keeps per head a running max, a sum of exponentials and an
// unnormalized output over its chunk (flash-decoding), and a second pass merges a row's chunks with their
// log-sum-exp weights. So a long sequence spreads over every thread, and no key is copied.
// ISA: scores and the V accumulation use Vec512 / Vec256 dot/axpy bodies; the scalar body is the spec.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace tandem {

constexpr int64_t CHUNK = 256;      // keys per task
constexpr int64_t TILE = 32;        // keys scored before their values are accumulated

struct AttnArgs {
  const float* q; const float* cache; const int64_t* kv_index; const int64_t* seq_lens;
  int64_t B, H, KVH, D, Lk, layer_stride, slot_stride, layer;  // slot_stride = L * 2 * KVH * D
  float scale;
  float* part_acc;      // [B, KVH, chunks, G, D]
  float* part_ml;       // [B, KVH, chunks, G, 2]: running max, sum of exp
  int64_t chunks;
};

namespace scalar {
static float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
static void axpy(float* y, float a, const float* x, int64_t n) {   // y += a * x
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
static void scale_(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}
#include "decode_attention_body.inc"
}  // namespace scalar

#define KERNEL __attribute__((target(TANDEM_TARGET_AVX2)))
namespace avx2 {
using V = Vec256;
#include "decode_attention_simd.inc"
#include "decode_attention_body.inc"
}  // namespace avx2
#undef KERNEL

#define KERNEL __attribute__((target(TANDEM_TARGET_AVX512)))
namespace avx512 {
using V = Vec512;
#include "decode_attention_simd.inc"
#include "decode_attention_body.inc"
}  // namespace avx512
#undef KERNEL

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& kv_index_in, const at::Tensor& seq_lens_in, double scale,
                            int64_t isa_req) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "tandem.decode_attention: q must be fp32 [B, H, D]");
  TORCH_CHECK(cache.dim() == 5 && cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(2) == 2,
              "tandem.decode_attention: cache must be a contiguous fp32 [S + 1, L, 2, KVH, D] tensor");
  at::Tensor q = q_in.contiguous();
  at::Tensor kv_index = kv_index_in.to(at::kLong).contiguous();
  at::Tensor seq_lens = seq_lens_in.to(at::kLong).contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = cache.size(3), Lk = kv_index.size(1);
  TORCH_CHECK(cache.size(4) == D && H % KVH == 0, "tandem.decode_attention: head shapes do not match");
  TORCH_CHECK(kv_index.size(0) == B && seq_lens.size(0) == B, "tandem.decode_attention: batch sizes differ");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "tandem.decode_attention: layer out of range");
  const int64_t G = H / KVH, chunks = std::max<int64_t>(1, (Lk + CHUNK - 1) / CHUNK);
  at::Tensor out = at::empty({B, H, D}, q.options());
  at::Tensor part_acc = at::empty({B, KVH, chunks, G, D}, q.options());
  at::Tensor part_ml = at::empty({B, KVH, chunks, G, 2}, q.options());
  AttnArgs a{q.data_ptr<float>(), cache.data_ptr<float>(), kv_index.data_ptr<int64_t>(),
             seq_lens.data_ptr<int64_t>(), B, H, KVH, D, Lk, 2 * KVH * D, cache.size(1) * 2 * KVH * D, layer,
             (float)scale, part_acc.data_ptr<float>(), part_ml.data_ptr<float>(), chunks};
  const int64_t* lens = a.seq_lens;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= Lk, "tandem.decode_attention: seq_lens[", b, "] out of [1, ", Lk, "]");
  Isa isa = resolve_isa(isa_req);
  auto chunk_fn = isa == kAvx512 ? avx512::attend_chunk : isa == kAvx2 ? avx2::attend_chunk : scalar::attend_chunk;
  auto merge_fn = isa == kAvx512 ? avx512::merge : isa == kAvx2 ? avx2::merge : scalar::merge;
  at::parallel_for(0, B * KVH * chunks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores((size_t)G * TILE);
    for (int64_t t = t0; t < t1; ++t) chunk_fn(a, t / (KVH * chunks), t / chunks % KVH, t % chunks, scores.data());
  });
  float* o = out.data_ptr<float>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) merge_fn(a, t / KVH, t % KVH, o);
  });
  return out;
}

}  // namespace tandem
