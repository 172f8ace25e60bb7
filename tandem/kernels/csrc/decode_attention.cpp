// Paged decode attention: one query token per row, reading K/V in place from the paged cache.
//
//   q        fp32 [B, H, D]                 this step's queries (after RoPE)
//   cache    fp32 [S + 1, L, 2, KVH, D]     every slot holds all layers' K (index 0) and V (index 1)
//   kv_index int64 [B, Lk]                  slot of each key position (only the first seq_lens[b] are read)
//   seq_lens int64 [B]                      keys per row (>= 1)
//   window   int                            > 0: a sliding-window layer, the row's query sees only its last
//                                           `window` keys, positions [max(0, seq_len - window), seq_len)
//                                           (those earlier are never read: a local layer's cost is bounded by W)
//   out      fp32 [B, H, D]                 softmax(q k^T * scale) v over the row's keys
//
// decode_attention_qkv_ is the step's whole attention in one call (issue 17: per layer it replaced two
// index_put writes, a split, three views, a contiguous copy of q and a reshape, ~25 dispatched torch ops):
//   qkv      fp32 [B, (H + 2 KVH) D]        this step's fused projection after RoPE (rows may be strided)
//   loc      int64 [B]                      slot of each row's new token: its K and V are written there first
//   out      fp32 [B, H D]
//
// One task holds every query head of a row: the G = H / KVH heads of a KV head share each K and V row read,
// and a slot's K and V for every KV head (one contiguous [2, KVH, D] run per layer) are read once.
// Thread split: at::parallel_for over tasks (row, chunk of its keys). A task keeps per query head a running
// max, a sum of exponentials and an unnormalized output over its keys (flash-decoding). A row whose keys are
// one chunk writes its normalized output at once; otherwise each chunk leaves its partial [H, D] and (max,
// sum) per head, and the task that finishes a row's last chunk merges them in chunk order with their
// log-sum-exp weights. So batch 1 at a long context spreads over every thread, and no key is copied.
// Batch invariance: a row's chunk size is a function of its own key count only (about 16 chunks, at least
// MIN_CHUNK keys, whole tiles), so its summation order never depends on the other rows of the batch or the
// thread count. The int8-activation linears round x to integers, which turns any last-bit difference into a
// visible one; with this, a row's output is the same in any batch (the overlap loop's riding rows, a
// speculative verify step, another loop) and under any device_threads. (The old policy sized chunks from B
// and the thread count; fixed 64-key chunks cost batch 1 at 2k context ~1.4 ms a step in merges.)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace tandem {

constexpr int64_t TILE = 32;         // keys scored before their values are accumulated (a multiple of every W)
constexpr int64_t MIN_CHUNK = 64;    // fewest keys of a split chunk (the batch-invariant split, above)
constexpr int64_t ROW_CHUNKS = 16;   // chunks a long row is split into

// Keys per chunk of a row of n keys: ~n / ROW_CHUNKS, at least MIN_CHUNK, in whole tiles.
static int64_t row_chunk(int64_t n) {
  const int64_t c = std::max(MIN_CHUNK, (n + ROW_CHUNKS - 1) / ROW_CHUNKS);
  return (c + TILE - 1) / TILE * TILE;
}
constexpr int64_t PREFETCH = 32;     // keys ahead whose K and V rows are prefetched (into L2: measured faster than L1)

struct AttnArgs {
  const float* q; const float* cache; const int64_t* kv_index; const int64_t* seq_lens;
  int64_t B, H, KVH, D, Lk, layer_stride, slot_stride, layer;  // slot_stride = L * 2 * KVH * D
  float scale;
  int64_t q_stride;                                             // floats from row b's [H, D] queries to b + 1's
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
static float max_of(const float* s, int64_t n) {
  float m = s[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
  return m;
}
static float exp_sum(float* s, int64_t n, float mx) {             // s[j] = exp(s[j] - mx); their sum
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
  return sum;
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

// out[i] = sum_c exp(m_c - M) acc_c[i] / sum_c exp(m_c - M) l_c over a row's n chunks, M = max_c m_c, for
// the H query heads. acc: [n, H, D] and ml: [n, H, 2] (the row's chunks); out: [H, D].
static void merge(const float* acc, const float* ml, int64_t n, int64_t H, int64_t D, float* out) {
  for (int64_t i = 0; i < H; ++i) {
    float mx = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t c = 0; c < n; ++c) mx = std::max(mx, ml[(c * H + i) * 2]);
    float* o = out + i * D;
    std::fill(o, o + D, 0.f);
    for (int64_t c = 0; c < n; ++c) {
      const float w = std::exp(ml[(c * H + i) * 2] - mx);
      total += w * ml[(c * H + i) * 2 + 1];
      const float* p = acc + (c * H + i) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += w * p[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= total;
  }
}

static void check_cache(const at::Tensor& cache, int64_t layer, int64_t D) {
  TORCH_CHECK(cache.dim() == 5 && cache.scalar_type() == at::kFloat && cache.is_contiguous() && cache.size(2) == 2,
              "tandem.decode_attention: cache must be a contiguous fp32 [S + 1, L, 2, KVH, D] tensor");
  TORCH_CHECK(cache.size(4) == D, "tandem.decode_attention: head shapes do not match");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "tandem.decode_attention: layer out of range");
}

// Attends every row of a (q set by the caller) into out [B, H, D] (rows H * D apart).
// chunk_keys: keys per chunk; -1 row_chunk (see the top of the file), 0 never splits, > 0 forces that size
// (rounded up to whole tiles; for tests).
static void attend_rows(const AttnArgs& a, float* o, int64_t isa_req, int64_t chunk_keys, int64_t window) {
  const int64_t B = a.B, H = a.H, D = a.D, Lk = a.Lk;
  const int64_t* lens = a.seq_lens;
  TORCH_CHECK(window >= 0, "tandem.decode_attention: window must be >= 0");
  std::vector<int64_t> start(B, 0), keys(B);            // row b attends keys [start[b], lens[b])
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= Lk, "tandem.decode_attention: seq_lens[", b, "] out of [1, ", Lk, "]");
    if (window > 0) start[b] = std::max<int64_t>(0, lens[b] - window);
    keys[b] = lens[b] - start[b];
  }
  // Row b's chunks of chunk[b] keys are tasks [first[b], first[b + 1]).
  std::vector<int64_t> first(B + 1, 0), row_of, chunk(B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t c = chunk_keys > 0 ? chunk_keys : chunk_keys == 0 ? Lk : row_chunk(keys[b]);
    chunk[b] = (c + TILE - 1) / TILE * TILE;
    first[b + 1] = first[b] + (keys[b] + chunk[b] - 1) / chunk[b];
    row_of.resize(first[b + 1], b);
  }
  const int64_t chunks = first[B];
  std::vector<float> part_acc, part_ml;                  // [chunks, H, D], [chunks, H, 2]
  if (chunks > B) {
    part_acc.resize((size_t)chunks * H * D);
    part_ml.resize((size_t)chunks * H * 2);
  }
  std::vector<std::atomic<int64_t>> pending(B);         // a row's chunks not yet done
  for (int64_t b = 0; b < B; ++b) pending[b].store(first[b + 1] - first[b], std::memory_order_relaxed);
  const Isa isa = resolve_isa(isa_req);
  auto attend = isa == kAvx512 ? avx512::attend : isa == kAvx2 ? avx2::attend : scalar::attend;
  float* pacc = part_acc.data();
  float* pml = part_ml.data();
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> scratch((size_t)H * (D + TILE + 2));
    float* ml_own = scratch.data() + H * (D + TILE);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t b = row_of[c], n = first[b + 1] - first[b];
      const int64_t k0 = start[b] + (c - first[b]) * chunk[b], k1 = std::min(k0 + chunk[b], lens[b]);
      float* orow = o + b * H * D;
      if (n == 1) {                                      // unsplit: normalize in place
        attend(a, b, k0, k1, orow, ml_own, scratch.data());
        for (int64_t i = 0; i < H; ++i)
          for (int64_t d = 0; d < D; ++d) orow[i * D + d] /= ml_own[2 * i + 1];
        continue;
      }
      attend(a, b, k0, k1, pacc + c * H * D, pml + c * H * 2, scratch.data());
      if (pending[b].fetch_sub(1, std::memory_order_acq_rel) == 1)      // the row's last chunk: merge
        merge(pacc + first[b] * H * D, pml + first[b] * H * 2, n, H, D, orow);
    }
  });
}

static at::Tensor as_long(const at::Tensor& t) {        // no dispatch when it already is (the engine's case)
  return t.scalar_type() == at::kLong && t.is_contiguous() ? t : t.to(at::kLong).contiguous();
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& kv_index_in, const at::Tensor& seq_lens_in, double scale,
                            int64_t isa_req, int64_t chunk_keys, int64_t window) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "tandem.decode_attention: q must be fp32 [B, H, D]");
  at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  at::Tensor kv_index = as_long(kv_index_in), seq_lens = as_long(seq_lens_in);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_cache(cache, layer, D);
  const int64_t KVH = cache.size(3), Lk = kv_index.size(1);
  TORCH_CHECK(H % KVH == 0, "tandem.decode_attention: head shapes do not match");
  TORCH_CHECK(kv_index.size(0) == B && seq_lens.size(0) == B, "tandem.decode_attention: batch sizes differ");
  const AttnArgs a{q.data_ptr<float>(), cache.data_ptr<float>(), kv_index.data_ptr<int64_t>(),
                   seq_lens.data_ptr<int64_t>(), B, H, KVH, D, Lk, 2 * KVH * D, cache.size(1) * 2 * KVH * D, layer,
                   (float)scale, B > 1 ? q.stride(0) : H * D};
  at::Tensor out = at::empty({B, H, D}, q.options());
  attend_rows(a, out.data_ptr<float>(), isa_req, chunk_keys, window);
  return out;
}

at::Tensor decode_attention_qkv_(const at::Tensor& qkv, const at::Tensor& cache, int64_t layer,
                                 const at::Tensor& loc_in, const at::Tensor& kv_index_in,
                                 const at::Tensor& seq_lens_in, double scale, int64_t H, int64_t isa_req,
                                 int64_t chunk_keys, int64_t window) {
  TORCH_CHECK(cache.dim() == 5, "tandem.decode_attention_qkv_: cache must be [S + 1, L, 2, KVH, D]");
  const int64_t KVH = cache.size(3), D = cache.size(4), B = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 &&
                  qkv.size(1) == (H + 2 * KVH) * D && H % KVH == 0,
              "tandem.decode_attention_qkv_: qkv must be fp32 [B, (H + 2 KVH) D] with contiguous rows");
  check_cache(cache, layer, D);
  at::Tensor loc = as_long(loc_in), kv_index = as_long(kv_index_in), seq_lens = as_long(seq_lens_in);
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == B && kv_index.size(0) == B && seq_lens.size(0) == B,
              "tandem.decode_attention_qkv_: batch sizes differ");
  const int64_t S = cache.size(0), slot_stride = cache.size(1) * 2 * KVH * D, rs = qkv.stride(0);
  const float* src = qkv.data_ptr<float>();
  float* dst = cache.data_ptr<float>() + layer * 2 * KVH * D;
  const int64_t* l = loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {            // the row's K then V: one contiguous run in qkv and in the slot
    TORCH_CHECK(l[b] >= 0 && l[b] < S, "tandem.decode_attention_qkv_: out_cache_loc[", b, "] out of range");
    std::copy_n(src + b * rs + H * D, 2 * KVH * D, dst + l[b] * slot_stride);
  }
  const AttnArgs a{src, cache.data_ptr<float>(), kv_index.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                   B, H, KVH, D, kv_index.size(1), 2 * KVH * D, slot_stride, layer, (float)scale, rs};
  at::Tensor out = at::empty({B, H * D}, qkv.options());
  attend_rows(a, out.data_ptr<float>(), isa_req, chunk_keys, window);
  return out;
}

}  // namespace tandem
