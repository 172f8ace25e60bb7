// A step's prompt tokens attended with the decode op's arithmetic (decode_attention.cpp's tasks, decode_attention.h):
// causal_attention gives every token the bits decode_attention gives it as a decode row over its own causal
// keys (kv_index[tok_row[t]], positions[t] + 1 of them), whatever else the step holds. With sinks (fp32 [H],
// attention_sink.h) too: both ops fold a head's sink into its final state by the one finish_head.
//
// Why: the extend op (extend_attention.cpp) and SDPA sum in another order than the decode op, and which of them
// a token took followed the step's size (how many tokens its chunk had), so a prompt's first token and the KV it
// left changed with the traffic around it (issue: "same request, same bits"). Here a token's chunks and tiles
// follow its absolute key positions and its key count only (attend's invariant), so its output is one function
// of its request whatever chunk, step, batch or thread count it comes in, and equal to a decode row's.
//
// Speed: on the AVX2 and AVX-512 bodies (head_dim a multiple of their width) a call runs in GEMM form
// (causal_gemm_simd.inc, and causal_gemm_bf16.inc for bf16 products: a task's queries in the lanes, the decode
// op's numbers in its order): 0.95-1.01x the extend op's time on a prompt's chunks with fp32 products (AVX-512 and
// AVX2 bodies), 0.97-1.08x with bf16 products, 1.09-1.13x on 24-token chunks of a shared prefix, at 2 threads on
// SmolLM2's heads (benchmarks/extend_attention.py; the decode task took 1.7-2.4x).
// Elsewhere (the scalar body, other head sizes) the decode task itself runs: up to causal_rows()
// consecutive tokens with the same chunk size share a task per chunk (their K and V tiles loaded and widened once
// for all of them, as a shared prefix's decode rows are), each token taking part in the tiles its keys meet.
// How many share a task changes no bit (attend's invariant), only how often a tile's setup is paid: 32 tokens
// rather than 8 took 0.92-0.96x the time on SmolLM2's heads with bf16 products (AMD EPYC, 2 threads;
// benchmarks/results/batch_invariance_cost.md), their queries [R, H, D] held to CAUSAL_QUERY_FLOATS.
// Partials of split rows are kept for one slice of tokens at a time (at most SLICE_PARTIALS chunk states), so a
// long chunk of a large model does not hold them all at once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <vector>

#include "decode_attention.h"
#include "kv_q8.h"
#include "ops.h"
#include "vec.h"

namespace tandem {

// A causal_attention call's tokens for causal_gemm_simd.inc: token t attends keys [start[t], lens[t]) of kv row
// srow[t].
struct CausalCols { const int64_t *start, *lens, *srow; };

#define TANDEM_SIMD_BODY "causal_attention_simd.inc"      // the GEMM form's tasks
#include "simd_namespaces.inc"

constexpr int64_t SLICE_PARTIALS = 4096;
constexpr int64_t CAUSAL_QUERY_FLOATS = 1 << 15;

// Tokens a decode-task form task carries: as many as keep their queries within CAUSAL_QUERY_FLOATS (128 KB), at
// least SHARED_PREFIX_ROWS, at most MAX_SHARED_ROWS.
static int64_t causal_rows(int64_t H, int64_t D) {
  return std::clamp<int64_t>(CAUSAL_QUERY_FLOATS / (H * D), SHARED_PREFIX_ROWS, MAX_SHARED_ROWS);
}

// Tasks for tokens [t0, t1) of qs: per group of consecutive tokens of one kv row and chunk size (at most
// `rows`), one task per chunk j their keys meet, carrying the tokens whose range meets it.
static void plan_causal(const Queries& qs, int64_t t0, int64_t t1, int64_t rows, Plan& plan) {
  for (int64_t g0 = t0; g0 < t1;) {
    int64_t g1 = g0 + 1;
    while (g1 < t1 && g1 - g0 < rows && qs.srow[g1] == qs.srow[g0] && qs.chunk[g1] == qs.chunk[g0]) ++g1;
    const int64_t c = qs.chunk[g0];
    int64_t jlo = qs.start[g0] / c, jhi = (qs.lens[g0] - 1) / c;
    for (int64_t t = g0 + 1; t < g1; ++t)
      jlo = std::min(jlo, qs.start[t] / c), jhi = std::max(jhi, (qs.lens[t] - 1) / c);
    for (int64_t j = jlo; j <= jhi; ++j) {
      const int64_t m0 = (int64_t)plan.members.size();
      for (int64_t t = g0; t < g1; ++t) {
        const int64_t k0 = std::max(qs.start[t], j * c), k1 = std::min(qs.lens[t], (j + 1) * c);
        if (k0 < k1) plan.add(t, k0, k1, j - qs.start[t] / c);
      }
      if ((int64_t)plan.members.size() > m0)
        plan.tasks.push_back({m0, (int64_t)plan.members.size() - m0, qs.srow[g0]});
    }
    g0 = g1;
  }
  plan.any_shared = true;                   // tasks of unequal cost: the threads take them from one counter
}

// The GEMM-form tasks (causal_gemm_simd.inc) of a call: per run of consecutive tokens of one kv row with one chunk
// size, parts of at most CAUSAL_COLS / G tokens, each once per KV head; longest first, the threads taking them from
// one counter (which thread runs a task never changes a bit).
constexpr int64_t CAUSAL_COLS = 192;

template <typename Task>
static std::vector<Task> plan_causal_gemm(const Queries& qs, int64_t G, int64_t KVH) {
  const int64_t T = (int64_t)qs.lens.size();
  std::vector<Task> tasks;
  for (int64_t g0 = 0; g0 < T;) {
    int64_t g1 = g0 + 1;
    while (g1 < T && qs.srow[g1] == qs.srow[g0] && qs.chunk[g1] == qs.chunk[g0]) ++g1;
    const int64_t per = std::max<int64_t>(1, CAUSAL_COLS / G);
    for (int64_t t0 = g0; t0 < g1; t0 += per) {
      const int64_t n = std::min(per, g1 - t0);
      int64_t keys = 0;
      for (int64_t t = t0; t < t0 + n; ++t) keys = std::max(keys, qs.lens[t] - qs.start[t]);
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({t0, n, h, qs.chunk[g0], n * keys});
    }
    g0 = g1;
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

template <typename Task>
static void run_causal_gemm(const AttnArgs& a, const Queries& qs,
                            void (*fn)(const AttnArgs&, const CausalCols&, const Task&, float*, float*),
                            int64_t (*floats)(int64_t, int64_t), int64_t W, float* o) {
  const int64_t G = a.H / a.KVH;
  const std::vector<Task> tasks = plan_causal_gemm<Task>(qs, G, a.KVH);
  int64_t most = 0;
  for (const Task& t : tasks) most = std::max(most, floats((t.n * G + W - 1) / W * W, a.D));
  const CausalCols cc{qs.start.data(), qs.lens.data(), qs.srow.data()};
  const int64_t ntasks = (int64_t)tasks.size();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), ntasks), 1, [&](int64_t, int64_t) {
    std::unique_ptr<float[]> scratch(new float[(size_t)most]);   // every part is written before it is read
    for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) fn(a, cc, tasks[t], scratch.get(), o);
  });
}

// The GEMM form where it runs (the AVX2 and AVX-512 bodies, D a multiple of their width, the fp32 products):
// true when it wrote out.
static bool causal_gemm(const AttnArgs& a, const Queries& qs, Isa isa, at::ScalarType kv, bool bf16p, float* o) {
  if (bf16p) {                         // pick_attend's bf16-products body: a bf16 cache, AVX512-BF16, D % 32 == 0
    using P = avx512::Bf16Products<c10::BFloat16>;
    run_causal_gemm<avx512::CausalTask>(a, qs, avx512::causal_task<P>, avx512::causal_scratch_floats<P>, 16, o);
    return true;
  }
  if (isa == kScalar) return false;
  const int64_t W = isa == kAvx512 ? 16 : 8;
  if (a.D % W) return false;
#define TANDEM_CAUSAL_RUN(NS, T) \
  run_causal_gemm<NS::CausalTask>(a, qs, NS::causal_task<NS::Fp32Products<T>>,            \
                                  NS::causal_scratch_floats<NS::Fp32Products<T>>, W, o)
#define TANDEM_CAUSAL_ISA(NS)                                                               \
  kv == at::kBFloat16 ? TANDEM_CAUSAL_RUN(NS, c10::BFloat16) : kv == at::kHalf ? TANDEM_CAUSAL_RUN(NS, c10::Half) \
  : kv == at::kByte ? TANDEM_CAUSAL_RUN(NS, KvQ8) : TANDEM_CAUSAL_RUN(NS, float)
  if (isa == kAvx512) TANDEM_CAUSAL_ISA(avx512);
  else TANDEM_CAUSAL_ISA(avx2);
#undef TANDEM_CAUSAL_ISA
#undef TANDEM_CAUSAL_RUN
  return true;
}

at::Tensor causal_attention(const at::Tensor& q_in, const at::Tensor& cache, int64_t layer,
                            const at::Tensor& kv_index_in, const at::Tensor& tok_row_in, const at::Tensor& positions_in,
                            double scale, int64_t window, int64_t isa_req, bool bf16_products,
                            const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q_in.dim() == 3 && q_in.scalar_type() == at::kFloat,
              "tandem.causal_attention: q must be fp32 [T, H, D]");
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  check_cache(cache, layer, D);
  const int64_t KVH = cache.size(3), S = cache.size(0), E = cache.size(4);
  TORCH_CHECK(H % KVH == 0, "tandem.causal_attention: heads must be a multiple of the KV heads");
  TORCH_CHECK(window >= 0, "tandem.causal_attention: window must be >= 0");
  const at::Tensor kv_index = as_long(kv_index_in), tok_row = as_long(tok_row_in), pos = as_long(positions_in);
  TORCH_CHECK(kv_index.dim() == 2 && tok_row.dim() == 1 && pos.dim() == 1 && tok_row.size(0) == T &&
                  pos.size(0) == T,
              "tandem.causal_attention: kv_index must be [B, Lk], tok_row and positions [T]");
  const int64_t B = kv_index.size(0), Lk = kv_index.size(1);
  const int64_t *rows = tok_row.data_ptr<int64_t>(), *p = pos.data_ptr<int64_t>(), *idx = kv_index.data_ptr<int64_t>();
  Queries qs;
  qs.start.resize(T), qs.lens.resize(T), qs.srow.assign(rows, rows + T);
  std::vector<int64_t> row_end(B, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(rows[t] >= 0 && rows[t] < B, "tandem.causal_attention: tok_row[", t, "] out of range");
    TORCH_CHECK(p[t] >= 0 && p[t] < Lk, "tandem.causal_attention: positions[", t, "] out of [0, ", Lk, ")");
    qs.lens[t] = p[t] + 1;
    qs.start[t] = window > 0 ? std::max<int64_t>(0, p[t] + 1 - window) : 0;
    row_end[rows[t]] = std::max(row_end[rows[t]], p[t] + 1);
  }
  for (int64_t b = 0; b < B; ++b)         // every slot a token reads must lie in the cache
    for (int64_t j = 0; j < row_end[b]; ++j)
      TORCH_CHECK(idx[b * Lk + j] >= 0 && idx[b * Lk + j] < S, "tandem.causal_attention: kv_index[", b, ", ", j,
                  "] out of range");
  chunk_rows(qs, -1, Lk);
  at::Tensor out = at::empty({T, H * D}, q.options());
  const AttnArgs a{q.data_ptr<float>(), cache.data_ptr(), idx, nullptr, T, H, KVH, D, Lk, 2 * KVH * E,
                   cache.size(1) * 2 * KVH * E, layer, (float)scale, T > 1 ? q.stride(0) : H * D,
                   sink_data(sinks, H, "tandem.causal_attention")};
  const Isa isa = resolve_isa(isa_req);
  const AttendFn attend = pick_attend(isa, cache.scalar_type(), bf16_products, D);
  float* o = out.data_ptr<float>();
  const bool bf16p = attend != pick_attend(isa, cache.scalar_type(), false, D);   // the bf16-products body runs
  if (T > 0 && causal_gemm(a, qs, isa, cache.scalar_type(), bf16p, o)) return out;
  for (int64_t t0 = 0; t0 < T;) {         // slices of tokens whose split rows hold at most SLICE_PARTIALS partials
    int64_t t1 = t0, parts = 0;
    while (t1 < T && (t1 == t0 || parts + qs.first[t1 + 1] - qs.first[t1] <= SLICE_PARTIALS))
      parts += qs.first[t1 + 1] - qs.first[t1], ++t1;
    const Queries slice = qs.slice(t0, t1);   // the slice's rows, renumbered from 0 (q, out offset by t0)
    Plan plan;
    plan_causal(slice, 0, t1 - t0, causal_rows(H, D), plan);
    AttnArgs as = a;
    as.q = a.q + t0 * a.q_stride;
    run_plan(as, slice, plan, attend, merge_for(isa), o + t0 * H * D);
    t0 = t1;
  }
  return out;
}

}  // namespace tandem
