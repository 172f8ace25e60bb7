// Paged decode attention: one query token per row, reading K/V in place from the paged cache.
//
//   q        fp32 [B, H, D]                 this step's queries (after RoPE)
//   cache    [S + 1, L, 2, KVH, D]          every slot holds all layers' K (index 0) and V (index 1); fp32, bf16
//                                           or fp16 (kv_cache_dtype): K/V rows are widened to fp32 as they are
//                                           read, and every sum is fp32 whatever the cache holds; or q8_0: uint8
//                                           [S + 1, L, 2, KVH, D / 32 * 34], blocks of kv_q8.h, widened exactly
//   kv_index int64 [B, Lk]                  slot of each key position (only the first seq_lens[b] are read)
//   seq_lens int64 [B]                      keys per row (>= 1)
//   window   int                            > 0: a sliding-window layer, the row's query sees only its last
//                                           `window` keys, positions [max(0, seq_len - window), seq_len)
//                                           (those earlier are never read: a local layer's cost is bounded by W)
//   out      fp32 [B, H, D]                 softmax(q k^T * scale) v over the row's keys
//   bf16_products                           bf16 cache, AVX512-BF16, D % 32 == 0: the scores and the values as
//                                           vdpbf16ps on bf16 pairs (decode_attention_bf16.inc; the engine's
//                                           decode_attention option); elsewhere ignored (the fp32 products)
//   sinks    fp32 [H] or None               attention sinks (gpt-oss): a logit per query head joining every
//                                           row's softmax as a key with no value, folded into each head's final
//                                           state (attention_sink.h); None: the op as without them, bit for bit
//
// decode_attention_qkv_ is the step's whole attention in one call (issue 17: per layer it replaced two
// index_put writes, a split, three views, a contiguous copy of q and a reshape, ~25 dispatched torch ops):
//   qkv      fp32 [B, (H + 2 KVH) D]        this step's fused projection after RoPE (rows may be strided)
//   loc      int64 [B]                      slot of each row's new token: its K and V are written there first
//                                           (rounded to the cache's dtype as torch rounds them: c10's
//                                           round-to-nearest-even, so a slot holds the same bits whichever path
//                                           wrote it, and the row's own key is read back rounded, as every other)
//   out      fp32 [B, H D]
//
// Scores of a tile: W keys at a time in registers of W / 4 keys x 4 elements, four fma chains a score
// (decode_attention_simd.inc's score_block: the order the causal op's GEMM form runs at the extend op's cost);
// values: 4 registers of the output held across the tile; a K or V row is loaded (and widened) once for every
// query head of its KV head, and in a shared-prefix task for those of every row (score_block / value_block,
// each score and output element the same bits as one query at a time).
// One task holds every query head of a row: the G = H / KVH heads of a KV head share each K and V row read,
// and a slot's K and V for every KV head (one contiguous [2, KVH, D] run per layer) are read once.
// Thread split: over tasks (row, chunk of its keys; or up to MAX_SHARED_ROWS rows' same chunk of shared slots,
// attended together: shared_prefix_attention.cpp), by count or from one counter (attend_rows). A task keeps per
// query head a running max, a sum of exponentials and an unnormalized output over its keys (flash-decoding). A
// row whose keys are one chunk writes its normalized output at once; otherwise each chunk leaves its partial
// [H, D] and (max, sum) per head, and the task that finishes a row's last chunk folds them in chunk order
// (merge_head). So batch 1 at a long context spreads over every thread, and no key is copied.
// Batch invariance: a row's chunk size is a function of its own key count only (about 16 chunks, at least
// MIN_CHUNK keys, whole tiles), and its chunks and tiles lie at absolute key positions (a sliding window's first
// ones begin part-way, the keys before its start scored -inf), so its summation order never depends on the
// other rows of the batch or the thread count (nor does split_heads' split of a row's KV heads over tasks);
// causal_attention.cpp gives a prompt's tokens these same bits. The int8-activation linears round x to integers,
// which turns any last-bit difference into a visible one; with this, a row's output is the same in any batch
// (the overlap loop's riding rows, a speculative verify step, another loop) and under any device_threads. (The
// old policy sized chunks from B and the thread count; fixed 64-key chunks cost batch 1 at 2k context ~1.4 ms a
// step in merges.) MIN_CHUNK 256, not 64: every chunk of a task costs its queries' setup, the (max, sum, output)
// state and a merge, and a last part-tile; measured (benchmarks/decode_attention_chunks.py, 2 threads, bf16
// cache; results/decode_attention_chunks.md): 256 takes 0.82-0.95x the time of 64 on every batch there (64 rows of ~160
// keys, 32 rows on a 930-key shared prefix, 16 rows of 300-900, 8 of 3,000, batch 1 at 500 and 2,000), on the
// AVX2 and the AVX-512 bodies; 128 lies between. A shared prefix now shares in 256-key chunks: prefixes
// shorter than that are read once a row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "decode_attention.h"
#include "kv_q8.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

bool cpu_has_bf16();

constexpr int64_t MIN_CHUNK = 256;   // fewest keys of a split chunk (the batch-invariant split, above)
constexpr int64_t ROW_CHUNKS = 16;   // chunks a long row is split into

// Keys per chunk of a row of n keys: ~n / ROW_CHUNKS, at least MIN_CHUNK, in whole tiles.
static int64_t row_chunk(int64_t n) {
  const int64_t c = std::max(MIN_CHUNK, (n + ROW_CHUNKS - 1) / ROW_CHUNKS);
  return (c + TILE - 1) / TILE * TILE;
}

// A thread's working memory for attend (decode_attention_task.inc) over tasks of up to R rows.
struct Scratch {
  std::vector<float> f;                                  // queries [R, H, D], scores [R, H, TILE], ml_own
  std::vector<const float*> in;                          // per KV head: R G query (then probability) rows
  std::vector<float*> out;                               // and their score (then output) rows
  std::vector<uint16_t> qb;                              // bf16 products: the queries [R, H, D] in bf16
  std::vector<const uint16_t*> inb;                      // and per KV head its R G rows of them
  std::vector<uint32_t> pb;                              // and a tile's probabilities [R, H, TILE / 2] in bf16 pairs
  std::vector<const uint32_t*> inp;                      // and per KV head its R G rows of them
  float* ml_own;                                         // [R, H, 2] unsplit rows' (max, sum)
  Scratch(int64_t R, int64_t H, int64_t D)
      : f((size_t)(R * H * (D + TILE) + 2 * R * H)), in((size_t)(R * H)), out((size_t)(R * H)), qb((size_t)(R * H * D)),
        inb((size_t)(R * H)), pb((size_t)(R * H * TILE / 2)), inp((size_t)(R * H)),
        ml_own(f.data() + R * H * (D + TILE)) {}
};

namespace scalar {
template <typename T>
static void axpy(float* y, float a, const T* x, int64_t n) {   // y += a * x
  for (int64_t i = 0; i < n; ++i) y[i] += a * elem(x, i);
}
static void scale_(float* y, float a, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}
static float max_of(const float* s, int64_t n) {
  float m = s[0];
  for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
  return m;
}
static float exp1(float x) { return std::exp(x); }              // the scalar body's exp (the SIMD ones: V::exp)
static float exp_sum(float* s, int64_t n, float mx) {             // s[j] = exp(s[j] - mx); their sum
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) { s[i] = std::exp(s[i] - mx); sum += s[i]; }
  return sum;
}
template <typename T>   // the scores' order (decode_attention_simd.inc: dot4), one score at a time
static float dot4(const float* a, const T* b, int64_t D) {
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t d = 0; d < D; ++d) c[d % 4] = std::fma(a[d], elem(b, d), c[d % 4]);
  return ((c[0] + c[1]) + c[2]) + c[3];
}
template <typename T>   // s[c][j] = q[c] . k[j] for nq queries and the n keys of a tile
static void score_block(const float* const* q, int64_t nq, const T* const* k, int64_t n, int64_t D, float* const* s) {
  for (int64_t c = 0; c < nq; ++c)
    for (int64_t j = 0; j < n; ++j) s[c][j] = dot4(q[c], k[j], D);
}
template <typename T>
static void value_block(float* const* acc, const float* const* p, int64_t nq, const T* const* v, int64_t n,
                        int64_t D) {                              // acc[c] += p[c][j] v[j] over the tile's keys
  for (int64_t c = 0; c < nq; ++c)
    for (int64_t j = 0; j < n; ++j) axpy(acc[c], p[c][j], v[j], D);
}
// merge_head (decode_attention_simd.inc's fold) in the scalar body's numbers: products rounded before each sum.
void merge_head(const float* acc, int64_t as, const float* ml, int64_t ms, int64_t n, int64_t D, const float* sink,
                float* out) {
  float M = ml[0], L = ml[1];
  std::copy(acc, acc + D, out);
  for (int64_t c = 1; c < n; ++c) {
    const float m = ml[c * ms], Mn = std::max(M, m);
    const float a = M == Mn ? 1.f : std::exp(M - Mn), b = m == Mn ? 1.f : std::exp(m - Mn);
    L = b * ml[c * ms + 1] + L * a;
    for (int64_t d = 0; d < D; ++d) out[d] = b * acc[c * as + d] + out[d] * a;
    M = Mn;
  }
  finish_head(out, 1, M, L, sink, D, out);
}
#include "decode_attention_task.inc"
}  // namespace scalar

#define TANDEM_SIMD_BODY "decode_attention_simd.inc"      // its helpers, then the task over them
#include "simd_namespaces.inc"

void check_cache(const at::Tensor& cache, int64_t layer, int64_t D) {
  const auto t = cache.scalar_type();
  TORCH_CHECK(cache.dim() == 5 && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kByte) &&
                  cache.is_contiguous() && cache.size(2) == 2,
              "tandem.decode_attention: cache must be a contiguous fp32/bf16/fp16 [S + 1, L, 2, KVH, D] tensor "
              "or a q8_0 one, uint8 [S + 1, L, 2, KVH, D / 32 * 34]");
  TORCH_CHECK(t == at::kByte ? D % Q8_BLOCK == 0 && cache.size(4) == row_elems<KvQ8>(D) : cache.size(4) == D,
              "tandem.decode_attention: head shapes do not match");
  TORCH_CHECK(layer >= 0 && layer < cache.size(1), "tandem.decode_attention: layer out of range");
}

template <typename T>
static AttendFn attend_for(Isa isa) {
  return TANDEM_BODY(isa, attend<T>);
}
// bf16: the bf16-products body (decode_attention_bf16.inc) where it runs: a bf16 cache, the AVX-512 body on a CPU
// with AVX512-BF16 and D % 32 == 0; elsewhere the fp32 helpers, bit for bit the op without it.
AttendFn pick_attend(Isa isa, at::ScalarType kv, bool bf16, int64_t D) {
  if (bf16 && kv == at::kBFloat16 && isa == kAvx512 && cpu_has_bf16() && D % 32 == 0)
    return avx512::attend<c10::BFloat16, true>;
  return kv == at::kBFloat16 ? attend_for<c10::BFloat16>(isa) : kv == at::kHalf ? attend_for<c10::Half>(isa)
         : kv == at::kByte ? attend_for<KvQ8>(isa) : attend_for<float>(isa);
}

// One-row tasks for every chunk not in a shared task: chunk j of row b is keys [j c, (j + 1) c) of its own
// [start, lens) (absolute positions, so a sliding window's first chunk and tile may begin mid-way).
static void plan_rest(const Queries& qs, Plan& plan) {
  for (int64_t b = 0; b < (int64_t)qs.lens.size(); ++b) {
    const int64_t c = qs.chunk[b], j0 = qs.start[b] / c, n = qs.first[b + 1] - qs.first[b];
    for (int64_t j = plan.shared.empty() ? 0 : plan.shared[b]; j < n; ++j) {
      plan.tasks.push_back({(int64_t)plan.members.size(), 1, qs.srow.empty() ? b : qs.srow[b]});
      plan.add(b, std::max(qs.start[b], (j0 + j) * c), std::min((j0 + j + 1) * c, qs.lens[b]), j);
    }
  }
}

// Runs a plan (decode_attention.h's Plan) over query rows q.lens / q.first (Queries) into out rows H * D
// apart. A task's R rows attend its chunk together, tile by tile (decode_attention_task.inc): the chunk's K and V
// come from memory once, each tile's K and V rows are widened once for all of them, and each row's outputs are
// the bits it gets alone. R is at most SHARED_PREFIX_ROWS (a prompt's tokens: causal_rows), so the rows' states
// stay in cache (a tile-by-tile order over all of a chunk's rows was 1.6x slower at 1,000 rows, whose states no
// longer fit); each thread's scratch holds the plan's widest task. A row's chunks that are split leave partials,
// merged in chunk order by the task finishing its last one.
// Without shared tasks parallel_for splits the tasks by count (a row's chunks stay with one thread). With them
// the threads take tasks in plan order from one counter until none is left: a shared task of R rows costs less
// than R one-row tasks over the same keys, so a split fixed in advance left one thread waiting (~15 % of a
// 32-row shared-prefix step's attention at 2 threads). Which thread runs a task never changes a bit.
void run_plan(const AttnArgs& a, const Queries& qs, const Plan& plan, AttendFn attend, MergeFn merge_head,
              float* o) {
  const int64_t B = (int64_t)qs.lens.size(), H = a.H, D = a.D;
  const std::vector<int64_t>& first = qs.first;
  const int64_t chunks = first[B];
  std::unique_ptr<float[]> part_acc, part_ml;          // [chunks, H, D], [chunks, H, 2]: each written before read
  if (chunks > B) {
    part_acc.reset(new float[(size_t)chunks * H * D]);
    part_ml.reset(new float[(size_t)chunks * H * 2]);
  }
  std::vector<std::atomic<int64_t>> pending(B);         // a row's chunks not yet done
  for (int64_t b = 0; b < B; ++b)
    pending[b].store((first[b + 1] - first[b]) * plan.head_groups, std::memory_order_relaxed);
  float* pacc = part_acc.get();
  float* pml = part_ml.get();
  auto run = [&](const Task& t, Scratch& scratch) {
    const int64_t* rows = plan.members.data() + t.m0;
    float* accs[MAX_SHARED_ROWS];
    float* mls[MAX_SHARED_ROWS];
    for (int64_t r = 0; r < t.R; ++r) {
      const int64_t b = rows[r], n = first[b + 1] - first[b];
      if (n == 1) {      // unsplit: its only chunk, so its output row holds the sums (mls: its own row of them)
        accs[r] = o + b * H * D;
        mls[r] = scratch.ml_own + r * H * 2;
      } else {
        accs[r] = pacc + (first[b] + plan.ord[t.m0 + r]) * H * D;
        mls[r] = pml + (first[b] + plan.ord[t.m0 + r]) * H * 2;
      }
    }
    const int64_t h1 = t.h1 ? t.h1 : a.KVH, G = H / a.KVH;
    attend(a, rows, t.R, a.kv_index + t.srow * a.Lk, plan.lo.data() + t.m0, plan.hi.data() + t.m0, accs, mls,
           scratch, t.h0, h1);
    for (int64_t r = 0; r < t.R; ++r) {
      const int64_t b = rows[r], n = first[b + 1] - first[b];
      float* orow = o + b * H * D;
      if (n == 1) {                                      // its heads' outputs; a head split's other tasks the rest
        for (int64_t i = t.h0 * G; i < h1 * G; ++i)
          finish_head(orow + i * D, 1, mls[r][2 * i], mls[r][2 * i + 1], a.sinks ? a.sinks + i : nullptr, D,
                      orow + i * D);
      } else if (pending[b].fetch_sub(1, std::memory_order_acq_rel) == 1) {   // the row's last chunk: merge
        for (int64_t i = 0; i < H; ++i)
          merge_head(pacc + first[b] * H * D + i * D, H * D, pml + first[b] * H * 2 + i * 2, H * 2, n, D,
                     a.sinks ? a.sinks + i : nullptr, orow + i * D);
      }
    }
  };
  const int64_t ntasks = (int64_t)plan.tasks.size();
  if (!plan.any_shared) {
    at::parallel_for(0, ntasks, 1, [&](int64_t t0, int64_t t1) {
      Scratch scratch(1, H, D);
      for (int64_t t = t0; t < t1; ++t) run(plan.tasks[t], scratch);
    });
    return;
  }
  int64_t most = 1;                                      // the widest task: each thread's scratch holds its rows
  for (const Task& t : plan.tasks) most = std::max(most, t.R);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), ntasks), 1, [&](int64_t, int64_t) {
    Scratch scratch(most, H, D);
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) run(plan.tasks[t], scratch);
  });
}

// Fewer one-row tasks than threads (batch 1, a context of one chunk: 256 keys or fewer): each task split into
// groups of its row's KV heads, so that every thread works, where the tasks' work (keys x H x D products) is
// worth a parallel region (~5 us). Measured at 2 threads against 1 (results/decode_attention_heads.md, bf16
// cache): Qwen3-30B-A3B's 32 heads of 128 at 32 / 128 / 256 keys 0.84x / 0.66x / 0.62x the time, Qwen3-1.7B's at
// 128 keys 0.73x; split, SmolLM2's 9 heads of 64 at 128 keys (74k products) took 1.19x, so below kSplitWork a
// task stays whole. Bits unchanged: a head's operations are the same in any group (attend), whatever the split.
constexpr int64_t kSplitWork = 1 << 17;
static void split_heads(Plan& plan, const AttnArgs& a) {
  const int64_t n = (int64_t)plan.tasks.size(), threads = at::get_num_threads(), KVH = a.KVH;
  if (plan.any_shared || n == 0 || n >= threads || KVH < 2) return;
  int64_t work = 0;                                      // one-row tasks (no shared ones): member m0 is the task's
  for (const Task& t : plan.tasks) work += (plan.hi[t.m0] - plan.lo[t.m0]) * a.H * a.D;
  if (work < kSplitWork) return;
  const int64_t g = std::min(KVH, (threads + n - 1) / n);
  std::vector<Task> split;
  for (const Task& t : plan.tasks)
    for (int64_t k = 0; k < g; ++k) split.push_back({t.m0, t.R, t.srow, k * KVH / g, (k + 1) * KVH / g});
  plan.tasks.swap(split);
  plan.head_groups = g;
}

// Row b of a query set attends keys [start, lens) (a sliding window's start, else 0) in chunks of `chunk` keys
// at absolute positions (chunk j: keys [j c, (j + 1) c)), so a key's chunk and tile follow its position alone.
// Its chunks are [first[b], first[b + 1]) in the partial buffers.
void chunk_rows(Queries& qs, int64_t chunk_keys, int64_t Lk) {
  const int64_t B = (int64_t)qs.lens.size();
  qs.chunk.resize(B);
  qs.first.assign(B + 1, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t keys = qs.lens[b] - qs.start[b];
    const int64_t c = chunk_keys > 0 ? chunk_keys : chunk_keys == 0 ? Lk : row_chunk(keys);
    qs.chunk[b] = (c + TILE - 1) / TILE * TILE;
    qs.first[b + 1] = qs.first[b] + (qs.lens[b] - 1) / qs.chunk[b] - qs.start[b] / qs.chunk[b] + 1;
  }
}

// Attends every row of a (q set by the caller) into out [B, H, D] (rows H * D apart); kv: the cache's dtype.
// chunk_keys: keys per chunk; -1 row_chunk (see the top of the file), 0 never splits, > 0 forces that size
// (rounded up to whole tiles; for tests).
static void attend_rows(const AttnArgs& a, at::ScalarType kv, float* o, int64_t isa_req, int64_t chunk_keys,
                        int64_t window, bool bf16_products) {
  const int64_t B = a.B;
  TORCH_CHECK(window >= 0, "tandem.decode_attention: window must be >= 0");
  Queries qs;
  qs.start.assign(B, 0);
  qs.lens.assign(a.seq_lens, a.seq_lens + B);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(qs.lens[b] >= 1 && qs.lens[b] <= a.Lk, "tandem.decode_attention: seq_lens[", b, "] out of [1, ",
                a.Lk, "]");
    if (window > 0) qs.start[b] = std::max<int64_t>(0, qs.lens[b] - window);
  }
  chunk_rows(qs, chunk_keys, a.Lk);
  Plan plan;
  if (shared_prefix_on() && B > 1 && qs.first[B] > B) plan_shared(a, qs, plan);
  plan_rest(qs, plan);
  split_heads(plan, a);
  const Isa isa = resolve_isa(isa_req);
  run_plan(a, qs, plan, pick_attend(isa, kv, bf16_products, a.D), merge_for(isa), o);
}

// Row b's K then V (2 KVH head rows of D floats from src + b * rs + off, one contiguous run in qkv; in the slot,
// rows of row_elems<T>(D)) into slot loc[b], converted as torch converts (c10's constructors: round to nearest
// even) or, q8_0, quantized as kernels/kv_quant.py does (kv_q8.h).
template <typename T>
static void write_kv(const float* src, int64_t rs, int64_t off, void* cache, int64_t layer_off, const int64_t* loc,
                     int64_t B, int64_t KVH, int64_t D, int64_t slot_stride) {
  const int64_t hs = row_elems<T>(D);
  T* dst = static_cast<T*>(cache) + layer_off;
  for (int64_t b = 0; b < B; ++b) {
    const float* s = src + b * rs + off;
    T* d = dst + loc[b] * slot_stride;
    for (int64_t h = 0; h < 2 * KVH; ++h) put_row(s + h * D, D, d + h * hs);
  }
}

at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& kv_index_in, const at::Tensor& seq_lens_in, double scale,
                            int64_t isa_req, int64_t chunk_keys, int64_t window, bool bf16_products,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat, "tandem.decode_attention: q must be fp32 [B, H, D]");
  at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  at::Tensor kv_index = as_long(kv_index_in), seq_lens = as_long(seq_lens_in);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  check_cache(cache, layer, D);
  const int64_t KVH = cache.size(3), Lk = kv_index.size(1);
  TORCH_CHECK(H % KVH == 0, "tandem.decode_attention: head shapes do not match");
  TORCH_CHECK(kv_index.size(0) == B && seq_lens.size(0) == B, "tandem.decode_attention: batch sizes differ");
  const int64_t E = cache.size(4);                     // a head row's elements (D, or q8_0's bytes)
  const AttnArgs a{q.data_ptr<float>(), cache.data_ptr(), kv_index.data_ptr<int64_t>(),
                   seq_lens.data_ptr<int64_t>(), B, H, KVH, D, Lk, 2 * KVH * E, cache.size(1) * 2 * KVH * E, layer,
                   (float)scale, B > 1 ? q.stride(0) : H * D, sink_data(sinks, H, "tandem.decode_attention")};
  at::Tensor out = at::empty({B, H, D}, q.options());
  attend_rows(a, cache.scalar_type(), out.data_ptr<float>(), isa_req, chunk_keys, window, bf16_products);
  return out;
}

at::Tensor decode_attention_qkv_(const at::Tensor& qkv, const at::Tensor& cache, int64_t layer,
                                 const at::Tensor& loc_in, const at::Tensor& kv_index_in,
                                 const at::Tensor& seq_lens_in, double scale, int64_t H, int64_t isa_req,
                                 int64_t chunk_keys, int64_t window, bool bf16_products,
                                 const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(cache.dim() == 5, "tandem.decode_attention_qkv_: cache must be [S + 1, L, 2, KVH, D]");
  const int64_t KVH = cache.size(3), E = cache.size(4), B = qkv.size(0);
  const int64_t D = cache.scalar_type() == at::kByte ? E / Q8_BYTES * Q8_BLOCK : E;   // q8_0: D / 32 blocks
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 &&
                  qkv.size(1) == (H + 2 * KVH) * D && H % KVH == 0,
              "tandem.decode_attention_qkv_: qkv must be fp32 [B, (H + 2 KVH) D] with contiguous rows");
  check_cache(cache, layer, D);
  at::Tensor loc = as_long(loc_in), kv_index = as_long(kv_index_in), seq_lens = as_long(seq_lens_in);
  TORCH_CHECK(loc.dim() == 1 && loc.size(0) == B && kv_index.size(0) == B && seq_lens.size(0) == B,
              "tandem.decode_attention_qkv_: batch sizes differ");
  const int64_t S = cache.size(0), slot_stride = cache.size(1) * 2 * KVH * E, rs = qkv.stride(0);
  const float* src = qkv.data_ptr<float>();
  const int64_t* l = loc.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(l[b] >= 0 && l[b] < S, "tandem.decode_attention_qkv_: out_cache_loc[", b, "] out of range");
  const int64_t off = layer * 2 * KVH * E;
  void* c = cache.data_ptr();
  switch (cache.scalar_type()) {
    case at::kBFloat16: write_kv<c10::BFloat16>(src, rs, H * D, c, off, l, B, KVH, D, slot_stride); break;
    case at::kHalf: write_kv<c10::Half>(src, rs, H * D, c, off, l, B, KVH, D, slot_stride); break;
    case at::kByte: write_kv<KvQ8>(src, rs, H * D, c, off, l, B, KVH, D, slot_stride); break;
    default: write_kv<float>(src, rs, H * D, c, off, l, B, KVH, D, slot_stride);
  }
  const AttnArgs a{src, cache.data_ptr(), kv_index.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
                   B, H, KVH, D, kv_index.size(1), 2 * KVH * E, slot_stride, layer, (float)scale, rs,
                   sink_data(sinks, H, "tandem.decode_attention_qkv_")};
  at::Tensor out = at::empty({B, H * D}, qkv.options());
  attend_rows(a, cache.scalar_type(), out.data_ptr<float>(), isa_req, chunk_keys, window, bf16_products);
  return out;
}

}  // namespace tandem
