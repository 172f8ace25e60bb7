"""llama.cpp's own C++ tools (llama-bench, llama-server), built for this CPU from the llama.cpp source that ships
in llama-cpp-python's sdist, so tandem is compared with the engine users run, not with its Python binding (which
adds Python work per token).

The sdist comes from the package registry (`pip download --no-binary :all:`), the tools are built once with cmake
(-DGGML_NATIVE=ON: the instructions this CPU has) under the cache folder and reused: ~10 minutes on 2 cores.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile

LLAMA_CPP_PYTHON = "0.3.36"
TARGETS = ("llama-bench", "llama-server")


def default_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tandem", "llamacpp")


def build_tools(root: str | None = None, version: str = LLAMA_CPP_PYTHON, log=print) -> str:
    """The folder of the built tools (building them first where they are missing)."""
    root = root or default_dir()
    src = os.path.join(root, f"llama_cpp_python-{version}", "vendor", "llama.cpp")
    bin_dir = os.path.join(src, "build", "bin")
    if all(os.path.exists(os.path.join(bin_dir, t)) for t in TARGETS):
        return bin_dir
    os.makedirs(root, exist_ok=True)
    if not os.path.isdir(src):
        sdists = glob.glob(os.path.join(root, f"llama_cpp_python-{version}.tar.gz"))
        if not sdists:
            log(f"downloading the llama-cpp-python {version} sdist")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                            f"llama-cpp-python=={version}", "-d", root], check=True)
            sdists = glob.glob(os.path.join(root, f"llama_cpp_python-{version}.tar.gz"))
        with tarfile.open(sdists[0]) as tf:
            tf.extractall(root, filter="data")
    log(f"building {', '.join(TARGETS)} from {src} (cmake, once)")
    build = os.path.join(src, "build")
    _quiet(["cmake", "-S", src, "-B", build, "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"], os.path.join(root, "cmake.log"))
    _quiet(["cmake", "--build", build, "-j", str(os.cpu_count() or 2), "--target", *TARGETS],
           os.path.join(root, "build.log"))
    return bin_dir


def tools_for(model_path: str, choice: str = "auto", log=print) -> tuple[str | None, str | None]:
    """(the folder of llama-bench / llama-server, None), or (None, why there is none) for a peer run on
    `model_path`. choice: "auto" builds them once (cached), "none" skips, else a folder that holds them."""
    if not model_path.endswith(".gguf"):
        return None, "llama.cpp needs a GGUF file; the model is a Hugging Face folder"
    if choice == "none":
        return None, "llama.cpp's C++ tools not asked for (--llama-tools none)"
    if choice != "auto":
        ok = all(os.path.exists(os.path.join(choice, t)) for t in TARGETS)
        return (choice, None) if ok else (None, f"{choice} does not hold {' and '.join(TARGETS)}")
    try:
        return build_tools(log=log), None
    except Exception as e:                       # no compiler, no registry: the peer is skipped, with the reason
        return None, f"building llama.cpp's C++ tools failed: {type(e).__name__}: {e}"


def _quiet(cmd: list[str], log_path: str) -> None:
    """Run a build step with its output (thousands of compiler warnings) in log_path; its tail in the error."""
    with open(log_path, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        with open(log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({rc}); the end of {log_path}:\n{tail}")


def llama_bench(bin_dir: str, model: str, threads: int, prompt: int = 512, gen: int = 64,
                reps: int = 3) -> dict:
    """llama-bench's prefill (pp`prompt`) and decode (tg`gen`) tokens/s, mean and stddev over `reps` runs."""
    out = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", model, "-t", str(threads), "-p", str(prompt),
                          "-n", str(gen), "-r", str(reps), "-o", "json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    res = {}
    for r in rows:
        key = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        res[key] = {"tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"]}
    res["build"] = rows[0].get("build_commit") if rows else None
    return res
