"""OpenAI's system_fingerprint: a short hash of everything that decides a response's bits.

With batch invariance (model/attention_paths.py) a request's tokens and logprobs are a function of the request (its
prompt, sampling parameters and seed) and of what this hash covers: the model file's bytes, tandem's version and its
Python sources (which op a token takes is decided there: a change of rule moves the hash where the version string
stays), the native kernels' build (their sources, the compiler and its flags: the compiler decides where a product
and a sum fuse into one fma), and the two inputs of the numeric record (model/numerics.py) besides the weights:
the CPU's facts (Cpu: the kernel body it runs, TANDEM_ISA included, and the features "auto" choices follow,
AVX512-BF16 and AMX) and the engine options that pick an arithmetic (NumericOptions: kernel and activation modes,
KV cache dtype, bf16 prefill and products, batch_invariant, tp_reduce_chunks), with dtype, device and the tensor
and pipeline parallel sizes (not the tensor-parallel size under tp_reduce_chunks, which gives every tp size
dividing it the same bits). Options that change no bit (the loop, thread counts, batch sizes, the prefix cache,
speculation) are left out, so two servers that differ only there answer alike and say so. README states the
limits of the promise.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os

from . import __version__
from .config import EngineConfig
from .model.numerics import Cpu, NumericOptions

# What resolve() reads (model/numerics.py: the record of the numeric path), and what acts beside the record
ARITHMETIC_FIELDS = (*(f.name for f in dataclasses.fields(NumericOptions)), "dtype", "device", "tp_size", "pp_size")
SAMPLES = 16                  # 64 KiB pieces spread over a weight file, besides its first MiB and its size
SAMPLE_BYTES = 1 << 16


def file_digest(path: str) -> str:
    """sha256 of a weight file's size, its first MiB (a GGUF's metadata and tensor index) and 16 pieces spread
    over the rest: a few MB read whatever the file's size, and any other quantization, fine-tune or shard
    changes it."""
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        for i in range(SAMPLES):
            f.seek(size * i // SAMPLES)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def source_digest(root: str) -> str:
    """sha256 of the .py files under root (their paths relative to it, in sorted order, and their bytes)."""
    h = hashlib.sha256()
    files = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, names in os.walk(root)
                   for f in names if f.endswith(".py"))
    for rel in files:
        h.update(rel.encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def package_digest() -> str:
    """source_digest of the tandem package this process runs (once a process: ~2 MB read)."""
    return source_digest(os.path.dirname(os.path.abspath(__file__)))


def kernel_build() -> str | None:
    """The loaded native library's name, which holds its build key (kernels/build.py: its sources, compiler
    version, flags and torch's)."""
    from .kernels.library import loaded_library
    path = loaded_library()
    return None if path is None else os.path.basename(path)


def system_fingerprint(config: EngineConfig, weight_files: tuple[str, ...] | list[str]) -> str:
    """"fp_" and 12 hex digits of the hash of what decides the bits (the module docstring)."""
    cpu = Cpu.probe()
    what = {
        "tandem": __version__,
        "sources": package_digest(),
        "weights": [file_digest(p) for p in sorted(weight_files)],
        "cpu": dataclasses.asdict(cpu),             # the facts the numeric record's "auto" choices follow
        "kernel_build": kernel_build() if cpu.isa != "torch" else None,
        "options": {f: getattr(config, f) for f in ARITHMETIC_FIELDS
                    if not (f == "tp_size" and config.tp_reduce_chunks)},   # then every tp size gives the same bits
    }
    return "fp_" + hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:12]
