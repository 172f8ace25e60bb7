// The CPU's int8 multiply-add peak, the yardstick of the prefill and batch tiles (benchmarks/tile_peak.py: a tile's
// rate as a share of it). Independent chains of the instruction each body makes its int8 dot products of, enough of
// them that only the execution ports bound the loop:
//   body 2, AVX-512 VNNI: vpdpbusd zmm (64 multiply-adds), 12 chains (its latency 5 x 2 ports);
//   body 1, AVX2: vpmaddubsw + vpmaddwd + vpaddd ymm (32 multiply-adds in 3 operations), 5 chains.
// The operands are made opaque to the compiler every iteration, so nothing is hoisted out of the loop.
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>

#include "ops.h"
#include "vec.h"

namespace tandem {

bool cpu_has_vnni();

namespace {

TANDEM_KERNEL_VNNI int64_t peak_vnni(int64_t iters) {
  __m512i a[12];
  for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
  __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(-5);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+v"(w), "+v"(x));
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
  }
  __m512i s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
  return _mm512_reduce_add_epi32(s);
}

TANDEM_KERNEL_AVX2 int64_t peak_avx2(int64_t iters) {
  // Each chain its own weight operand, made opaque apart (one shared operand let the compiler make the
  // identical vpmaddubsw / vpmaddwd once an iteration); 5 chains, so sums, operands, x and ones stay in 16 ymm.
  __m256i a[5], w[5];
  for (int i = 0; i < 5; ++i) a[i] = _mm256_set1_epi32(i), w[i] = _mm256_set1_epi8((char)(3 + i));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i x = _mm256_set1_epi8(-5);
  for (int64_t it = 0; it < iters; ++it) {
    asm volatile("" : "+x"(w[0]), "+x"(w[1]), "+x"(w[2]), "+x"(w[3]), "+x"(w[4]), "+x"(x));
#pragma GCC unroll 5
    for (int i = 0; i < 5; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], x), ones));
  }
  __m256i s = a[0];
  for (int i = 1; i < 5; ++i) s = _mm256_add_epi32(s, a[i]);
  alignas(32) int32_t v[8];
  _mm256_store_si256((__m256i*)v, s);
  return v[0];
}

}  // namespace

// Multiply-adds per second over every thread of the pool, each running `iters` iterations of the body `isa` picks
// (-1: the best here; 1 AVX2; 2 AVX-512 VNNI, where the CPU has it). 0 where neither body runs.
double int8_peak(int64_t iters, int64_t isa) {
  const Isa level = resolve_isa(isa);
  const bool vnni = level == kAvx512 && cpu_has_vnni();
  if (!vnni && level < kAvx2) return 0.0;
  const int64_t per_iter = vnni ? 12 * 64 : 5 * 32, threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) sink += vnni ? peak_vnni(iters) : peak_avx2(iters);
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return (double)(threads * iters * per_iter) / s;     // (the atomic sink keeps the loops' results live)
}

}  // namespace tandem
