"""Read a llama.cpp GGUF file: HF-named weights, tokenizer, and the cache of both with its config (the
metadata's meaning, and the tensor names, are gguf_config.py's).

The GGUF is the weights: every load maps the file and reads its tensors from there (native types stay
blocks). Only the config and the tokenizer (a few MB) are cached, under ``<cache>/gguf-v2-<sha256>/``
(``cached_gguf_dir``), because transformers takes seconds to build a tokenizer from GGUF metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from gguf.constants import GGMLQuantizationType

from ..config import ModelConfig
from .config import dequantize_f32, get_field, gguf_to_hf_name, read_gguf_config, unpermute_qk
from .file import GGUFError, GGUFFile  # noqa: F401  (GGUFError: what a broken file raises)

log = logging.getLogger(__name__)

# Bump when the cache entry's contents change, so old caches are not reused (v1 held an fp32
# model.safetensors: 538 MB for the 96 MB default model; v2 holds no weights).
CACHE_FORMAT = 2
LARGE_FILE_BYTES = 200 << 20          # loads of larger files show a progress bar at once


def _progress(reader, what: str):
    """A byte progress bar on stderr: at once for a file over LARGE_FILE_BYTES, else only past 3 s."""
    from tqdm import tqdm

    size = os.path.getsize(reader.path)
    return tqdm(total=sum(t.nbytes for t in reader.tensors), unit="B", unit_scale=True, file=sys.stderr,
                desc=f"{what} {os.path.basename(reader.path)}", delay=0 if size > LARGE_FILE_BYTES else 3,
                leave=False)


def gguf_state_dict(reader, config: ModelConfig, keep: frozenset[int] = frozenset()) -> dict:
    """Every tensor under its HF name (q/k un-permuted for llama), read from the file's memory map: fp32, or,
    for 2-D tensors whose ggml type is in `keep`, the GGUF blocks as a tandem.kernels.QuantWeight (rows are
    whole blocks along K, so the q/k row permutation applies to the bytes unchanged). Blocks are not copied
    where QuantWeight keeps the GGUF's row bytes and no permutation applies; every other tensor is one
    vectorized pass (a regrouping, or gguf-py's dequantization).

    Blocks kept as views (Q2_K, Q3_K, Q6_K, F16, BF16 rows not permuted or fused) hold the map, which is
    copy-on-write: a write to one stays private, the file is never written. Measured on SmolLM2 as F16 (258 MB):
    views against copies, 2.39 s against 2.93 s warm to ready, device RSS 517 MB (290 anonymous) against 540 (452),
    peak 541 MB against 756; the mapped pages are clean and shared with the page cache (and other processes that
    map the file: dp replicas, tp ranks)."""
    from ...kernels.quant import QuantWeight
    from ..loader import expected_weight_shapes

    shapes = expected_weight_shapes(config)
    out: dict = {}
    with _progress(reader, "loading") as bar:
        for t in reader.tensors:
            name = gguf_to_hf_name(t.name, config.architecture)
            if name is None:
                bar.update(t.nbytes)
                continue
            if name not in shapes:
                raise ValueError(f"GGUF tensor {t.name!r} ({name}) does not fit the model config")
            if t.shape != shapes[name]:
                raise ValueError(f"GGUF tensor {t.name!r}: shape {t.shape}, expected {shapes[name]}")
            quantized = t.qtype in keep and len(t.shape) == 2
            a = t.data if quantized else dequantize_f32(t)                    # blocks: [rows, row bytes] uint8
            if config.architecture == "llama":
                if ".self_attn.q_proj." in name:
                    a = unpermute_qk(a, config.num_heads)
                elif ".self_attn.k_proj." in name:
                    a = unpermute_qk(a, config.num_kv_heads)
            if quantized:
                out[name] = QuantWeight.from_gguf(torch.from_numpy(a), t.qtype, t.shape[1])
            elif t.qtype == 0:                          # own memory: a norm must not hold the whole map
                out[name] = torch.from_numpy(np.array(a, dtype=np.float32, order="C"))
            else:
                out[name] = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
            if config.norm_offset and name.endswith("norm.weight"):
                out[name] -= config.norm_offset          # llama.cpp stores gemma's (1 + w); HF names mean w
            bar.update(t.nbytes)
    reader.drop_pages()                      # nothing was written yet; the views fault back what they read
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {', '.join(missing[:8])}"
                         + (" ..." if len(missing) > 8 else ""))
    return out


def gguf_weights(path: str, config: ModelConfig, quantized: bool = False) -> dict:
    """The state dict, straight from the GGUF file. quantized (the native kernels): matrices of a type in
    NATIVE_QTYPES (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) stay GGUF blocks, the
    rest fp32; otherwise (the torch reference) everything is dequantized in memory, by gguf-py."""
    from ...kernels.quant import NATIVE_QTYPES

    reader = GGUFFile(path)
    if not quantized:
        return gguf_state_dict(reader, config)
    other = sorted({GGMLQuantizationType(t.qtype).name for t in reader.tensors if len(t.shape) == 2
                    and t.qtype not in NATIVE_QTYPES})
    if other:
        log.info("GGUF matrices of type %s have no native kernel: dequantized to fp32 at load", ", ".join(other))
    return gguf_state_dict(reader, config, keep=NATIVE_QTYPES)


def build_gguf_tokenizer(path: str, out_dir: str, reader, config: ModelConfig) -> None:
    """Build the HF tokenizer (with chat template) from the GGUF metadata and save it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                        local_files_only=True)
    template = get_field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    if reader.count("tokenizer.ggml.tokens"):
        def tok_str(i: int) -> str:
            return reader.string("tokenizer.ggml.tokens", i)
        if config.eos_token_ids and tok.eos_token_id != config.eos_token_ids[0]:
            tok.eos_token = tok_str(config.eos_token_ids[0])
        if config.bos_token_id is not None and tok.bos_token_id != config.bos_token_id:
            tok.bos_token = tok_str(config.bos_token_id)
    tok.save_pretrained(out_dir)


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
