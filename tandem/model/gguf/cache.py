"""The cache of a GGUF file's config and tokenizer (a few MB), under ``<cache>/gguf-v2-<sha256>/``
(``cached_gguf_dir``): transformers takes seconds to build a tokenizer from GGUF metadata. The weights are never
cached; write_fp32_safetensors writes them for peers that cannot read GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time

from ..config import ModelConfig
from .config import read_gguf_config
from .file import GGUFFile
from .weights import build_gguf_tokenizer, gguf_state_dict

# Bump when the cache entry's contents change, so old caches are not reused (v1 held an fp32
# model.safetensors: 538 MB for the 96 MB default model; v2 holds no weights).
CACHE_FORMAT = 2


def cache_gguf_metadata(path: str, out_dir: str) -> None:
    """Write config.json, tokenizer/ and source.json for a GGUF file into out_dir (a few MB: no weights)."""
    reader = GGUFFile(path)
    config = read_gguf_config(reader)
    build_gguf_tokenizer(path, os.path.join(out_dir, "tokenizer"), reader, config)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=2)
    with open(os.path.join(out_dir, "source.json"), "w") as f:
        json.dump({"gguf_file": os.path.abspath(path), "cache_format": CACHE_FORMAT}, f, indent=2)


def write_fp32_safetensors(path: str, config: ModelConfig, out_file: str) -> None:
    """The dequantized weights as one safetensors file (atomically), for engines that cannot read GGUF
    (`tandem bench peers`); only written when asked for."""
    from safetensors.torch import save_file

    sd = gguf_state_dict(GGUFFile(path), config)
    tmp = f"{out_file}.{os.getpid()}.tmp"
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_file)


def file_sha256(path: str, cache_root: str) -> str:
    """sha256 of a file, memoized under cache_root by (path, size, mtime)."""
    st = os.stat(path)
    key = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    memo = os.path.join(cache_root, "sha256", hashlib.sha256(key.encode()).hexdigest())
    try:
        with open(memo) as f:
            digest = f.read().strip()
        if len(digest) == 64:
            return digest
    except OSError:
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    digest = h.hexdigest()
    os.makedirs(os.path.dirname(memo), exist_ok=True)
    tmp = f"{memo}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(digest)
    os.replace(tmp, memo)
    return digest


def _complete(d: str) -> bool:
    return all(os.path.exists(os.path.join(d, n)) for n in ("config.json", "source.json", "tokenizer"))


def cached_gguf_dir(path: str, cache_root: str) -> str:
    """Directory holding the GGUF's config and tokenizer; written (atomically) on a miss."""
    os.makedirs(cache_root, exist_ok=True)
    final = os.path.join(cache_root, f"gguf-v{CACHE_FORMAT}-{file_sha256(path, cache_root)}")
    if _complete(final):
        return final
    if os.path.exists(final):  # not written by us (renames are atomic); move it aside
        shutil.rmtree(final, ignore_errors=True)
    _clean_stale_tmp(cache_root)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=cache_root)
    try:
        cache_gguf_metadata(path, tmp)
        _make_readable(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _make_readable(d: str) -> None:
    """mkdtemp (and safetensors) create owner-only modes; make the cache entry world-readable."""
    for root, _dirs, files in os.walk(d):
        os.chmod(root, 0o755)
        for n in files:
            os.chmod(os.path.join(root, n), 0o644)


def _clean_stale_tmp(cache_root: str, max_age_s: float = 24 * 3600) -> None:
    now = time.time()
    for n in os.listdir(cache_root):
        p = os.path.join(cache_root, n)
        if n.startswith(".tmp-"):
            try:
                if now - os.stat(p).st_mtime > max_age_s:
                    shutil.rmtree(p, ignore_errors=True)
            except OSError:
                pass
