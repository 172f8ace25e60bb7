"""The numeric path, decided once: Numerics, the record of every choice that picks an arithmetic (the kernels,
the activation type, how a long prefill chunk and a decode row attend, the bf16 choices, the KV cache's element
type, batch invariance, tp reduction chunks, the linear layers' delta rule in chunks), made by one function,
resolve(), from three inputs:

- the engine options that pick an arithmetic (NumericOptions: the same fields on EngineConfig and RunnerSpec;
  it rejects a value or combination no machine could run as the engine is configured: EngineConfig builds one),
- what the CPU offers (Cpu: the native ops' body, AVX512-BF16, AMX tiles), and
- what the loaded weights say (int8 blocks, head_dim, whether the bf16 copies fit in memory).

Every tp rank and pipeline stage resolves the same record: the facts that can differ between ranks (the CPU's,
the free memory) are first made every rank's least (every_rank: a rank on another CPU, without the library or
with less memory says no for all). The model runner resolves it and hands it to the model (llama.py) and its
attention (attention_paths.py), which read it and decide nothing; the system fingerprint (tandem/fingerprint.py)
hashes the options and the CPU facts this module reads, beside the weights.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from .. import kernels
from ..kernels import kv_quant

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_KV_DTYPE = torch.bfloat16      # kv_cache_dtype "auto" where the linears round (resolve)
ISAS = ("torch", *kernels.ISA_NAMES)   # the native ops' bodies, lowest first ("torch": no library loaded)
# Numerics.linear_chunk where the native ops run without batch invariance: the faster of 32 and 64 on
# Qwen3.6-35B-A3B's heads (~2x the recurrent op at 512 tokens, 64 a little less: results/delta_rule_chunked.md)
LINEAR_CHUNK = 32


def every_rank(group: Any, *values: int) -> tuple[int, ...]:
    """The rule that every tp rank and pipeline stage decides alike: each value becomes its least over the ranks
    (`group.min_int`), so a flag holds only where it holds on every rank; as is without a group."""
    return values if group is None else tuple(group.min_int(int(v)) for v in values)


@dataclass(frozen=True)
class Cpu:
    """What the machine offers the "auto" choices: the body the native ops run (kernels.isa(), which TANDEM_ISA
    caps; "torch" where the library is not loaded), AVX512-BF16 (vdpbf16ps: bf16 products) and AMX-BF16 tiles
    (oneDNN's bf16 GEMM and SDPA)."""
    isa: str
    avx512_bf16: bool
    amx: bool

    @classmethod
    def probe(cls, library: bool = True) -> "Cpu":
        """This process's CPU; library=False leaves the native library alone (not built, not loaded: "torch")."""
        return cls(kernels.isa() if library and kernels.available() else "torch",
                   bool(torch.cpu._is_avx512_bf16_supported()), bool(torch.cpu._is_amx_tile_supported()))

    def agreed(self, group: Any) -> "Cpu":
        """Every rank's least (every_rank): the lowest body and a feature only where each rank has it."""
        isa, bf16, amx = every_rank(group, ISAS.index(self.isa), self.avx512_bf16, self.amx)
        return Cpu(ISAS[isa], bool(bf16), bool(amx))


@dataclass(frozen=True)
class NumericOptions:
    """The engine options that pick an arithmetic: all resolve() reads of an EngineConfig or a RunnerSpec (whose
    fields of these names mean the same), and what the fingerprint hashes of them (besides dtype, device and
    the tp / pp sizes, which act outside the record)."""
    kernels: str                # "native": tandem's C++ ops on GGUF blocks; "torch"
    kernels_act: str            # "int8": quantized linears round x to int8 blocks; "fp32": the exact mode
    kv_cache_dtype: str         # "auto", "float32", "bfloat16", "float16", "q8_0"
    prefill_act: str            # long prefill chunks' linears and attention: "auto", "bf16", "int8"
    prefill_attention: str      # the native extend op's products: "auto", "bf16", "fp32"
    decode_attention: str       # the native decode (and causal) op's products: "auto", "bf16", "fp32"
    batch_invariant: bool       # every token attends with the decode op's arithmetic (attention_paths.py)
    tp_reduce_chunks: int       # o and down in this many column chunks, added in order (row_parallel.py); 0: off

    def __post_init__(self) -> None:
        """Each option's values, and the combinations no CPU or model could run: an error as the engine is
        configured (EngineConfig), before anything starts."""
        if self.kernels not in ("native", "torch"):
            raise ValueError(f"kernels must be 'native' or 'torch', got {self.kernels!r}")
        if self.kernels_act not in ("fp32", "int8"):
            raise ValueError(f"kernels_act must be 'fp32' or 'int8', got {self.kernels_act!r}")
        if self.prefill_act not in ("auto", "bf16", "int8"):
            raise ValueError(f"prefill_act must be 'auto', 'bf16' or 'int8', got {self.prefill_act!r}")
        if self.prefill_act != "auto" and (self.kernels_act != "int8" or self.kernels != "native"):
            raise ValueError(f"prefill_act={self.prefill_act!r} needs kernels='native' and kernels_act='int8': "
                             f"the exact mode (kernels_act='fp32') and the torch path keep every linear and "
                             f"attention in fp32")
        if self.batch_invariant and self.prefill_act == "bf16":
            raise ValueError("prefill_act='bf16' gives a long chunk's rows other bits than a short chunk's: it "
                             "needs batch_invariant=False (--no-batch-invariant)")
        for name in ("prefill_attention", "decode_attention"):
            value = getattr(self, name)
            if value not in ("auto", "bf16", "fp32"):
                raise ValueError(f"{name} must be 'auto', 'bf16' or 'fp32', got {value!r}")
            if value == "bf16" and (self.kernels_act != "int8" or self.kernels != "native"):
                raise ValueError(f"{name}='bf16' needs kernels='native' and kernels_act='int8': the exact mode "
                                 f"(kernels_act='fp32') and the torch path attend in fp32")
        if self.kv_cache_dtype not in ("auto", *DTYPES, "q8_0"):
            raise ValueError(f"kv_cache_dtype must be auto/float32/bfloat16/float16/q8_0, got {self.kv_cache_dtype!r}")
        if self.tp_reduce_chunks > 0 and self.prefill_act == "bf16":
            raise ValueError("tp_reduce_chunks fixes the bits of o and down; prefill_act='bf16' would give long "
                             "chunks other ones: use prefill_act 'auto' or 'int8'")

    @classmethod
    def of(cls, config: Any) -> "NumericOptions":
        return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Numerics:
    """The numeric path of one model runner (resolve()). The defaults are the torch path in fp32; a test may
    build a model with e.g. Numerics(native=True, int8_act=True)."""
    native: bool = False            # tandem's C++ ops (kernels="native", a CPU, fp32, the library on every rank)
    int8_act: bool = False          # quantized linears round x to int8 blocks (kernels_act="int8"); else exact
    dtype: torch.dtype = torch.float32      # weights and activations
    kv_dtype: torch.dtype = torch.float32   # the KV cache's element type (kv_quant.Q8_0: q8_0 blocks)
    batch_invariant: bool = False   # every token attends with the decode op's arithmetic (attention_paths.py)
    prefill_bf16: bool = False      # a long prefill chunk runs its linears (bf16 copies) and attention in bf16
    bf16_sdpa: bool = False         # ... and attends by bf16 SDPA on AMX tiles, not by the native extend op
    extend_bf16: bool = False       # the native extend op takes bf16 products (queries, probabilities; fp32 sums)
    decode_bf16: bool = False       # the native decode and causal ops take bf16 products
    reduce_chunks: int = 0          # tp_reduce_chunks: o and down in this many chunks over all tp ranks; 0: off
    linear_chunk: int = 0           # prefill rows' delta rule in chunks of this many tokens (the native chunked
                                    # op: faster, bits follow where chunks start); 0: token by token everywhere

    @property
    def extend_native(self) -> bool:
        """A long chunk attends by a native op (the causal op under batch_invariant, else the extend op)."""
        return self.native and not self.bf16_sdpa

    @property
    def extend_dtype(self) -> torch.dtype:
        """The dtype SDPA and the cascade attend a long chunk in (the torch path, bf16 SDPA)."""
        return torch.bfloat16 if self.prefill_bf16 else self.dtype


def resolve(options: NumericOptions, cpu: Cpu, device: torch.device, dtype: torch.dtype, head_dim: int,
            int8_blocks: bool, bf16_fits: bool) -> Numerics:
    """The one decision. cpu: every rank's (Cpu.agreed). int8_blocks: the weights as loaded hold blocks whose
    linears round x to int8 (kernels.quant.INT8_ACT_QTYPES), looked at before any sharding so every rank sees the
    same. bf16_fits: the layers' bf16 copies (prefill_bf16) take at most a quarter of the free memory on every
    rank. A choice asked for explicitly where it cannot run is a ValueError, not a silent other path."""
    o = options
    native = native_kernels(o, cpu, device, dtype)
    if o.kernels == "native" and not wants_native(o, device, dtype):
        log.info("native kernels are CPU fp32 only; %s %s uses the torch path", device.type, dtype)
    rounds = native and int8_blocks             # the linears round x to int8 already
    kv_dtype = _kv_dtype(o, rounds, device, dtype, head_dim)
    prefill_bf16 = _prefill_bf16(o, cpu, rounds, device, bf16_fits) and native     # rounds: native already
    batch_invariant = o.batch_invariant and native
    # Where prefill_bf16 has AMX tiles for its bf16 SDPA, the extend op gives way to it (not under batch_invariant)
    bf16_sdpa = native and not batch_invariant and prefill_bf16 and cpu.amx
    extend_bf16 = _bf16_products(o, "prefill_attention", cpu, rounds, device, kv_dtype, head_dim, 16)
    decode_bf16 = _bf16_products(o, "decode_attention", cpu, rounds, device, kv_dtype, head_dim, 32)
    # The delta rule's chunked form gives a token bits that follow where its row's chunks start: not under
    # batch_invariant; a native op only (the torch path runs the recurrent reference)
    linear_chunk = LINEAR_CHUNK if native and not batch_invariant else 0
    return Numerics(native=native, int8_act=o.kernels_act == "int8", dtype=dtype, kv_dtype=kv_dtype,
                    batch_invariant=batch_invariant, prefill_bf16=prefill_bf16, bf16_sdpa=bf16_sdpa,
                    extend_bf16=extend_bf16 and native and not bf16_sdpa, decode_bf16=decode_bf16 and native,
                    reduce_chunks=o.tp_reduce_chunks, linear_chunk=linear_chunk)


def wants_native(o: NumericOptions, device: torch.device, dtype: torch.dtype) -> bool:
    """kernels="native" where the native ops run: a CPU, in fp32 (the model runner loads the library only then:
    Cpu.probe)."""
    return o.kernels == "native" and device.type == "cpu" and dtype == torch.float32


def native_kernels(o: NumericOptions, cpu: Cpu, device: torch.device, dtype: torch.dtype) -> bool:
    """Numerics.native, before the weights load (they stay GGUF blocks only for the native ops): wanted, and the
    library loaded on every rank (cpu: Cpu.agreed)."""
    return wants_native(o, device, dtype) and cpu.isa != "torch"


def _kv_dtype(o: NumericOptions, rounds: bool, device: torch.device, dtype: torch.dtype,
              head_dim: int) -> torch.dtype:
    """The KV cache's element type (q8_0: uint8 blocks, kernels/kv_quant.py). "auto": bfloat16 on CPU where the
    linears already round (native kernels, int8 activations, quantized weights: rounds): half the bytes a decode
    step reads, and the accuracy gate of benchmarks/kl_divergence.py holds (docs/performance.md). Else the model
    dtype: the exact mode (kernels_act="fp32") and unquantized weights keep fp32 keys and values (parity with
    transformers)."""
    if o.kv_cache_dtype == "q8_0":
        kv_quant.row_bytes(head_dim)            # a clear error where head_dim is no multiple of 32
        return kv_quant.Q8_0
    if o.kv_cache_dtype != "auto":
        return DTYPES[o.kv_cache_dtype]
    if rounds and o.kernels_act == "int8" and device.type == "cpu":
        return AUTO_KV_DTYPE
    return dtype


def _prefill_bf16(o: NumericOptions, cpu: Cpu, rounds: bool, device: torch.device, bf16_fits: bool) -> bool:
    """Do long prefill chunks run bf16 GEMMs and bf16 attention (prefill_act, LlamaModel)? "auto": yes on a CPU
    with AMX-BF16 tiles (torch's oneDNN GEMM runs them: 4x the int8 GEMM's rate at 924 rows, and the KL gate of
    benchmarks/kl_divergence.py holds, benchmarks/results/prefill_bf16.md) where the linears round already
    (rounds) and their bf16 copies take at most a quarter of the free memory (bf16_fits); int8 elsewhere (AVX2
    and AVX-512-only CPUs: not measured faster there) and under batch_invariant (a long chunk's bf16 rows would
    differ from a short chunk's int8 ones) or tp_reduce_chunks."""
    act = o.prefill_act
    if act == "int8" or o.kernels_act != "int8" or o.batch_invariant or o.tp_reduce_chunks:
        return False
    if not rounds or device.type != "cpu":
        if act == "bf16":
            raise ValueError("prefill_act='bf16' needs a quantized (GGUF) model on the CPU with native kernels "
                             "and kernels_act='int8'")
        return False
    if act == "bf16":
        return True
    # TANDEM_ISA=avx2 (an ISA below AVX-512) caps this choice too, so such a run is the AVX2 engine's
    return cpu.amx and cpu.avx512_bf16 and cpu.isa == "avx512" and bf16_fits


def _bf16_products(o: NumericOptions, option: str, cpu: Cpu, rounds: bool, device: torch.device,
                   kv_dtype: torch.dtype, head_dim: int, multiple: int) -> bool:
    """Does a native attention op take bf16 products (queries and probabilities rounded to bf16 for the
    products, every sum fp32, as prefill_act="bf16"'s SDPA)? `option` "prefill_attention": the extend op (long
    chunks without batch_invariant), its body needs head_dim % 16 == 0; 1.5-1.6x the op's fp32 rate on an AMD
    EPYC (benchmarks/extend_attention.py; KL gate: results/kl_divergence_extend_bf16.md). "decode_attention":
    the decode op (decode and verify rows; generated tokens recomputed; without batch_invariant prompt chunks
    of up to small_m() tokens) and its causal form, head_dim % 32 == 0; 1.30x less time than the fp32 op on 32
    rows sharing a 930-token prefix, 1.08-1.15x on unshared rows, which wait on memory (AMD EPYC,
    results/decode_attention_bf16.md; KL gate: results/kl_divergence_decode_bf16.md); a row's output is still
    the same bits in any batch (the op's invariant). "auto": yes where the linears round x to int8 already
    (rounds, kernels_act="int8"), the KV cache is bf16 and the CPU has AVX512-BF16 under the AVX-512 body."""
    want = getattr(o, option)
    if want == "fp32" or o.kernels_act != "int8":
        return False
    yes = (rounds and device.type == "cpu" and kv_dtype == torch.bfloat16 and head_dim % multiple == 0
           and cpu.isa == "avx512" and cpu.avx512_bf16)
    if want == "bf16" and not yes:
        raise ValueError(f"{option}='bf16' needs a quantized (GGUF) model on a CPU with AVX512-BF16, native "
                         f"kernels, kernels_act='int8', a bfloat16 KV cache and a head_dim the op takes "
                         f"(a multiple of {multiple})")
    return yes
