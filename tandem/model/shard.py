"""Tensor-parallel layout of one rank and the slicing of its weights (Megatron style, as SGLang and vLLM do).

Column-parallel (output rows split): q/k/v by heads, gate/up by intermediate rows. Row-parallel (input
columns split, partial sums all-reduced): o and down. Experts: whole experts a rank (expert parallelism: rank r
holds experts [r E / n, (r + 1) E / n) with their blocks as the file has them) where tp_size divides the expert
count, else each expert split by its own intermediate rows like the dense MLP. Measured on a Qwen3-30B-A3B-shaped
Q4_K_M file at tp 2 (benchmarks/results/moe_tp.md): splitting the expert width of 768 cuts the down experts'
256-weight super-blocks, so they were held and read as fp32 (5-7x their bytes). Either way the router is whole on
each rank, so all route alike, and the layer's weighted sum of each rank's part is all-reduced like down's.
Vocab-parallel: the embedding and LM head by vocab rows (padded to equal shards, so the logits gather is even).
KV heads are split when tp_size divides them and replicated when tp_size is a multiple of them (each rank keeps
the one KV head its query heads read).

The whole state is read, then sliced (every rank of a node reads the file; fine for the models this engine
runs on CPU). GGUF blocks slice by rows freely; a row-parallel slice keeps its blocks only when it cuts K on
a 32-weight block boundary, and is dequantized otherwise (logged).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ..kernels.quant import BLOCK_WEIGHTS, QuantWeight
from .config import ModelConfig
from .weights import layer_index

log = logging.getLogger(__name__)


def _fits(c: ModelConfig, n: int) -> list[str]:
    """Why tp_size n does not fit this model (empty: it fits)."""
    why = []
    if c.num_heads % n:
        why.append(f"its {c.num_heads} attention heads are not divisible by {n}")
    if c.num_kv_heads % n and n % c.num_kv_heads:
        why.append(f"its {c.num_kv_heads} KV heads neither divide nor are divisible by {n}")
    if c.intermediate_size % n:
        why.append(f"its MLP width {c.intermediate_size} is not divisible by {n}")
    if c.num_experts and c.num_experts % n and c.moe_intermediate_size % n:
        why.append(f"neither its {c.num_experts} experts nor their width {c.moe_intermediate_size} "
                   f"are divisible by {n}")
    if c.shared_expert_intermediate_size % n:
        why.append(f"its shared expert's width {c.shared_expert_intermediate_size} is not divisible by {n}")
    if c.linear_layers and c.linear_num_key_heads % n:
        why.append(f"its {c.linear_num_key_heads} linear-attention key heads are not divisible by {n}")
    if c.global_kv_heads and c.global_kv_heads % n and n % c.global_kv_heads:
        why.append(f"its full layers' {c.global_kv_heads} KV heads neither divide nor are divisible by {n}")
    if c.num_kv_shared_layers and c.double_wide_mlp and (2 * c.intermediate_size) % n:
        why.append(f"its KV-shared layers' MLP width {2 * c.intermediate_size} is not divisible by {n}")
    return why


def check_tp_size(c: ModelConfig, n: int, name: str = "the model") -> None:
    """A clear ValueError when the model's shapes do not split over n ranks."""
    why = _fits(c, n)
    if why:
        ok = [k for k in range(1, c.num_heads + 1) if not _fits(c, k)]
        raise ValueError(f"tp_size {n} does not fit {name}: {'; '.join(why)} "
                         f"(tp sizes that fit it: {', '.join(map(str, ok))})")


@dataclass(frozen=True)
class TPLayout:
    """What rank `rank` of `size` holds: its heads, KV heads, vocab rows and experts (a layer's share of its own
    MLP width and head shapes: shard_state)."""
    size: int
    rank: int
    heads: int
    head_start: int
    kv_heads: int
    kv_head_start: int
    vocab: int               # rows of this rank's vocab shard (padded: the same on every rank)
    vocab_start: int
    moe_inter: int = 0       # rows of each expert's gate / up (columns of its down) on this rank
    moe_inter_start: int = 0
    experts: int = 0         # experts held on this rank (whole, or split by moe_inter)
    expert_start: int = 0
    expert_parallel: bool = False   # whole experts a rank, a range of them on each
    shared_inter: int = 0    # rows of the shared expert's gate / up (columns of its down) on this rank
    linear_k_heads: int = 0  # a hybrid's Gated DeltaNet key heads on this rank, and the value heads they serve
    linear_k_start: int = 0

    def local(self, c: ModelConfig) -> ModelConfig:
        """The config as this rank's linear-attention layers and state pool see it: its heads only."""
        if not c.linear_layers or self.size == 1:
            return c
        r = c.linear_num_value_heads // c.linear_num_key_heads
        return dataclasses.replace(c, linear_num_key_heads=self.linear_k_heads,
                                   linear_num_value_heads=self.linear_k_heads * r)

    def layer_kv(self, c: ModelConfig, layer: int) -> tuple[int, int]:
        """(KV heads, first KV head) of `layer` on this rank: gemma4's full layers split their own count."""
        return _kv_split(c.layer_kv_heads(layer), self.size, self.rank)

    def kv_shapes(self, c: ModelConfig, layers) -> list[tuple[int, int]]:
        """(KV heads on this rank, head dim) of each of `layers` that holds KV, in order: the attention layers but
        gemma4's KV-shared ones. The KV cache (one cache a shape) and the model's layer["kv"] indices follow it."""
        return [(self.layer_kv(c, i)[0], c.layer_head_dim(i)) for i in layers
                if not c.is_linear(i) and c.kv_source(i) == i]

    @property
    def held_experts(self) -> range | None:
        """This rank's whole experts under expert parallelism; None: it holds (a slice of) every expert."""
        return range(self.expert_start, self.expert_start + self.experts) if self.expert_parallel else None

    @staticmethod
    def of(c: ModelConfig, size: int, rank: int) -> "TPLayout":
        check_tp_size(c, size)
        heads = c.num_heads // size
        kv, kv_start = _kv_split(c.num_kv_heads, size, rank)
        vocab = -(-c.vocab_size // size)
        if c.num_experts % size == 0:          # expert parallelism: whole experts, blocks as the file has them
            moe, moe_start = c.moe_intermediate_size, 0
            experts, expert_start = c.num_experts // size, rank * (c.num_experts // size)
        else:                                  # every expert split by its intermediate rows
            moe, moe_start = c.moe_intermediate_size // size, rank * (c.moe_intermediate_size // size)
            experts, expert_start = c.num_experts, 0
        lk = c.linear_num_key_heads // size
        return TPLayout(size, rank, heads, rank * heads, kv, kv_start, vocab, rank * vocab,
                        moe, moe_start, experts, expert_start, experts < c.num_experts,
                        c.shared_expert_intermediate_size // size, lk, rank * lk)


def _kv_split(kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """(KV heads, first KV head) a rank holds: a share of them, or (fewer heads than ranks) one, replicated on
    size / KVH ranks."""
    if kv_heads % size == 0:
        return kv_heads // size, rank * (kv_heads // size)
    return 1, rank // (size // kv_heads)


def _rows(t, a: int, b: int, pad_to: int | None = None):
    """Rows [a, b) of a weight or bias (zero rows appended up to pad_to)."""
    if isinstance(t, QuantWeight):
        data = t.data[a:b]
        if pad_to is not None and pad_to > data.shape[0]:
            data = torch.cat([data, data.new_zeros(pad_to - data.shape[0], data.shape[1])])
        return QuantWeight(data.contiguous(), t.qtype, t.k)
    part = t[a:b]
    if pad_to is not None and pad_to > part.shape[0]:
        part = torch.cat([part, part.new_zeros(pad_to - part.shape[0], *part.shape[1:])])
    return part.contiguous()


def cols(t, a: int, b: int, cut: list[str], name: str):
    """Columns [a, b) (the input features of a row-parallel weight); `cut` collects the dequantized ones."""
    if not isinstance(t, QuantWeight):
        return t[:, a:b].contiguous()
    qk = BLOCK_WEIGHTS[t.qtype]                 # 256 for K-quants: a cut inside a super-block dequantizes
    if a % qk or b % qk:
        cut.append(name)
        return t.dequantize()[:, a:b].contiguous()
    blocks = t.to_gguf()
    bb = blocks.shape[1] // (t.k // qk)
    part = blocks.view(blocks.shape[0], -1, bb)[:, a // qk:b // qk].reshape(blocks.shape[0], -1)
    return QuantWeight.from_gguf(part.contiguous(), t.qtype, b - a)


def shard_state(state: dict, c: ModelConfig, lay: TPLayout) -> dict:
    """This rank's slice of an HF-named state dict (tensors or QuantWeight); the input is consumed."""
    g = 2 if c.attn_output_gate else 1              # a gated q_proj: each head's q and gate rows together
    shared = (lay.rank * lay.shared_inter, (lay.rank + 1) * lay.shared_inter)
    linear = _linear_index(c, lay) if c.linear_layers and lay.size > 1 else None
    experts = (lay.moe_inter_start, lay.moe_inter_start + lay.moe_inter)
    vocab = (lay.vocab_start, min(lay.vocab_start + lay.vocab, c.vocab_size))
    out, cut = {}, []
    for name in list(state):
        t = state.pop(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(t, *vocab, pad_to=lay.vocab)
        elif ".linear_attn." in name:
            out[name] = _linear_part(name, t, linear, cut) if linear is not None else t
        elif ".shared_expert." in name:         # split by its width, as the dense MLP
            out[name] = cols(t, *shared, cut, name) if ".down_proj." in name else _rows(t, *shared)
        elif ".experts." in name:               # before the dense MLP's names, which an expert's also match
            if lay.held_experts is not None:   # whole experts a rank: this rank's, as they are; not the others'
                if int(name.split(".experts.")[1].split(".")[0]) in lay.held_experts:
                    out[name] = t
            elif name.endswith("down_proj.bias"):
                out[name] = _once(t, lay)
            else:
                out[name] = cols(t, *experts, cut, name) if ".down_proj." in name else _rows(t, *experts)
        elif name.endswith((".o_proj.bias", ".down_proj.bias")):     # a row-parallel linear's bias: added once
            out[name] = _once(t, lay)
        elif name.endswith(".self_attn.sinks"):     # gpt-oss: one a query head
            out[name] = _rows(t, lay.head_start, lay.head_start + lay.heads)
        elif ".q_proj." in name:
            out[name] = _rows(t, *_q_part(c, lay, name, g))
        elif ".k_proj." in name or ".v_proj." in name:
            out[name] = _rows(t, *_kv_part(c, lay, name))
        elif ".gate_proj." in name or ".up_proj." in name:
            out[name] = _rows(t, *_mlp_part(c, lay, name))
        elif ".o_proj." in name:
            out[name] = cols(t, *_q_part(c, lay, name), cut, name)
        elif ".down_proj." in name:
            out[name] = cols(t, *_mlp_part(c, lay, name), cut, name)
        else:                                  # norms: every rank keeps them whole
            out[name] = t
    if cut and lay.rank == 0:
        log.warning("tp_size %d cuts the GGUF blocks (32 weights along K) of %d row-parallel weights (%s ...): "
                    "their slices are dequantized to fp32 (more memory, the fp32 GEMM)", lay.size, len(set(cut)), cut[0])
    return out


def _q_part(c: ModelConfig, lay: TPLayout, name: str, g: int = 1) -> tuple[int, int]:
    """q's rows (o's columns) of this rank's heads in its layer, at the layer's head dim (gemma4's full layers have
    their own); g: rows a head holds per dim (2: a gated q_proj's q and gate)."""
    d = c.layer_head_dim(layer_index(name)) * g
    return lay.head_start * d, (lay.head_start + lay.heads) * d


def _kv_part(c: ModelConfig, lay: TPLayout, name: str) -> tuple[int, int]:
    """k / v's rows of this rank in its layer: its KV heads (gemma4's full layers split their own count) at the
    layer's head dim."""
    i = layer_index(name)
    kv, start = lay.layer_kv(c, i)
    d = c.layer_head_dim(i)
    return start * d, (start + kv) * d


def _mlp_part(c: ModelConfig, lay: TPLayout, name: str) -> tuple[int, int]:
    """The dense MLP's rows (columns of down) of this rank in its layer: twice as many in gemma4's double-wide ones."""
    w = c.mlp_width(layer_index(name))
    return lay.rank * w // lay.size, (lay.rank + 1) * w // lay.size


def _once(bias: torch.Tensor, lay: TPLayout) -> torch.Tensor:
    """A row-parallel linear's bias as a rank holds it: whole on rank 0, zeros on the others (the ranks' outputs
    are summed)."""
    return bias if lay.rank == 0 else torch.zeros_like(bias)


def _linear_index(c: ModelConfig, lay: TPLayout) -> dict:
    """Which rows (channels, heads) of a Gated DeltaNet layer this rank holds: its key heads' q and k, and the value
    heads they serve. HF's order groups a key head's value heads together (a range); llama.cpp's Qwen3.5 files tile
    them (value head j * key heads + g reads key head g): the same heads, in the same tiled order locally."""
    nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
    r, keys = nv // nk, range(lay.linear_k_start, lay.linear_k_start + lay.linear_k_heads)
    heads = ([j * nk + g for j in range(r) for g in keys] if c.linear_value_heads_tiled
             else [g * r + j for g in keys for j in range(r)])
    heads_t = torch.tensor(heads)
    qk = torch.cat([torch.arange(g * dk, (g + 1) * dk) for g in keys])
    v = (heads_t[:, None] * dv + torch.arange(dv)).reshape(-1)
    return {"heads": heads_t, "v": v, "qkv": torch.cat([qk, nk * dk + qk, 2 * nk * dk + v])}


def _linear_part(name: str, t, index: dict, cut: list[str]):
    """This rank's part of a linear-attention tensor (_linear_index): rows of the projections and the conv, its
    value heads' A / dt_bias, out_proj's columns of its value heads (the partial sums all-reduced)."""
    from .linear import take_rows
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return take_rows(t, index["qkv"])
    if name.endswith("in_proj_z.weight"):
        return take_rows(t, index["v"])
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", ".A_log", ".dt_bias")):
        return take_rows(t, index["heads"])
    if name.endswith("out_proj.weight"):
        cols_ = index["v"]
        if not isinstance(t, QuantWeight):
            return t[:, cols_].contiguous()
        # its value heads' columns, run by run (tiled: one run a value head per key head), each cut as cols()
        # cuts (whole blocks where the run's ends fall on block boundaries, else dequantized)
        ends = (torch.nonzero(cols_[1:] != cols_[:-1] + 1).reshape(-1) + 1).tolist()
        runs = [cols(t, int(cols_[a]), int(cols_[b - 1]) + 1, cut, name) for a, b in zip([0] + ends, ends + [len(cols_)])]
        if all(isinstance(r, QuantWeight) for r in runs):
            return QuantWeight.from_gguf(torch.cat([r.to_gguf() for r in runs], dim=1).contiguous(), t.qtype,
                                         len(cols_))
        return torch.cat([r.dequantize() if isinstance(r, QuantWeight) else r for r in runs], dim=1)
    return t                                    # the gated norm's weight: per head dim, whole on every rank
