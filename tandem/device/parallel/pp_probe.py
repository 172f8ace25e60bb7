"""What a pipeline stage's layers and the head cost on this machine, measured before the stages load (pp_split.py).

Rank 0 builds a model runner of one layer of each kind (ProbeStage: a first-and-last "stage" of those layers,
alone, so the model builds exactly as a stage does), with the head and the embedding, from the same file. It
prefills `batch` rows of PROMPT tokens, then times decode steps of those rows with the device's threads; the
urgent-step hook (`between(i)`, before layer i > 0) and wrappers around the embedding and the head mark where each
layer ends, so one step gives every layer's time, the embedding's and the head's (final norm, LM head, sampler).
Each part's least time over REPS steps is kept: the scheduler loading its tokenizer and the other stages starting
run beside the probe, and can only add time. A layer's kind is what changes its cost: linear attention or not,
experts or not, sliding or not, head dim, KV heads, MLP width and the block types of its matrices (a Q4_K_M file
gives some layers Q6_K down projections). Past MAX_KINDS kinds, a layer is costed as the measured layer of its
shape scaled by its bytes.

Decode at the PP loop's micro-batch size is what is balanced: PP serves throughput, and a prefill step's head runs on
a row's last token only, so a split good for decode costs prefill little. One layer of weights may sit in the
cache where a stage's many would not: on models whose layers fit the cache the probe sees them a little cheaper.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import numpy as np
import torch

from ...model.weights import layer_index

PROMPT = 16             # prompt tokens a probe row holds before its decode steps
WARMUP, REPS = 2, 7     # decode steps run before timing, and timed
MAX_KINDS = 8           # layers the probe builds at most


@dataclasses.dataclass
class ProbeStage:
    """A pipeline stage that is the whole pipeline (first and last) over some layers, alone: the model runner builds
    and runs it as a stage, with no group to agree with."""
    layers: Sequence[int]
    device: torch.device
    first: bool = True
    last: bool = True
    spans_nodes: bool = False
    size: int = 1
    rank: int = 0

    @staticmethod
    def min_int(v: int) -> int:
        return v


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Seconds of one decode step at the probe's batch: each layer's, the embedding's (the first stage's) and the
    final norm, LM head and sampler's (the last stage's)."""
    layers: list[float]
    embed: float
    head: float
    batch: int


def layer_kinds(c, index: dict[str, tuple[str, int]]) -> tuple[list[tuple], list[int]]:
    """Each layer's kind, and its weight bytes: from the config and its matrices' block types (weight_index)."""
    types: list[dict] = [{} for _ in range(c.num_layers)]
    size = [0] * c.num_layers
    for k, (kind, nbytes) in index.items():
        i = layer_index(k)
        if i is not None and i < c.num_layers:
            suffix = ".".join(p for p in k.split(".")[3:] if not p.isdigit())     # experts' names as one
            types[i][suffix] = kind
            size[i] += nbytes
    kinds = [(c.is_linear(i), c.is_moe(i), c.window(i) > 0, c.layer_head_dim(i), c.layer_kv_heads(i),
              c.mlp_width(i), tuple(sorted(types[i].items()))) for i in range(c.num_layers)]
    return kinds, size


def representatives(kinds: list[tuple]) -> list[int]:
    """The first layer of each kind, at most MAX_KINDS: each shape (a kind less its block types) first."""
    firsts: dict[tuple, int] = {}
    for i, k in enumerate(kinds):
        firsts.setdefault(k, i)
    shapes: dict[tuple, int] = {}
    for k, i in firsts.items():
        shapes.setdefault(k[:-1], i)
    reps = list(shapes.values())[:MAX_KINDS]
    reps += [i for i in firsts.values() if i not in reps][:MAX_KINDS - len(reps)]
    return sorted(reps)


def spread(kinds: list[tuple], size: list[int], reps: list[int], measured: dict[int, float]) -> list[float]:
    """Every layer's cost from the measured ones: its kind's, else its shape's scaled by its bytes, else the
    measured layers' mean cost per byte times its bytes."""
    by_kind = {kinds[i]: measured[i] for i in reps}
    by_shape: dict[tuple, int] = {}
    for i in reps:
        by_shape.setdefault(kinds[i][:-1], i)
    per_byte = sum(measured.values()) / max(1, sum(size[i] for i in reps))
    out = []
    for i, k in enumerate(kinds):
        if k in by_kind:
            out.append(by_kind[k])
        elif k[:-1] in by_shape:
            j = by_shape[k[:-1]]
            out.append(measured[j] * size[i] / max(1, size[j]))
        else:
            out.append(per_byte * size[i])
    return out


def weight_index(source) -> dict[str, tuple[str, int]]:
    """Every weight's (block type, bytes) under its contract name, from the file's header alone (nothing loaded)."""
    from ...model.weights import hf_weight_name
    out: dict[str, tuple[str, int]] = {}
    if source.gguf_file is not None:
        from ...model.gguf.config import gguf_to_hf_name
        from ...model.gguf.file import GGUFFile
        for t in GGUFFile(source.gguf_file).tensors:
            name = gguf_to_hf_name(t.name, source.config.architecture)
            if name is not None:
                out[name] = (str(t.qtype), int(t.nbytes))
        return out
    from safetensors import safe_open
    for f in source.weight_files:
        with safe_open(f, "pt") as st:
            for k in st.keys():
                part = st.get_slice(k)
                kind = part.get_dtype()                  # "F32", "BF16", "F8_E4M3", "BOOL": bits before the "_"
                bits = int("".join(ch for ch in kind.split("_")[0] if ch.isdigit()) or 8)
                out[hf_weight_name(k)] = (kind, int(np.prod(part.get_shape())) * bits // 8)
    return out


def _step(batch: int, stride: int, n: int | None, vocab: int):
    """The probe's prefill (n None) or its n-th decode step over rows 1..batch (row r's slots from (r - 1) stride)."""
    from ...sampler import draw_seeds
    from ..step import StepInput
    rows = np.arange(1, batch + 1)
    base = (rows - 1) * stride
    if n is None:
        ext, seq, fut = np.full(batch, PROMPT), np.full(batch, PROMPT), np.zeros(batch, np.int64)
        ids = 1 + np.arange(batch * PROMPT) % (vocab - 1)
        loc = (base[:, None] + np.arange(PROMPT)).reshape(-1)
    else:
        ext, seq, fut = np.ones(batch, np.int64), np.full(batch, PROMPT + n + 1), np.ones(batch, np.int64)
        ids, loc = np.zeros(batch, np.int64), base + PROMPT + n
    zeros = np.zeros(batch)
    return StepInput(step_id=0, rows=rows, extend_lens=ext, seq_lens=seq, use_future=fut, input_ids=ids,
                     out_cache_loc=loc, temperature=zeros, top_p=zeros + 1, top_k=np.full(batch, -1), min_p=zeros,
                     draw_seed=draw_seeds(rows, seq), poison_rows=np.zeros(0, np.int64))


def _timed(model) -> list[float]:
    """Marks every step appends to: embedding start and end, the layer boundaries (between), head start."""
    marks: list[float] = []
    embed, logits = model._embed, model.logits

    def timed_embed(ids):
        marks.append(time.perf_counter())
        x = embed(ids)
        marks.append(time.perf_counter())
        return x

    def timed_logits(x):
        marks.append(time.perf_counter())
        return logits(x)
    model._embed, model.logits = timed_embed, timed_logits
    return marks


def measure(spec, device: torch.device, batch: int) -> StageCosts:
    """One decode step's costs at `batch` rows (the module docstring)."""
    from ...model.loader import load_weights
    from ...model.numerics import DTYPES, Cpu, NumericOptions, native_kernels, wants_native
    from ..model_runner import ModelRunner
    c = spec.source.config
    index = weight_index(spec.source)
    kinds, size = layer_kinds(c, index)
    reps = representatives(kinds)
    options, dtype = NumericOptions.of(spec), DTYPES[spec.dtype]
    native = native_kernels(options, Cpu.probe(library=wants_native(options, device, dtype)), device, dtype)
    stride = PROMPT + WARMUP + REPS + 1
    probe = dataclasses.replace(spec, max_running=batch, spare_rows=0, max_draft_rows=0, kv_cache_tokens=batch * stride,
                                max_model_len=stride, pp_size=1)
    runner = ModelRunner(probe, state=load_weights(spec.source, quantized=native, layers=reps),
                         pp=ProbeStage(reps, device))
    marks = _timed(runner.model)
    runner.run(_step(batch, stride, None, c.vocab_size))
    steps = []
    for n in range(WARMUP + REPS):
        marks.clear()
        runner.run(_step(batch, stride, n, c.vocab_size), between=lambda i: marks.append(time.perf_counter()))
        marks.append(time.perf_counter())
        # marks: embed start, embed end, layer 1 .. n - 1 starts, head start, step end
        steps.append(np.diff(marks))
    t = np.min(np.array(steps[WARMUP:]), axis=0)        # the others at start (tokenizer, stages) only add
    measured = dict(zip(reps, t[1:-1].tolist()))
    return StageCosts(spread(kinds, size, reps, measured), float(t[0]), float(t[-1]), batch)
