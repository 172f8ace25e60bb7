// Run-time ISA choice: what the CPU supports, capped by TANDEM_ISA (scalar | avx2 | avx512 | amx).
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

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
    Isa want = std::strcmp(cap, "scalar") == 0 ? kScalar : std::strcmp(cap, "avx2") == 0 ? kAvx2 : kAvx512;  // avx512, amx
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

// AVX512-BF16 (vdpbf16ps: two bf16 products into each fp32 lane), for extend_attention's bf16-products task.
bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16");
}

// AMX int8 tiles (Sapphire Rapids and later), for gemm_rows_q8act's AMX body: the CPU has AMX-TILE and AMX-INT8, the
// OS saves the tile state (XCR0 bits 17-18) and grants this process the tile data (Linux arch_prctl
// ARCH_REQ_XCOMP_PERM, once; the grant is process-wide). TANDEM_ISA, when set, must say "amx" for it: any
// other cap (avx512, avx2, scalar) turns it off, so one variable still forces every lower body.
bool cpu_has_amx() {
  static const bool ok = [] {
    const char* cap = std::getenv("TANDEM_ISA");
    if (cap != nullptr && *cap != 0 && std::strcmp(cap, "amx") != 0) return false;
    if (best_isa() != kAvx512 || !cpu_has_vnni()) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 24 & 1) || !(d >> 25 & 1)) return false;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;            // OSXSAVE: xgetbv works
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return false;
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return ok;
}

const char* isa_name(Isa isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "scalar"; }

}  // namespace tandem
