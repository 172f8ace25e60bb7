// The decode op's tasks as its sibling ops run them too (decode_attention.cpp defines them): causal_attention.cpp
// attends a prompt's tokens as decode rows, and shared_prefix_attention.cpp plans the shared-prefix tasks. Their
// invariants are decode_attention.cpp's header's and decode_attention_task.inc's.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "attention_sink.h"
#include "vec.h"

namespace tandem {

constexpr int64_t TILE = 64;         // keys scored before their values are accumulated (the extend op's block)
constexpr int64_t PREFETCH = 32;     // keys ahead whose K and V rows are prefetched (into L2: measured faster than L1)
constexpr int64_t MAX_SHARED_ROWS = 32;    // the most rows a task carries (attend's arrays)
constexpr int64_t SHARED_PREFIX_ROWS = 8;  // rows of a shared-prefix task (more are split over several: their
                                           // states and queries stay within L1 / L2)

struct AttnArgs {
  const float* q; const void* cache; const int64_t* kv_index; const int64_t* seq_lens;   // cache: float/bf16/fp16
  int64_t B, H, KVH, D, Lk, layer_stride, slot_stride, layer;  // strides in cache elements: L 2 KVH row_elems
  float scale;
  int64_t q_stride;                                             // floats from row b's [H, D] queries to b + 1's
  const float* sinks = nullptr;                                 // [H] attention sinks (attention_sink.h), or none
};

// Query rows (decode rows, or a prompt's tokens: causal_attention.cpp): row b attends keys [start[b], lens[b]) of
// kv_index row srow[b], in chunks of chunk[b] keys at absolute positions, [first[b], first[b + 1]) in the partials.
struct Queries {
  std::vector<int64_t> start, lens, srow, chunk, first;
  Queries slice(int64_t b0, int64_t b1) const {      // rows [b0, b1), renumbered from 0
    auto cut = [&](const std::vector<int64_t>& v) { return std::vector<int64_t>(v.begin() + b0, v.begin() + b1); };
    Queries s{cut(start), cut(lens), cut(srow), cut(chunk), {}};
    for (int64_t b = b0; b <= b1; ++b) s.first.push_back(first[b] - first[b0]);
    return s;
  }
};

struct Task {                              // rows members[m0, m0 + R), which read kv_index row srow,
  int64_t m0, R, srow;                      // for KV heads [h0, h1) (h1 0: every head)
  int64_t h0 = 0, h1 = 0;
};

// Member m (a query row of a task) attends keys [lo[m], hi[m]), its row's chunk ord[m] (counted from its first).
struct Plan {
  std::vector<Task> tasks;                   // shared tasks first, then one-row tasks in row order
  std::vector<int64_t> members, lo, hi, ord;
  std::vector<int64_t> shared;               // per row: its chunks [0, shared[b]) are in shared tasks
  bool any_shared = false;
  int64_t head_groups = 1;                   // tasks a row's chunk is split into by KV heads (split_heads)
  void add(int64_t b, int64_t k0, int64_t k1, int64_t j) {
    members.push_back(b), lo.push_back(k0), hi.push_back(k1), ord.push_back(j);
  }
};

struct Scratch;   // a thread's working memory for attend (decode_attention.cpp)
using AttendFn = void (*)(const AttnArgs&, const int64_t*, int64_t, const int64_t*, const int64_t*, const int64_t*,
                         float* const*, float* const*, Scratch&, int64_t, int64_t);
using MergeFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, int64_t, const float*, float*);

// The cache's checks (shape, dtype, layer) for an op over head size D.
void check_cache(const at::Tensor& cache, int64_t layer, int64_t D);
// The task body for the ISA, the cache's dtype and the bf16-products option (decode_attention.cpp).
AttendFn pick_attend(Isa isa, at::ScalarType kv, bool bf16, int64_t D);
// Each body's merge of a split row's chunks (decode_attention.cpp's scalar one, decode_attention_simd.inc's).
namespace scalar {
void merge_head(const float* acc, int64_t as, const float* ml, int64_t ms, int64_t n, int64_t D, const float* sink,
                float* out);
}  // namespace scalar
namespace avx2 {
TANDEM_KERNEL_AVX2 void merge_head(const float* acc, int64_t as, const float* ml, int64_t ms, int64_t n, int64_t D,
                                   const float* sink, float* out);
}  // namespace avx2
namespace avx512 {
TANDEM_KERNEL_AVX512 void merge_head(const float* acc, int64_t as, const float* ml, int64_t ms, int64_t n, int64_t D,
                                     const float* sink, float* out);
}  // namespace avx512
// A body's merge_head (its own numbers: fused products on AVX2 and AVX-512, as causal_gemm_simd.inc's fold).
inline MergeFn merge_for(Isa isa) {
  return TANDEM_BODY(isa, merge_head);
}
// Runs a plan's tasks over query rows qs (their chunks set by chunk_rows) into out rows H * D apart.
void run_plan(const AttnArgs& a, const Queries& qs, const Plan& plan, AttendFn attend, MergeFn merge_head, float* o);
void chunk_rows(Queries& qs, int64_t chunk_keys, int64_t Lk);

// shared_prefix_attention.cpp: its switch, and the shared tasks of a decode call's rows.
extern std::atomic<bool> g_shared_prefix __attribute__((visibility("hidden")));
inline bool shared_prefix_on() { return g_shared_prefix.load(std::memory_order_relaxed); }
void plan_shared(const AttnArgs& a, const Queries& qs, Plan& plan);

}  // namespace tandem
