"""Compile csrc/*.cpp into one shared library that registers torch.ops.tandem.* (no ninja, no pybind).

The library is keyed by a hash of the sources, the torch version and the compiler, and cached in
``_build/`` beside this file (or $TANDEM_KERNELS_BUILD), so `make install` builds it once and every later
import (the device process included) only loads it. Building takes ~1 min on 2 cores; a file lock makes
concurrent first imports wait for one build. `python -m tandem.kernels.build` builds it (the Makefile does).
"""
from __future__ import annotations

import concurrent.futures
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCES = ("isa.cpp", "linear_rows.cpp", "dequantize.cpp", "linear_rows_q8act.cpp", "gemm_rows_q8act.cpp",
           "gemv_rows_q8act.cpp", "pack_gemv.cpp", "gemv_packed_q8act.cpp", "gemv_packed_k_q8act.cpp", "k8_spec.cpp", "packed_x.cpp",
           "packed_gather.cpp", "decode_attention.cpp", "shared_prefix_attention.cpp", "causal_attention.cpp",
           "extend_attention.cpp", "rms_norm.cpp", "rope.cpp", "act_mul.cpp", "race_argmax.cpp", "race_noise.cpp",
           "gated_delta_rule.cpp", "gated_delta_rule_chunked.cpp",
           "decode_layer.cpp", "moe_experts.cpp", "moe_route.cpp", "int8_peak.cpp", "registration.cpp")
FLAGS = ("-O3", "-std=c++20", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-Wall", "-Wno-unused-function", "-Wno-psabi",
         "-Wno-maybe-uninitialized")


def compiler() -> str | None:
    cxx = os.environ.get("CXX") or "c++"
    return shutil.which(cxx) or shutil.which("g++")


def build_dir() -> str:
    env = os.environ.get("TANDEM_KERNELS_BUILD")
    return env or os.path.join(os.path.dirname(os.path.abspath(__file__)), "_build")


def _compile_flags() -> list[str]:
    import torch
    from torch.utils.cpp_extension import include_paths
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    incs = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}", f"-I{CSRC}"]
    return [*FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *incs]


def _key(cxx: str) -> str:
    import torch
    h = hashlib.sha256()
    for name in sorted(os.listdir(CSRC)):
        with open(os.path.join(CSRC, name), "rb") as f:
            h.update(name.encode() + f.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h.update(f"{torch.__version__}|{version}|{FLAGS}|{sys.version_info[:2]}".encode())
    return h.hexdigest()[:16]


def library_path() -> str | None:
    """Where the library for these sources lives (built or not); None without a C++ compiler."""
    cxx = compiler()
    return None if cxx is None else os.path.join(build_dir(), f"tandem_kernels-{_key(cxx)}.so")


def compile_jobs() -> int:
    """Compiler processes at a time: one a core, and none past ~1 GiB of available memory each (a source's
    cc1plus takes ~0.5 GiB; all sources at once on a small machine beside another build ran it out of memory)."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) // 2 ** 20 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        pass
    return max(1, min(os.cpu_count() or 1, avail if avail is not None else 4))


def build(verbose: bool = False) -> str:
    """Build the library if it is not cached; return its path. Raises RuntimeError when it cannot."""
    from torch.utils.cpp_extension import library_paths
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++: apt-get install -y g++, or `make install`)")
    path = library_path()
    if os.path.exists(path):
        return path
    os.makedirs(build_dir(), exist_ok=True)
    with open(os.path.join(build_dir(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(path):                 # another process built it while we waited
            return path
        log.warning("building tandem native kernels with %s (once, ~1 min)", cxx)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=build_dir())
        try:
            flags = _compile_flags()
            objs = [os.path.join(tmp, src + ".o") for src in SOURCES]

            def compile_one(src: str, obj: str) -> subprocess.CompletedProcess:
                return subprocess.run([cxx, *flags, "-c", os.path.join(CSRC, src), "-o", obj],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            # a compiler process per source, compile_jobs() at a time
            with concurrent.futures.ThreadPoolExecutor(compile_jobs()) as pool:
                done = list(pool.map(compile_one, SOURCES, objs))
            for src, res in zip(SOURCES, done):
                if res.returncode != 0:
                    raise RuntimeError(f"compiling {src} failed:\n{res.stdout}")
                if verbose and res.stdout:
                    print(res.stdout, file=sys.stderr)
            libs = [f"-L{d}" for d in library_paths()] + [f"-Wl,-rpath,{d}" for d in library_paths()]
            so = os.path.join(tmp, "lib.so")
            res = subprocess.run([cxx, "-shared", "-fopenmp", *objs, "-o", so, *libs, "-lc10", "-ltorch_cpu"],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"linking failed:\n{res.stdout}{res.stderr}")
            os.chmod(so, 0o755)
            os.replace(so, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(build(verbose=True))
