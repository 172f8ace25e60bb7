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

import logging
from dataclasses import dataclass

import torch

from ..kernels.quant import BLOCK_WEIGHTS, QuantWeight
from .config import ModelConfig

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
    return why


def check_tp_size(c: ModelConfig, n: int, name: str = "the model") -> None:
    """A clear ValueError when the model's shapes do not split over n ranks."""
    if n > 1 and c.linear_layers:
        raise ValueError(f"tp_size {n}: {name} is a hybrid linear-attention model ({c.architecture}), whose Gated "
                         f"DeltaNet layers do not split over tensor-parallel ranks yet; serve it with tp_size 1 "
                         f"(pp_size may split its layers)")
    why = _fits(c, n)
    if why:
        ok = [k for k in range(1, c.num_heads + 1) if not _fits(c, k)]
        raise ValueError(f"tp_size {n} does not fit {name}: {'; '.join(why)} "
                         f"(tp sizes that fit it: {', '.join(map(str, ok))})")


@dataclass(frozen=True)
class TPLayout:
    """What rank `rank` of `size` holds: its heads, KV heads, MLP rows and vocab rows."""
    size: int
    rank: int
    heads: int
    head_start: int
    kv_heads: int
    kv_head_start: int
    inter: int
    inter_start: int
    vocab: int               # rows of this rank's vocab shard (padded: the same on every rank)
    vocab_start: int
    moe_inter: int = 0       # rows of each expert's gate / up (columns of its down) on this rank
    moe_inter_start: int = 0
    experts: int = 0         # experts held on this rank (whole, or split by moe_inter)
    expert_start: int = 0
    expert_parallel: bool = False   # whole experts a rank, a range of them on each

    @property
    def held_experts(self) -> range | None:
        """This rank's whole experts under expert parallelism; None: it holds (a slice of) every expert."""
        return range(self.expert_start, self.expert_start + self.experts) if self.expert_parallel else None

    @staticmethod
    def of(c: ModelConfig, size: int, rank: int) -> "TPLayout":
        check_tp_size(c, size)
        heads = c.num_heads // size
        if c.num_kv_heads % size == 0:
            kv, kv_start = c.num_kv_heads // size, rank * (c.num_kv_heads // size)
        else:                                  # replicated: size / KVH ranks share each KV head
            kv, kv_start = 1, rank // (size // c.num_kv_heads)
        inter = c.intermediate_size // size
        vocab = -(-c.vocab_size // size)
        if c.num_experts % size == 0:          # expert parallelism: whole experts, blocks as the file has them
            moe, moe_start = c.moe_intermediate_size, 0
            experts, expert_start = c.num_experts // size, rank * (c.num_experts // size)
        else:                                  # every expert split by its intermediate rows
            moe, moe_start = c.moe_intermediate_size // size, rank * (c.moe_intermediate_size // size)
            experts, expert_start = c.num_experts, 0
        return TPLayout(size, rank, heads, rank * heads, kv, kv_start, inter, rank * inter, vocab, rank * vocab,
                        moe, moe_start, experts, expert_start, experts < c.num_experts)


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
    d = c.head_dim
    q = (lay.head_start * d, (lay.head_start + lay.heads) * d)
    kv = (lay.kv_head_start * d, (lay.kv_head_start + lay.kv_heads) * d)
    mlp = (lay.inter_start, lay.inter_start + lay.inter)
    experts = (lay.moe_inter_start, lay.moe_inter_start + lay.moe_inter)
    vocab = (lay.vocab_start, min(lay.vocab_start + lay.vocab, c.vocab_size))
    out, cut = {}, []
    for name in list(state):
        t = state.pop(name)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = _rows(t, *vocab, pad_to=lay.vocab)
        elif ".experts." in name:               # before the dense MLP's names, which an expert's also match
            if lay.held_experts is not None:   # whole experts a rank: this rank's, as they are; not the others'
                if int(name.split(".experts.")[1].split(".")[0]) in lay.held_experts:
                    out[name] = t
            else:
                out[name] = cols(t, *experts, cut, name) if ".down_proj." in name else _rows(t, *experts)
        elif ".q_proj." in name:
            out[name] = _rows(t, *q)
        elif ".k_proj." in name or ".v_proj." in name:
            out[name] = _rows(t, *kv)
        elif ".gate_proj." in name or ".up_proj." in name:
            out[name] = _rows(t, *mlp)
        elif ".o_proj." in name:
            out[name] = cols(t, *q, cut, name)
        elif ".down_proj." in name:
            out[name] = cols(t, *mlp, cut, name)
        else:                                  # norms: every rank keeps them whole
            out[name] = t
    if cut and lay.rank == 0:
        log.warning("tp_size %d cuts the GGUF blocks (32 weights along K) of %d row-parallel weights (%s ...): "
                    "their slices are dequantized to fp32 (more memory, the fp32 GEMM)", lay.size, len(cut), cut[0])
    return out
