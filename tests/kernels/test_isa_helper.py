"""tests/helpers/isa.py, the one source of the kernel tests' ISA cases: on a CPU that lacks a body (simulated here by
patching the level the library reports), that body's case is skipped with the reason, never run under its name on
the body the library would clamp it to; on this CPU, the cases it runs are those the library says it runs."""
from __future__ import annotations

import pytest
import torch

from tandem import kernels
from tests.helpers import isa as helper

native = pytest.mark.skipif(not kernels.available(), reason="native kernels not built")


def _skips(params) -> dict[int, str | None]:
    """Each param's level and its skip reason (None: it runs)."""
    out = {}
    for p in params:
        marks = [m for m in p.marks if m.name == "skip"]
        out[p.values[0]] = marks[0].kwargs["reason"] if marks else None
    return out


@native
def test_an_avx2_cpu_skips_the_avx512_case_with_the_reason(monkeypatch):
    monkeypatch.setattr(helper, "cpu_level", lambda: 1)
    skips = _skips(helper.isas())
    assert skips[0] is None and skips[1] is None
    assert skips[2] == ("CPU lacks AVX-512 (avx512f, avx512bw, avx512vl, avx512dq, fma): isa=2 would run the avx2 "
                        "body")
    assert _skips(helper.isas((1, 2)))[2] == skips[2]
    assert helper.runnable() == [0, 1] and helper.runnable((1, 2)) == [1]


@native
def test_a_scalar_cpu_skips_both_simd_cases(monkeypatch):
    monkeypatch.setattr(helper, "cpu_level", lambda: 0)
    skips = _skips(helper.isas())
    assert skips[0] is None
    assert skips[1] == "CPU lacks AVX2 (avx2, fma): isa=1 would run the scalar body"
    assert skips[2].startswith("CPU lacks AVX-512") and skips[2].endswith("would run the scalar body")
    assert helper.runnable() == [0] and helper.runnable((1, 2)) == []


@native
def test_avx512_without_vnni_skips_only_the_int8_ops_case(monkeypatch):
    monkeypatch.setattr(helper, "cpu_level", lambda: 2)
    monkeypatch.setattr(helper, "has_vnni", lambda: False)
    assert _skips(helper.isas()) == {0: None, 1: None, 2: None}
    skips = _skips(helper.isas(vnni=True))
    assert skips[0] is None and skips[1] is None
    assert skips[2] == "CPU lacks AVX-512 VNNI (avx512vnni): the int8 ops' isa=2 would run the AVX2 body"
    assert helper.runnable(vnni=True) == [0, 1] and helper.runnable() == [0, 1, 2]


def test_without_the_library_every_case_is_skipped(monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no compiler")
    assert _skips(helper.isas()) == {level: "native kernels not built: no compiler" for level in (0, 1, 2)}
    assert helper.runnable() == []


@native
def test_on_this_cpu_the_cases_are_the_librarys_answer():
    """A level runs here exactly when the library resolves it to itself (csrc/isa.cpp clamps the rest); the ids
    stay the bare level, as the lists the helper replaced had them."""
    level = int(torch.ops.tandem.isa(2))
    assert helper.cpu_level() == level
    for requested, reason in _skips(helper.isas()).items():
        assert (reason is None) == (int(torch.ops.tandem.isa(requested)) == requested)
    assert helper.runnable() == list(range(level + 1))
    assert [p.id for p in helper.isas()] == [None, None, None]
    vnni = int(torch.ops.tandem.gemm_rows_q8act_body(8, 2)) >= 2                       # 8: Q8_0
    assert helper.has_vnni() == vnni and (2 in helper.runnable(vnni=True)) == (level == 2 and vnni)
