"""The sampling defaults a model ships: what its authors tuned it to be sampled with, used by the server where a
request leaves a field out (`tandem serve --generation-config auto`, vLLM's default; `none` keeps tandem's own).

Where they are: a Hugging Face folder's generation_config.json (temperature, top_p, top_k, min_p,
repetition_penalty), a GGUF's `general.sampling.*` keys (temp, top_p, top_k, min_p, penalty_repeat: what
llama.cpp's convert script writes from that file). Values of the wrong type are left out, with a warning: a
model's metadata must never make every request fail.
"""
from __future__ import annotations

import json
import logging
import os

from .loader import ModelSource

log = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GGUF_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
             "top_k": "general.sampling.top_k", "min_p": "general.sampling.min_p",
             "repetition_penalty": "general.sampling.penalty_repeat"}


def sampling_defaults(source: ModelSource) -> dict:
    """{field: value} for the FIELDS the model's files set ({} where none)."""
    if source.gguf_file is not None:
        from .gguf.file import GGUFFile
        f = GGUFFile(source.gguf_file)
        raw = {name: f.field(key) for name, key in GGUF_KEYS.items()}
        raw = {k: float(f"{v:.7g}") if isinstance(v, float) else v for k, v in raw.items()}   # fp32 -> its decimal
    else:
        path = os.path.join(os.path.dirname(source.weight_files[0]), "generation_config.json")
        if not os.path.isfile(path):
            return {}
        with open(path) as fh:
            gen = json.load(fh)
        raw = {name: gen.get(name) for name in FIELDS}
    out = {}
    for name, value in raw.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (name == "top_k" and value != int(value)):
            log.warning("ignoring the model's sampling default %s=%r: not a number", name, value)
            continue
        out[name] = int(value) if name == "top_k" else float(value)
    return out
