// Paged extend (prefill) attention: a step's new tokens, many per row, each attending its row's keys up to its
// own position, read in place from the paged cache.
//
//   q         fp32 [T, H, D]            the step's queries after RoPE (token rows may be strided: a view of qkv)
//   cache     [S + 1, L, 2, KVH, D]     as decode_attention's: fp32, bf16 or fp16, widened to fp32 as read; or
//                                       q8_0, uint8 [S + 1, L, 2, KVH, D / 32 * 34] (kv_q8.h), widened exactly
//   kv_index  int64 [B, Lk]             slot of each key position of each row
//   tok_row   int64 [T]                 row of each token; a row's tokens are consecutive in T
//   positions int64 [T]                 each token's key position p: it attends its row's keys [lo, p], lo = 0 or,
//                                       with window > 0, max(0, p + 1 - window) (a sliding-window layer)
//   sinks     fp32 [H] or None          attention sinks (gpt-oss, attention_sink.h): a logit per query head in
//                                       every token's softmax, folded into each column's final (max, sum)
//   out       fp32 [T, H D]
// The same function as decode_attention(q, cache, layer, kv_index[tok_row], positions + 1) (the reference in
// tests), up to fp32 summation order. Every step's K/V must already be in the cache (the caller writes them).
//
// Why: the SDPA path gathered the step's keys into a padded [B, Lk, KVH, D] copy, widened it and ran ATen's flash
// attention with a bool mask, whose GEMMs are MKL's; on an AMD EPYC (Zen, AVX-512) MKL takes its AVX2 path
// (sgemm at ~194 GFLOP/s where oneDNN's bf16 GEMM does 834), and the long-prompt workload spent 12.8 s of 29 in
// SDPA and 1.8 s in the gather (benchmarks/extend_attention.py has the op-level comparison).
//
// Work: tasks of (a run of up to QROWS / G tokens of one row, one KV head), longest first from one counter. A task
// holds its queries transposed and visits its keys in blocks of NK: each block's K and V rows are widened once into
// fp32 scratch for all the task's query rows (G heads x its tokens), its scores and output update are small GEMMs
// (extend_attention_simd.inc), with the online softmax of flash attention between them. Blocks past a task's last
// token are never read (causal), nor, with a window, blocks before its first token's window.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "attention_sink.h"
#include "kv_q8.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

bool cpu_has_bf16();

namespace {

constexpr int64_t NK = 64;        // keys a block
constexpr int64_t QROWS = 192;    // most query rows (tokens x the G heads of a KV head) of a task, when G <= QROWS

struct ExtArgs {
  const float* q; int64_t q_stride;                  // floats from token t's [H, D] queries to t + 1's
  const void* cache; int64_t slot_stride, layer_off;  // in cache elements: L 2 KVH E; layer 2 KVH E (E: a head row)
  const int64_t* kv_index; int64_t Lk;
  const int64_t* tok_row; const int64_t* pos;
  int64_t H, KVH, D, window;
  float scale;
  float* out;                                        // [T, H D]
  const float* sinks;                                // [H] attention sinks (attention_sink.h), or nullptr
};

struct ExtTask { int64_t t0, n, g, cost; };          // tokens [t0, t0 + n) of one row, KV head g

// Floats of scratch a task of up to `nqp` columns needs (extend_task's layout) plus its two int64 arrays.
int64_t scratch_floats(int64_t nqp, int64_t D) { return 2 * D * nqp + NK * nqp + 2 * NK * D + 4 * nqp + 4 * nqp; }

namespace scalar {
// The plain body (CPUs without AVX2): per token and head, the scores of its keys, then their softmax and values.
template <typename T>
void extend_task(const ExtArgs& a, const ExtTask& t, float* scratch) {
  const int64_t G = a.H / a.KVH, D = a.D, hs = row_elems<T>(D);
  const T* cache = static_cast<const T*>(a.cache) + a.layer_off + t.g * hs;
  const int64_t* slots = a.kv_index + a.tok_row[t.t0] * a.Lk;
  for (int64_t i = t.t0; i < t.t0 + t.n; ++i) {
    const int64_t p = a.pos[i], first = a.window > 0 ? std::max<int64_t>(0, p + 1 - a.window) : 0;
    for (int64_t h = 0; h < G; ++h) {
      const float* q = a.q + i * a.q_stride + (t.g * G + h) * D;
      float* o = a.out + i * a.H * D + (t.g * G + h) * D;
      float* s = scratch;                            // [p + 1 - first] scores
      float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
      for (int64_t j = first; j <= p; ++j) {
        const T* k = cache + slots[j] * a.slot_stride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += q[d] * elem(k, d);
        s[j - first] = dot * a.scale;
        m = std::max(m, s[j - first]);
      }
      std::fill(o, o + D, 0.f);
      for (int64_t j = first; j <= p; ++j) {
        const float w = std::exp(s[j - first] - m);
        sum += w;
        const T* v = cache + slots[j] * a.slot_stride + a.KVH * hs;
        for (int64_t d = 0; d < D; ++d) o[d] += w * elem(v, d);
      }
      const float a_sink = a.sinks ? fold_sink(m, sum, a.sinks[t.g * G + h]) : 1.f;
      for (int64_t d = 0; d < D; ++d) o[d] = a.sinks ? o[d] * a_sink / sum : o[d] / sum;
    }
  }
}
}  // namespace scalar

#define TANDEM_SIMD_BODY "extend_attention_simd.inc"      // AVX-512: with extend_attention_bf16.inc's task
#include "simd_namespaces.inc"

using TaskFn = void (*)(const ExtArgs&, const ExtTask&, float*);
template <typename T>
TaskFn task_for(Isa isa) {
  return TANDEM_BODY(isa, extend_task<T>);
}

}  // namespace

at::Tensor extend_attention(const at::Tensor& q_in, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& kv_index_in, const at::Tensor& tok_row_in,
                            const at::Tensor& positions_in, double scale, int64_t window, int64_t isa_req,
                            bool bf16_products, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "tandem.extend_attention: q must be fp32 [T, H, D]");
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const auto dt = cache.scalar_type();
  const bool q8 = dt == at::kByte;                    // q8_0 (kv_q8.h): a head's row is D / 32 blocks
  TORCH_CHECK(cache.dim() == 5 && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || q8) &&
                  cache.is_contiguous() && cache.size(2) == 2 &&
                  (q8 ? D % Q8_BLOCK == 0 && cache.size(4) == row_elems<KvQ8>(D) : cache.size(4) == D),
              "tandem.extend_attention: cache must be a contiguous fp32/bf16/fp16 [S + 1, L, 2, KVH, D] tensor "
              "or a q8_0 one, uint8 [S + 1, L, 2, KVH, D / 32 * 34]");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "tandem.extend_attention: layer out of range");
  const int64_t KVH = cache.size(3), S = cache.size(0);
  TORCH_CHECK(H % KVH == 0, "tandem.extend_attention: heads must be a multiple of the KV heads");
  TORCH_CHECK(window >= 0, "tandem.extend_attention: window must be >= 0");
  const at::Tensor kv_index = as_long(kv_index_in), tok_row = as_long(tok_row_in), pos = as_long(positions_in);
  TORCH_CHECK(kv_index.dim() == 2 && tok_row.dim() == 1 && pos.dim() == 1 && tok_row.size(0) == T &&
                  pos.size(0) == T,
              "tandem.extend_attention: kv_index must be [B, Lk], tok_row and positions [T]");
  const int64_t B = kv_index.size(0), Lk = kv_index.size(1);
  const int64_t* rows = tok_row.data_ptr<int64_t>();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t* idx = kv_index.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(rows[t] >= 0 && rows[t] < B, "tandem.extend_attention: tok_row[", t, "] out of range");
    TORCH_CHECK(p[t] >= 0 && p[t] < Lk, "tandem.extend_attention: positions[", t, "] out of [0, ", Lk, ")");
  }
  // Every slot a token reads (its row's keys up to its position) must lie in the cache.
  std::vector<int64_t> row_end(B, 0);
  for (int64_t t = 0; t < T; ++t) row_end[rows[t]] = std::max(row_end[rows[t]], p[t] + 1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < row_end[b]; ++j)
      TORCH_CHECK(idx[b * Lk + j] >= 0 && idx[b * Lk + j] < S, "tandem.extend_attention: kv_index[", b, ", ", j,
                  "] out of range");
  at::Tensor out = at::empty({T, H * D}, q.options());
  if (T == 0) return out;
  const int64_t G = H / KVH, per_task = std::max<int64_t>(1, QROWS / G);
  std::vector<ExtTask> tasks;
  for (int64_t t = 0; t < T;) {            // a row's run of consecutive tokens, cut into even parts of <= per_task
    int64_t e = t + 1;
    while (e < T && rows[e] == rows[t]) ++e;
    const int64_t parts = (e - t + per_task - 1) / per_task, size = (e - t + parts - 1) / parts;
    for (int64_t s = t; s < e; s += size) {
      const int64_t n = std::min(size, e - s);
      int64_t keys = 0;
      for (int64_t i = s; i < s + n; ++i) keys = std::max(keys, p[i] + 1);
      if (window > 0) keys = std::min(keys, window + n);
      for (int64_t g = 0; g < KVH; ++g) tasks.push_back({s, n, g, n * keys});
    }
    t = e;
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const ExtTask& x, const ExtTask& y) { return x.cost > y.cost; });
  const Isa isa = resolve_isa(isa_req);
  // bf16 products (a bf16 cache on a CPU with AVX512-BF16, head_dim a multiple of 16); else the fp32 task
  const bool dp = bf16_products && dt == at::kBFloat16 && isa == kAvx512 && cpu_has_bf16() && D % 16 == 0;
  const TaskFn fn = dp                  ? avx512::extend_task_bf16
                    : dt == at::kBFloat16 ? task_for<c10::BFloat16>(isa)
                    : dt == at::kHalf   ? task_for<c10::Half>(isa)
                    : q8                ? task_for<KvQ8>(isa)
                                        : task_for<float>(isa);
  const int64_t E = cache.size(4);
  const ExtArgs a{q.data_ptr<float>(), T > 1 ? q.stride(0) : H * D, cache.data_ptr(), cache.size(1) * 2 * KVH * E,
                  layer * 2 * KVH * E, idx, Lk, rows, p, H, KVH, D, window, (float)scale, out.data_ptr<float>(),
                  sink_data(sinks, H, "tandem.extend_attention")};
  const int64_t max_cols = (per_task * G + 15) / 16 * 16;         // a task holds <= per_task tokens
  const int64_t max_keys = *std::max_element(row_end.begin(), row_end.end());
  const size_t floats = (size_t)std::max({scratch_floats(max_cols, D), avx512::scratch_floats_bf16(max_cols, D),
                                          max_keys});   // the scalar body: scores
  const int64_t ntasks = (int64_t)tasks.size();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), ntasks), 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> scratch(new float[floats]);    // every part is written before it is read: no zeroing
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) fn(a, tasks[t], scratch.get());
  });
  return out;
}

}  // namespace tandem
