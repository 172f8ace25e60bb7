"""Read a llama.cpp GGUF file: config, HF-named weights, tokenizer.

The GGUF is the weights: every load maps the file and reads its tensors from there (native types stay
blocks). Only the config and the tokenizer (a few MB) are cached, under ``<cache>/gguf-v2-<sha256>/``
(``cached_gguf_dir``), because transformers takes seconds to build a tokenizer from GGUF metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

from gguf.constants import GGMLQuantizationType

from .config import SUPPORTED_HF_ARCHITECTURES, ModelConfig
from .gguf_file import GGUFError, GGUFFile  # noqa: F401  (GGUFError: what a broken file raises)

log = logging.getLogger(__name__)

# Bump when the cache entry's contents change, so old caches are not reused (v1 held an fp32
# model.safetensors: 538 MB for the 96 MB default model; v2 holds no weights).
CACHE_FORMAT = 2
LARGE_FILE_BYTES = 200 << 20          # loads of larger files show a progress bar at once
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
# llama.cpp hard-codes what gemma3 GGUF files do not store: every 6th layer global, local RoPE base 10k.
GEMMA3_SLIDING_PATTERN = 6
GEMMA3_LOCAL_ROPE_THETA = 10_000.0

_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# gemma3's sandwich norms: llama.cpp's ffn_norm is the pre-MLP norm, post_attention_norm the one after attention.
_GEMMA3_BLOCK_NAMES = {**_BLOCK_NAMES,
                       "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                       "post_attention_norm.weight": "post_attention_layernorm.weight",
                       "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED = {"rope_freqs.weight"}  # folded into ModelConfig.rope_scaling
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """HF state-dict key for a GGUF tensor name of architecture `arch` (None for tensors we drop)."""
    if name in _IGNORED or re.match(r"^blk\.\d+\.attn_rot_embd$", name):
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLK_RE.match(name)
    names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise ValueError(f"unexpected tensor {name!r} in GGUF file")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's convert-time q/k row permutation.

    llama.cpp: ``w.reshape(n_head, 2, rows//n_head//2, *rest).swapaxes(1, 2).reshape(w.shape)``
    (HF's rotate-half layout -> interleaved pairs); this maps it back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute tensor with {rows} rows for {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    return reader.field(key, default)


def _f32(x) -> float:
    """Shortest decimal that round-trips a float32 metadata value (9.99e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _llama3_rope_scaling(freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict:
    """Recover the HF llama3 rope_scaling dict from llama.cpp's rope_freqs tensor."""
    factor = float(freqs.max())
    cand = {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    inv = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old = cand["original_max_position_embeddings"]
    lo_wl, hi_wl = old / cand["low_freq_factor"], old / cand["high_freq_factor"]
    expect = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            expect.append(1.0)
        elif wl > lo_wl:
            expect.append(factor)
        else:
            s = (old / wl - cand["low_freq_factor"]) / (cand["high_freq_factor"] - cand["low_freq_factor"])
            expect.append(1 / ((1 - s) / factor + s))
    if freqs.shape != (head_dim // 2,) or not np.allclose(freqs, expect, rtol=1e-4):
        raise ValueError("GGUF rope_freqs tensor does not match llama3 RoPE scaling with "
                         "low_freq_factor=1, high_freq_factor=4, original context 8192")
    return cand


def read_gguf_config(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} "
                         f"(HF: {', '.join(SUPPORTED_HF_ARCHITECTURES)})")

    def req(key: str):
        v = _field(reader, f"{arch}.{key}")
        if v is None:
            raise ValueError(f"GGUF file is missing metadata key {arch}.{key!s}")
        return v

    tensors = {t.name: t for t in reader.tensors}
    hidden = int(req("embedding_length"))
    n_head = int(req("attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0)
                   or _field(reader, f"{arch}.rope.dimension_count", 0) or hidden // n_head)
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = reader.count("tokenizer.ggml.tokens") or int(tensors["token_embd.weight"].shape[0])
    rope_theta = _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0))

    scaling = None
    stype = _field(reader, f"{arch}.rope.scaling.type")
    if stype in ("linear", "yarn"):
        scaling = {"rope_type": stype, "factor": _f32(req("rope.scaling.factor"))}
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if stype == "yarn" and orig:
            scaling["original_max_position_embeddings"] = int(orig)
    elif stype not in (None, "none"):
        raise ValueError(f"unsupported GGUF rope scaling type {stype!r}")
    elif _field(reader, f"{arch}.rope.scale_linear") not in (None, 1.0):
        scaling = {"rope_type": "linear", "factor": _f32(_field(reader, f"{arch}.rope.scale_linear"))}
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        freqs = np.asarray(_dequant(t), dtype=np.float64).reshape(-1)
        scaling = _llama3_rope_scaling(freqs, rope_theta, head_dim)

    extra = _arch_switches(reader, arch, tensors, int(req("block_count")), head_dim)
    eos_ids = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        v = _field(reader, key)
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    bos = _field(reader, "tokenizer.ggml.bos_token_id")

    return ModelConfig(
        architecture="llama" if arch == "mistral" else arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_layers=int(req("block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=_f32(req("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(req("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        rope_scaling=scaling,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
        **extra,
    )


def _arch_switches(reader, arch: str, tensors: dict, num_layers: int, head_dim: int) -> dict:
    """The ModelConfig switches of a GGUF architecture beyond llama's (see ModelConfig)."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    out: dict = {}
    if "blk.0.attn_q_norm.weight" in tensors:
        out["qk_norm"] = True
    if arch == "gemma3":
        pattern = _field(reader, f"{arch}.attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
        if isinstance(pattern, list):           # newer llama.cpp: one bool per layer, True = sliding
            types = ["sliding_attention" if p else "full_attention" for p in pattern]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(num_layers)]
        if window is None:
            raise ValueError("GGUF file is missing metadata key gemma3.attention.sliding_window")
        local_theta = _f32(_field(reader, f"{arch}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA))
        out.update(sliding_window=int(window), layer_types=tuple(types), rope_local_theta=local_theta,
                   norm_offset=1.0, sandwich_norm=True, hidden_act="gelu_tanh", embed_scale=True,
                   query_pre_attn_scalar=float(head_dim))
    elif window and arch in ("mistral", "llama"):
        out["sliding_window"] = int(window)
    return out


def _dequant(t) -> np.ndarray:
    """fp32 of a GGUFTensor, numpy-shaped; F32 stays a view of the file's map (copy-on-write)."""
    if t.qtype == 0:
        return t.data.view(np.float32).reshape(t.shape)
    from gguf.quants import dequantize

    return dequantize(t.data, t.qtype).reshape(t.shape)


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
    from ..kernels.quant import QuantWeight
    from .loader import expected_weight_shapes

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
            a = t.data if quantized else _dequant(t)                    # blocks: [rows, row bytes] uint8
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
    from ..kernels.quant import NATIVE_QTYPES

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
    template = _field(reader, "tokenizer.chat_template")
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
