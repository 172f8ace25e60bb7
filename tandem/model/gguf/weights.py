"""A llama.cpp GGUF file's weights as the HF-named state dict, and its tokenizer (the metadata's meaning, and the
tensor names, are config.py's).

The GGUF is the weights: every load maps the file and reads its tensors from there (native types stay blocks).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Container

import numpy as np
import torch

from gguf.constants import GGMLQuantizationType

from ..config import ModelConfig
from ..weights import expected_weight_shapes, in_layers, name_list, split_fused
from .config import STACKED, STACKED_BIAS, dequantize_f32, get_field, gguf_to_hf_name, unpermute_qk
from .file import GGUFFile
from .gemma4 import FUSED_EXPERTS

log = logging.getLogger(__name__)

LARGE_FILE_BYTES = 200 << 20          # loads of larger files show a progress bar at once


def _progress(reader, what: str):
    """A byte progress bar on stderr: at once for a file over LARGE_FILE_BYTES, else only past 3 s."""
    from tqdm import tqdm

    size = os.path.getsize(reader.path)
    return tqdm(total=sum(t.nbytes for t in reader.tensors), unit="B", unit_scale=True, file=sys.stderr,
                desc=f"{what} {os.path.basename(reader.path)}", delay=0 if size > LARGE_FILE_BYTES else 3,
                leave=False)


def gguf_state_dict(reader, config: ModelConfig, keep: frozenset[int] = frozenset(),
                    layers: Container[int] | None = None) -> dict:
    """Every tensor under its HF name (q/k un-permuted for llama), read from the file's memory map: fp32, or,
    for 2-D tensors whose ggml type is in `keep`, the GGUF blocks as a tandem.kernels.QuantWeight (rows are
    whole blocks along K, so the q/k row permutation applies to the bytes unchanged). Blocks are not copied
    where QuantWeight keeps the GGUF's row bytes and no permutation applies; every other tensor is one
    vectorized pass (a regrouping, or gguf-py's dequantization).

    Blocks kept as views (Q2_K, Q3_K, Q6_K, F16, BF16 rows not permuted or fused) hold the map, which is
    copy-on-write: a write to one stays private, the file is never written. Measured on SmolLM2 as F16 (258 MB):
    views against copies, 2.39 s against 2.93 s warm to ready, device RSS 517 MB (290 anonymous) against 540 (452),
    peak 541 MB against 756; the mapped pages are clean and shared with the page cache (and other processes that
    map the file: dp replicas, tp ranks). layers: gguf_weights'."""
    from ...kernels.quant import QuantWeight

    shapes = {k: v for k, v in expected_weight_shapes(config).items() if in_layers(k, layers)}
    out: dict = {}
    with _progress(reader, "loading") as bar:
        for t in reader.tensors:
            name = gguf_to_hf_name(t.name, config.architecture)
            if name is None or _layer(name) >= config.num_layers or not in_layers(name, layers):   # (MTP layers)
                bar.update(t.nbytes)
                continue
            if name.endswith(STACKED + (FUSED_EXPERTS,)):    # a 3-D block of every expert: one entry per expert
                out.update(_experts(t, name, shapes, t.qtype in keep))
                bar.update(t.nbytes)
                continue
            if name.endswith(STACKED_BIAS):             # gpt-oss: every expert's bias [E, n], one entry each
                a = dequantize_f32(t)
                out.update({name.replace(".experts.", f".experts.{e}."): torch.from_numpy(np.array(a[e], np.float32))
                            for e in range(a.shape[0])})
                bar.update(t.nbytes)
                continue
            if name.endswith("linear_attn.in_proj_ba.weight"):        # Qwen3-Next's b and a, split as HF's are
                for k, w in split_fused(name, _tensor(t, t.qtype in keep), config):
                    out[k] = w
                bar.update(t.nbytes)
                continue
            if name not in shapes:
                raise ValueError(f"GGUF tensor {t.name!r} ({name}) does not fit the model config")
            if name.endswith("conv1d.weight"):                   # stored squeezed: [C, width]
                out[name] = _tensor(t, False).reshape(shapes[name])
                bar.update(t.nbytes)
                continue
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
            if config.norm_offset and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                out[name] -= config.norm_offset          # llama.cpp stores gemma's (1 + w); HF names mean w
            if name.endswith(".A_log"):                  # llama.cpp stores A = -exp(A_log)
                out[name] = torch.log(-out[name].double()).float()
            bar.update(t.nbytes)
    reader.drop_pages()                      # nothing was written yet; the views fault back what they read
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"GGUF file lacks tensors for: {name_list(missing)}")
    return out


def _layer(name: str) -> int:
    """The layer of a model.layers.<i>. ... name (-1 for the others)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[:2] == ["model", "layers"] else -1


def _tensor(t, quantized: bool):
    """One GGUF tensor as GGUF blocks (a QuantWeight) or fp32 of its own."""
    from ...kernels.quant import QuantWeight
    if quantized and len(t.shape) == 2:
        return QuantWeight.from_gguf(torch.from_numpy(t.data), t.qtype, t.shape[1])
    return torch.from_numpy(np.array(dequantize_f32(t), dtype=np.float32, order="C"))


def _experts(t, name: str, shapes: dict, quantized: bool) -> dict:
    """A 3-D expert block [E, rows, K] (ffn_gate_exps / ffn_up_exps / ffn_down_exps, or gemma4's ffn_gate_up_exps
    whose rows are an expert's gate then its up) as one matrix per expert and projection, under the per-expert
    names: GGUF blocks keep expert e's rows (contiguous bytes of the file: a view where QuantWeight keeps the
    GGUF's bytes), other types are dequantized."""
    from ...kernels.quant import QuantWeight

    n_exp, rows, k = t.shape if len(t.shape) == 3 else (0, 0, 0)
    prefix, proj = name[:name.index(".experts.")], name.split(".")[-2]      # model.layers.N.mlp, gate_proj
    projs = ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)
    part = rows // len(projs)                                               # an expert's rows of one projection
    names = {(e, j): f"{prefix}.experts.{e}.{p}.weight" for e in range(n_exp + 1) for j, p in enumerate(projs)}
    beyond = [names.pop((n_exp, j)) for j in range(len(projs))]
    if len(t.shape) != 3 or rows % len(projs) or any(shapes.get(n) != (part, k) for n in names.values()) \
            or any(n in shapes for n in beyond):
        raise ValueError(f"GGUF tensor {t.name!r}: shape {t.shape} does not fit the model config's experts")
    if quantized:                                           # t.data: [E rows, row bytes]
        return {n: QuantWeight.from_gguf(torch.from_numpy(t.data[e * rows + j * part:e * rows + (j + 1) * part]),
                                         t.qtype, k) for (e, j), n in names.items()}
    a = dequantize_f32(t)
    return {n: torch.from_numpy(np.array(a[e, j * part:(j + 1) * part], dtype=np.float32, order="C"))
            for (e, j), n in names.items()}


def gguf_weights(path: str, config: ModelConfig, quantized: bool = False, layers: Container[int] | None = None) -> dict:
    """The state dict, straight from the GGUF file. quantized (the native kernels): matrices of a type in
    NATIVE_QTYPES (F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4) stay GGUF blocks,
    the rest fp32; otherwise (the torch reference) everything is dequantized in memory, by gguf-py. layers: only
    these decoder layers' tensors (a pipeline stage's), besides the others (embedding, norm, head)."""
    from ...kernels.quant import NATIVE_QTYPES

    reader = GGUFFile(path)
    if not quantized:
        return gguf_state_dict(reader, config, layers=layers)
    other = sorted({GGMLQuantizationType(t.qtype).name for t in reader.tensors if len(t.shape) == 2
                    and t.qtype not in NATIVE_QTYPES})
    if other:
        log.info("GGUF matrices of type %s have no native kernel: dequantized to fp32 at load", ", ".join(other))
    return gguf_state_dict(reader, config, keep=NATIVE_QTYPES, layers=layers)


def build_gguf_tokenizer(path: str, out_dir: str, reader, config: ModelConfig) -> None:
    """Build the HF tokenizer (with chat template) from the GGUF metadata and save it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # gpt-oss, gemma4: AutoTokenizer first parses the file's whole config, and transformers (5.2x) fails on
    # gpt-oss's rope.scaling keys there (it reads a key's length for its value) and on gemma4's head_count_kv one a
    # layer (a list where its config wants an int); the tokenizer itself needs none of it
    cls = PreTrainedTokenizerFast if config.architecture in ("gpt_oss", "gemma4") else AutoTokenizer
    tok = cls.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path), local_files_only=True)
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
