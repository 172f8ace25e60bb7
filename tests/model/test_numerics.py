"""The numeric path decided once (tandem/model/numerics.py): resolve() makes every choice from the options, the
CPU's facts and the weights' (no probe of its own), the facts every rank's least so that all decide alike, and
the fingerprint hashes what resolve() reads."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.config import EngineConfig
from tandem.fingerprint import ARITHMETIC_FIELDS
from tandem.kernels import kv_quant
from tandem.model.numerics import (ISAS, LINEAR_CHUNK, Cpu, NumericOptions, Numerics, every_rank, native_kernels,
                                   resolve)

CPU = torch.device("cpu")
AMX = Cpu("avx512", avx512_bf16=True, amx=True)          # a CPU with AMX-BF16 tiles (Sapphire Rapids on)
EPYC = Cpu("avx512", avx512_bf16=True, amx=False)        # AVX512-BF16 without AMX (AMD Zen 4)
AVX2 = Cpu("avx2", avx512_bf16=False, amx=False)
NO_LIBRARY = Cpu("torch", avx512_bf16=True, amx=True)


def options(**kw) -> NumericOptions:
    return NumericOptions.of(EngineConfig(**kw))


def numerics(cpu: Cpu = AMX, head_dim: int = 64, int8_blocks: bool = True, bf16_fits: bool = True,
             dtype: torch.dtype = torch.float32, device: torch.device = CPU, **kw) -> Numerics:
    return resolve(options(**kw), cpu, device, dtype, head_dim, int8_blocks, bf16_fits)


def test_the_defaults_on_each_cpu():
    """batch_invariant (the default): the causal op for every chunk, bf16 products where the CPU has
    AVX512-BF16, a bf16 KV cache where the linears round."""
    for cpu in (AMX, EPYC):
        n = numerics(cpu)
        assert (n.native, n.int8_act, n.kv_dtype, n.batch_invariant) == (True, True, torch.bfloat16, True)
        assert n.extend_native and n.decode_bf16 and n.extend_bf16 and not n.prefill_bf16 and not n.bf16_sdpa
    n = numerics(AVX2)
    assert n.native and n.extend_native and not (n.decode_bf16 or n.extend_bf16 or n.prefill_bf16)
    n = numerics(NO_LIBRARY)                            # the library did not load: the torch path
    assert not n.native and not n.extend_native and n.kv_dtype == torch.float32 and not n.batch_invariant


def test_without_batch_invariance_amx_prefills_in_bf16():
    n = numerics(AMX, batch_invariant=False)
    assert n.prefill_bf16 and n.bf16_sdpa and not n.extend_native and not n.extend_bf16 and n.decode_bf16
    assert n.extend_dtype == torch.bfloat16
    assert not numerics(AMX, batch_invariant=False, bf16_fits=False).prefill_bf16     # the copies do not fit
    assert not numerics(AMX, batch_invariant=False, prefill_act="int8").prefill_bf16
    n = numerics(EPYC, batch_invariant=False)            # no AMX: the extend op, with bf16 products
    assert not n.prefill_bf16 and n.extend_native and n.extend_bf16
    n = numerics(EPYC, batch_invariant=False, prefill_act="bf16")   # asked: bf16 linears, the extend op attends
    assert n.prefill_bf16 and not n.bf16_sdpa and n.extend_native and n.extend_bf16


def test_the_delta_rule_takes_chunks_only_without_batch_invariance_on_the_native_ops():
    """linear_chunk: the chunked op's bits follow where chunks start, so never under batch_invariant; the torch
    path has no chunked op."""
    assert numerics(AMX).linear_chunk == 0
    for cpu in (AMX, EPYC, AVX2):
        assert numerics(cpu, batch_invariant=False).linear_chunk == LINEAR_CHUNK > 0
        assert numerics(cpu, batch_invariant=False, kernels_act="fp32").linear_chunk == LINEAR_CHUNK
    assert numerics(NO_LIBRARY, batch_invariant=False).linear_chunk == 0
    assert numerics(kernels="torch", batch_invariant=False).linear_chunk == 0


def test_the_exact_mode_and_the_torch_path_take_no_bf16():
    for n in (numerics(kernels_act="fp32"), numerics(int8_blocks=False), numerics(kernels="torch"),
              numerics(dtype=torch.bfloat16)):
        assert not (n.prefill_bf16 or n.extend_bf16 or n.decode_bf16), n
    assert numerics(kernels_act="fp32").kv_dtype == torch.float32 and not numerics(kernels_act="fp32").int8_act
    assert not numerics(kernels="torch").native and numerics(dtype=torch.bfloat16).kv_dtype == torch.bfloat16
    assert numerics(kv_cache_dtype="q8_0").kv_dtype == kv_quant.Q8_0
    assert not numerics(kv_cache_dtype="float32").decode_bf16          # the products need a bf16 cache
    assert not numerics(head_dim=16).decode_bf16 and numerics(head_dim=16).extend_bf16
    assert numerics(tp_reduce_chunks=4, tp_size=2).reduce_chunks == 4
    assert not numerics(tp_reduce_chunks=4, tp_size=2, batch_invariant=False).prefill_bf16


def test_a_choice_asked_where_it_cannot_run_is_an_error():
    with pytest.raises(ValueError, match="prefill_act='bf16' needs"):
        numerics(int8_blocks=False, prefill_act="bf16", batch_invariant=False)
    with pytest.raises(ValueError, match="decode_attention='bf16' needs"):
        numerics(EPYC, head_dim=16, decode_attention="bf16")
    with pytest.raises(ValueError, match="prefill_attention='bf16' needs"):
        numerics(AVX2, prefill_attention="bf16")
    with pytest.raises(ValueError, match="multiple of 32"):
        numerics(head_dim=16, kv_cache_dtype="q8_0")


class Ranks:
    """A stand-in for a group of ranks: min_int gives the least of this rank's value and the others' (theirs
    in the order the calls come)."""

    def __init__(self, *others: Cpu):
        self.others = [[ISAS.index(r.isa), r.avx512_bf16, r.amx] for r in others]   # Cpu.agreed's order

    def min_int(self, v: int) -> int:
        return min([v] + [int(o.pop(0)) for o in self.others])


def test_every_rank_decides_alike():
    """A rank on another CPU says no for all: the record follows the agreed facts, the same on each rank."""
    assert AMX.agreed(None) == AMX and every_rank(None, 3, True) == (3, True)
    assert AMX.agreed(Ranks(EPYC)) == EPYC and EPYC.agreed(Ranks(AMX)) == EPYC
    assert AMX.agreed(Ranks(EPYC, AVX2)) == AVX2
    both = [numerics(AMX.agreed(Ranks(other)), batch_invariant=False) for other in (AMX, EPYC)]
    assert both[0].prefill_bf16 and not both[1].prefill_bf16
    assert not native_kernels(options(), AMX.agreed(Ranks(NO_LIBRARY)), CPU, torch.float32)


def test_the_fingerprint_hashes_what_resolve_reads():
    """Every option the record is resolved from is hashed (an option added to NumericOptions is so at once),
    and the same field names mean the same on EngineConfig and RunnerSpec."""
    from tandem.device.runner_spec import RunnerSpec
    names = {f.name for f in dataclasses.fields(NumericOptions)}
    assert names <= set(ARITHMETIC_FIELDS)
    assert names <= {f.name for f in dataclasses.fields(RunnerSpec)}
    assert names <= {f.name for f in dataclasses.fields(EngineConfig)}
