// Run-time ISA choice: what the CPU supports, capped by TANDEM_ISA (scalar | avx2 | avx512).
#include <cstdlib>
#include <cstring>

#include "vec.h"

namespace tandem {

static Isa cpu_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;  // F16C comes with both
  return kScalar;
}

Isa best_isa() {
  static const Isa isa = [] {
    Isa best = cpu_isa();
    const char* cap = std::getenv("TANDEM_ISA");
    if (cap == nullptr || *cap == 0) return best;
    Isa want = std::strcmp(cap, "scalar") == 0 ? kScalar : std::strcmp(cap, "avx2") == 0 ? kAvx2 : kAvx512;
    return want < best ? want : best;
  }();
  return isa;
}

Isa resolve_isa(int64_t requested) {
  if (requested < 0) return best_isa();
  Isa cpu = cpu_isa();
  return requested < cpu ? (Isa)requested : cpu;
}

// AVX-512 VNNI (vpdpbusd), for the int8-activation linear; without it that op runs its AVX2 body.
bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512vnni");
}

const char* isa_name(Isa isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

}  // namespace tandem
