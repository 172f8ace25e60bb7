// A parallel loop whose threads take work from one another: the packed GEMVs' thread split (gemv_packed_q8act.cpp,
// gemv_packed_k_q8act.cpp, and split_jobs for an MoE row's experts).
//
// Why: at::parallel_for splits statically, so a region ends when its slowest thread does. The device threads
// share the machine's cores with the host (on 2 cores the scheduler's ~0.8 ms of Python a decode step, the
// server's frontend): a thread descheduled for a time slice holds the whole region up while its partner
// waits at the barrier. Here each thread starts on the share parallel_for would give it and walks it forward a
// piece at a time, and a thread done with its own takes pieces from the back of the share with the most left.
// What it cannot do: the region still ends only once a descheduled thread runs again (to finish the piece in
// its hands and reach the barrier); the others do the rest of its share meanwhile.
//
// The invariant callers keep: a piece is whole output tiles, computed by the same operations whoever runs it,
// so the bits never depend on which thread ran which piece (tests compare the ops with their references at 1-8
// threads, past the cores).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tandem {

// fn(i0, i1) over [0, n), each index exactly once: in pieces of at most `piece` indices (one call for all of
// them where one thread runs).
template <class F>
void stealing_for(int64_t n, int64_t piece, const F& fn) {
  if (n <= 0) return;
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), (n + piece - 1) / piece);
  if (nt <= 1 || at::in_parallel_region()) return fn(0, n);
  TORCH_CHECK(n < (int64_t(1) << 31), "tandem: stealing_for takes fewer than 2^31 indices, got ", n);
  struct alignas(64) Share {
    std::atomic<uint64_t> range;                 // lo << 32 | hi: the indices [lo, hi) nobody has taken yet
  };
  const auto pack = [](uint64_t lo, uint64_t hi) { return lo << 32 | hi; };
  std::vector<Share> shares(nt);
  for (int64_t t = 0; t < nt; ++t) shares[t].range.store(pack(n * t / nt, n * (t + 1) / nt));
  // Takes up to `piece` from the front (own share) or the back (another's); false once the share is empty.
  const auto take = [&](Share& s, bool front, int64_t& i0, int64_t& i1) {
    uint64_t r = s.range.load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = int64_t(r >> 32), hi = int64_t(r & 0xffffffffu);
      if (lo >= hi) return false;
      i0 = front ? lo : std::max(lo, hi - piece);
      i1 = front ? std::min(hi, lo + piece) : hi;
      const uint64_t next = front ? pack(i1, hi) : pack(lo, i0);
      if (s.range.compare_exchange_weak(r, next, std::memory_order_relaxed)) return true;
    }
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    int64_t i0, i1;
    for (int64_t t = t0; t < t1; ++t)
      while (take(shares[t], true, i0, i1)) fn(i0, i1);
    while (true) {                               // own share done: help the one with the most left
      Share* most = nullptr;
      int64_t left = 0;
      for (auto& s : shares) {
        const uint64_t r = s.range.load(std::memory_order_relaxed);
        const int64_t l = int64_t(r & 0xffffffffu) - int64_t(r >> 32);
        if (l > left) left = l, most = &s;
      }
      if (most == nullptr) return;
      if (take(*most, false, i0, i1)) fn(i0, i1);
    }
  });
}

}  // namespace tandem
