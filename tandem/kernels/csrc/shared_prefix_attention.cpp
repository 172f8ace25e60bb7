// Shared-prefix (cascade) attention, the decode op's planner (decode_attention.cpp runs its tasks) and its switch:
// rows whose keys start with the same KV slots (a radix-cache prefix several requests hit, the n samples of one
// prompt, a verify step's rows of one request) read those slots once per step for all of them, instead of once
// per row.
//
// Found from kv_index itself (the slots are the tree node's: no scheduler state is needed, and a mixed step's
// decode part or a verify step is covered too): rows are grouped by their first slot and chunk size; a row
// shares chunk j with its group's leader when the chunk's keys [j c, (j + 1) c) lie inside their common
// prefix. Such a chunk becomes tasks of up to SHARED_PREFIX_ROWS of its rows, each run by one thread for all its
// rows at once: the chunk's K and V come from memory once, and each tile's K and V rows are widened once
// for every query of every row (without it, each row streams its whole context from memory and converts it
// alone: the shared prefix is paid once a row); the rest stay tasks of one row.
//
// Invariant (why this changes no output): a row's chunks are the ones it has alone (row_chunk of its own key
// count, aligned to its start), attend computes each row's scores, softmax and outputs by the same operations
// in the same order whether the row is alone or one of R (decode_attention_task.inc), and the per-row partials
// are merged in chunk order as before: only which rows a task carries changes. So every output is the same bits with
// sharing on or off, in any batch and at any thread count (tests/kernels/test_cascade_attention.py).
// Local (sliding-window) rows whose window has moved off position 0 start elsewhere and never share.
#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "decode_attention.h"
#include "ops.h"

namespace tandem {

std::atomic<bool> g_shared_prefix{true};          // read by shared_prefix_on() (decode_attention.h)
static std::atomic<int64_t> g_shared_reads{0};   // row chunks served by shared tasks since the library loaded

// torch.ops.tandem.shared_prefix_attention(on): on 0 / 1 switches it (the engine's shared_prefix_attention
// option, set by the executor before each step; tests); -1 only asks. Returns the setting in force; -2 returns
// instead how many row chunks shared tasks have served so far (tests and benchmarks see that it runs).
int64_t shared_prefix_attention(int64_t on) {
  if (on == -2) return g_shared_reads.load(std::memory_order_relaxed);
  if (on >= 0) g_shared_prefix.store(on != 0, std::memory_order_relaxed);
  return shared_prefix_on();
}

// The shared tasks (see the top of this file); plan.shared gets each row's count of shared chunks.
void plan_shared(const AttnArgs& a, const Queries& qs, Plan& plan) {
  const int64_t B = a.B, Lk = a.Lk;
  const std::vector<int64_t>&start = qs.start, &chunk = qs.chunk, &first = qs.first;
  const int64_t* idx = a.kv_index;
  plan.shared.assign(B, 0);
  std::vector<int64_t> cand;
  for (int64_t b = 0; b < B; ++b)
    if (start[b] == 0 && first[b + 1] - first[b] >= 2) cand.push_back(b);
  std::stable_sort(cand.begin(), cand.end(), [&](int64_t x, int64_t y) {
    return idx[x * Lk] != idx[y * Lk] ? idx[x * Lk] < idx[y * Lk] : chunk[x] < chunk[y];
  });
  std::vector<int64_t> group, rest, count;
  for (size_t g0 = 0; g0 < cand.size();) {
    size_t g1 = g0 + 1;
    while (g1 < cand.size() && idx[cand[g1] * Lk] == idx[cand[g0] * Lk] && chunk[cand[g1]] == chunk[cand[g0]]) ++g1;
    group.assign(cand.begin() + g0, cand.begin() + g1);
    g0 = g1;
    const int64_t c = chunk[group[0]];
    while (group.size() > 1) {                           // the leader, and the rows that share a chunk with it
      const int64_t lead = group[0];
      const int64_t* p = idx + lead * Lk;
      rest.clear();
      count.assign(group.size(), 0);
      int64_t most = 0;
      for (size_t r = 1; r < group.size(); ++r) {
        const int64_t* q = idx + group[r] * Lk;
        const int64_t n = std::min(a.seq_lens[lead], a.seq_lens[group[r]]);
        int64_t l = 0;
        while (l < n && p[l] == q[l]) ++l;
        count[r] = l / c;
        most = std::max(most, count[r]);
        if (count[r] == 0) rest.push_back(group[r]);
      }
      for (int64_t j = 0; j < most; ++j) {              // chunk j: tasks of at most SHARED_PREFIX_ROWS of its rows
        const int64_t m0 = (int64_t)plan.members.size();
        plan.add(lead, j * c, (j + 1) * c, j);
        for (size_t r = 1; r < group.size(); ++r)
          if (count[r] > j) plan.add(group[r], j * c, (j + 1) * c, j);
        const int64_t m1 = (int64_t)plan.members.size();
        for (int64_t m = m0; m < m1; m += SHARED_PREFIX_ROWS)
          plan.tasks.push_back({m, std::min(SHARED_PREFIX_ROWS, m1 - m), lead});
        g_shared_reads.fetch_add(m1 - m0, std::memory_order_relaxed);
      }
      if (most) {
        plan.any_shared = true;
        plan.shared[lead] = most;
        for (size_t r = 1; r < group.size(); ++r) plan.shared[group[r]] = count[r];
      }
      group.swap(rest);                                  // those that share nothing with it: a new leader
    }
  }
}

}  // namespace tandem
