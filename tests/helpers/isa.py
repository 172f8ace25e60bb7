"""The ISA bodies a kernel test runs, written once. A test case named for a body the CPU lacks is skipped with the
reason: the library clamps a requested ISA level to the CPU's (csrc/isa.cpp, resolve_isa), so an unskipped
"isa=2" case on an AVX2-only CPU would run the AVX2 body under the AVX-512 name. The CPU's level is the
library's own answer (torch.ops.tandem.isa(2)), not a second detection."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tandem.kernels import ISA_NAMES

LEVELS = (0, 1, 2)                                         # scalar, AVX2, AVX-512: the `isa` argument of the ops
NEEDS = {1: "AVX2 (avx2, fma)", 2: "AVX-512 (avx512f, avx512bw, avx512vl, avx512dq, fma)"}   # isa.cpp's cpu_isa()


def cpu_level() -> int:
    """The highest body the ops run on this CPU: what the library resolves a request for AVX-512 to (an explicit
    level is clamped to the CPU only, TANDEM_ISA does not cap it); -1 when the library is not loaded."""
    return int(torch.ops.tandem.isa(2)) if kernels.available() else -1


def has_vnni() -> bool:
    """Whether the int8 ops run their AVX-512 VNNI body for isa=2 (without VNNI they run the AVX2 one there):
    gemm_rows_q8act's own answer."""
    from tandem.kernels.quant import Q8_0
    return kernels.available() and int(torch.ops.tandem.gemm_rows_q8act_body(Q8_0, 2)) >= 2


def skip_reason(level: int, vnni: bool = False) -> str | None:
    """Why `level` cannot run its own body here (None: it can). vnni: the op's isa=2 body needs AVX-512 VNNI."""
    if not kernels.available():
        return f"native kernels not built: {kernels.unavailable_reason()}"
    cpu = cpu_level()
    if level > cpu:
        return f"CPU lacks {NEEDS[level]}: isa={level} would run the {ISA_NAMES[cpu]} body"
    if vnni and level == 2 and not has_vnni():
        return "CPU lacks AVX-512 VNNI (avx512vnni): the int8 ops' isa=2 would run the AVX2 body"
    return None


def isas(levels=LEVELS, vnni: bool = False) -> list:
    """pytest params for the `isa` argument: each level, skipped with the reason where the CPU lacks its body."""
    params = []
    for level in levels:
        reason = skip_reason(level, vnni)
        params.append(pytest.param(level, marks=pytest.mark.skip(reason=reason)) if reason else pytest.param(level))
    return params


def runnable(levels=LEVELS, vnni: bool = False) -> list[int]:
    """The levels whose own body runs here, for a test that loops over the bodies inside one case."""
    return [level for level in levels if skip_reason(level, vnni) is None]
