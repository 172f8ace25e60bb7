"""A mixture-of-experts layer (Qwen3-MoE, Mixtral, gpt-oss): a router picks num_experts_per_tok of num_experts gated MLPs
for each token, each chosen expert runs on the tokens routed to it, and their outputs are summed with the router's
weights. It stands in place of the dense MLP of a decoder layer (llama.py).

Batch invariance (attention_paths.py states the rule): a row's routing and its experts' arithmetic depend only
on the row. The router's logits are fp32 products summed along hidden within each (token, expert) pair, never a
GEMM whose kernel follows the row count (native: tandem.moe_route, one chain an expert in order of hidden, and
the routing in the same op; else torch's sum); softmax, top-k and the renormalization are per row; each expert's
linears are the decoder's own (QLinear gives a row the same bits at any row count: gemv_is_gemm, gemm_always);
a row's expert outputs are added in the order of their rank in its top-k, elementwise.

Only the chosen experts run: an expert's linears read its own bytes (a GGUF 3-D block's expert is a contiguous
slice of it), one GEMV a chosen expert at decode, one GEMM over the tokens routed to it at prefill.

Expert parallelism (shard.py): a tp rank may hold a range of whole experts (experts[e] None for the others). It
routes every row over all experts as every rank does, runs the chosen experts it holds and adds their weighted
outputs in rank order; the ranks' sums are then all-reduced (llama.py), as a split dense MLP's are.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .elementwise import elementwise
from .host_heap import give_back_heap
from .linear import cat_rows

ROUTER_ROWS = 16      # rows of x whose router products are held at once ([ROUTER_ROWS, E, hidden] fp32)


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, hidden], weight [E, hidden] fp32 -> [T, E] fp32: each logit a sum over hidden of its own products,
    so a row's logits are the same bits at any T (an fp32 GEMM's are not)."""
    x = x.float()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    for s in range(0, x.shape[0], ROUTER_ROWS):
        rows = x[s:s + ROUTER_ROWS]
        torch.sum(rows[:, None, :] * weight[None], dim=-1, out=out[s:s + rows.shape[0]])
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool, routing: str = "softmax_topk"
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' order: softmax over all experts in fp32, top-k, then (norm_topk_prob) divided by their sum;
    or (routing "topk_softmax", gpt-oss) the top-k logits, then their softmax. Returns (weights [T, k] fp32,
    expert ids [T, k] int64), by descending weight. Every step per row."""
    if routing == "topk_softmax":
        top, ids = torch.topk(logits.float(), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of [n, 2I] (gate rows, then up rows): (clamp(up, -l, l) + 1) * g * sigmoid(alpha g),
    g = clamp(gate, max=l); the sigmoid per element whatever the row count (elementwise)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * elementwise(torch.sigmoid, gate * alpha))


class MoE:
    """A layer's router and experts. experts[e] = (gate_up [2I, hidden], down [hidden, I]) linears, or None for an
    expert another tp rank holds."""

    def __init__(self, router: torch.Tensor, experts: list, top_k: int, renormalize: bool, native: bool,
                 act: str = "silu", held: range | None = None, shared: tuple | None = None,
                 router_bias: torch.Tensor | None = None, routing: str = "softmax_topk",
                 swiglu: tuple[float, float] = (1.702, 7.0), expert_scale: torch.Tensor | None = None) -> None:
        self.experts = experts
        self.expert_scale = expert_scale     # gemma4: each expert's weight times its scale, after the renormalization
        # gpt-oss: the router's bias, the softmax over the top-k, the clamped SwiGLU's (alpha, limit); they route
        # and activate in torch (tandem.moe_route has neither), per row as the rest
        self.router_bias, self.routing, self.swiglu = router_bias, routing, swiglu
        native_route = native and router_bias is None and routing == "softmax_topk"
        # The shared expert (Qwen3.5-MoE, Qwen3-Next): (gate_up, down, its gate's weight [1, hidden] fp32), run on
        # every row and added times sigmoid(x . gate) after the routed experts' sum
        self.shared = shared
        self.held = held             # the experts this rank holds (shard.py's expert parallelism); None: all
        self.top_k, self.renormalize, self.native, self.act = top_k, renormalize, native, act
        self._one_op = self._plan_one_op()
        # The router ([E, hidden] fp32) as its path reads it, held once: native, tandem.moe_route's layout
        # (csrc/moe_route.cpp: transposed, experts zero-padded to a multiple of 64); else as it is (router_logits).
        self.router = None if native_route else router
        self.router_t = F.pad(router.t(), (0, -router.shape[0] % 64)).contiguous() if native_route else None

    def _plan_one_op(self) -> tuple | None:
        """moe_experts' arguments (csrc/moe_experts.cpp: a decode row's experts in one op, the same bits) where
        every expert's linears are one packed part of one type each; else None (the op-by-op path)."""
        if not self.native or self.act == "swiglu_oai":
            return None
        held = [pair for pair in self.experts if pair is not None]
        gus, downs = [gu for gu, _ in held], [d for _, d in held]
        lins = gus + downs
        if not all(getattr(lin, "packed", None) is not None and lin.bias is None for lin in lins):
            return None
        types = {lin.parts[0].qtype for lin in gus}, {lin.parts[0].qtype for lin in downs}
        if len(types[0]) != 1 or len(types[1]) != 1:
            return None
        inter = downs[0].parts[0].k
        return (stack_packed(gus), types[0].pop(), stack_packed(downs), types[1].pop(), inter,
                0 if self.act == "silu" else 1)

    def linears(self) -> list:
        return [lin for pair in self.experts if pair is not None for lin in pair] + list(self.shared or ())[:2]

    def __call__(self, x: torch.Tensor, route_x: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden] (the normed residual) -> [T, hidden]: the routed experts' weighted sum per row, plus the
        gated shared expert's output where the layer has one. route_x: what the router reads, where it is not x
        (gemma4's router norms the residual its own way)."""
        out = self._routed(x, x if route_x is None else route_x)
        if self.shared is not None:
            gate_up, down, gate = self.shared
            weight = elementwise(torch.sigmoid, router_logits(x, gate)).to(x.dtype)     # [T, 1], per row
            out = out + weight * self._mlp(gate_up, down, x)
        return out

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's gated MLP on the rows routed to it: [n, hidden] -> [n, hidden]."""
        return self._mlp(*self.experts[e], x)

    def _mlp(self, gate_up, down, x: torch.Tensor) -> torch.Tensor:
        gu = gate_up(x)                                                  # [n, 2I]
        if self.act == "swiglu_oai":
            return down(swiglu_oai(gu, *self.swiglu))
        if self.native:
            ops = torch.ops.tandem
            return down(ops.silu_mul(gu) if self.act == "silu" else ops.gelu_tanh_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        act = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return down(act * up)

    def _routed(self, x: torch.Tensor, route_x: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum per row [T, hidden]."""
        t, k = x.shape[0], self.top_k
        if self.router_t is not None:
            weights, ids = torch.ops.tandem.moe_route(route_x, self.router_t, len(self.experts), k, self.renormalize)
        else:
            logits = router_logits(route_x, self.router)
            if self.router_bias is not None:
                logits = logits + self.router_bias
            weights, ids = route(logits, k, self.renormalize, self.routing)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        if t == 1 and self._one_op is not None:      # a decode row: one op, the bits of the path below
            gus, gu_type, downs, down_type, inter, act = self._one_op
            held, w = self.held, weights.to(x.dtype)
            if held is not None:                     # this rank's chosen experts, in rank order, as local ids
                mine = (ids >= held.start) & (ids < held.stop)
                if not bool(mine.any()):
                    return x.new_zeros(x.shape)
                ids, w = (ids[mine] - held.start).view(1, -1), w[mine].view(1, -1)
            return torch.ops.tandem.moe_experts(x, gus, gu_type, downs, down_type, inter, ids, w, act)
        flat = ids.reshape(-1)                                           # slot s = row * k + rank
        order = torch.argsort(flat, stable=True)                         # slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows = order // k
        y = x.new_empty(t * k, x.shape[1])                               # [T k, hidden]: each slot's output
        start = 0
        for e, n in enumerate(counts):
            if n:
                slots = order[start:start + n]
                y[slots] = self._expert(e, x[rows[start:start + n]]) if self.experts[e] is not None else 0
                start += n
        y, w = y.view(t, k, -1), weights.to(x.dtype)
        out = y[:, 0] * w[:, :1]
        for r in range(1, k):                                            # rank order: a row's own sum
            out = out + y[:, r] * w[:, r:r + 1]
        return out


def stack_packed(lins: list) -> torch.Tensor:
    """The linears' packed copies as one tensor [E, groups, bytes] (moe_experts takes it: a list of 128 tensors
    cost ~60 us a call to pass), each linear's copy then a view of it: held once. The separate copies' freed
    pages go back at once (glibc had kept them in the heap: a 6-layer Qwen3-30B-A3B-shaped file loaded with 1.3 GB
    more resident), so loading holds one layer's copies of one kind twice at most (peak RSS 5.0-5.4 -> 5.6-5.9 GB
    on that file, whatever its layer count)."""
    first = lins[0].packed
    stacked = first.new_empty((len(lins), *first.shape))
    for e, lin in enumerate(lins):
        stacked[e].copy_(lin.packed)
        lin.packed_parts[0] = stacked[e]
    give_back_heap()
    return stacked


def build_moe(ws, c: ModelConfig, i: int, native: bool, held: range | None = None, prefix: str = "mlp.") -> MoE:
    """Layer i's MoE from the state reader ws (llama._StateReader): gate and up fused per expert; of the experts
    only `held` (a tp rank's whole experts; None: all), the others None. prefix: the block's names in the layer
    (gemma4's experts beside the MLP: "moe.", with its router's scale over hidden, folded into the router's
    columns with hidden^-1/2, and a scale per expert)."""
    p = f"model.layers.{i}.{prefix}"
    router = ws.w(p + "gate.weight")
    router = (router.dequantize() if not isinstance(router, torch.Tensor) else router).float().contiguous()
    expert_scale = None
    if c.moe_beside_mlp:
        router = router * (ws.w(p + "router_scale").float() * c.hidden_size ** -0.5)[None, :]
        expert_scale = ws.w(p + "per_expert_scale").float()
    experts: list = []
    for e in range(c.num_experts):
        q = f"{p}experts.{e}."
        if held is not None and e not in held:
            experts.append(None)
            continue
        gu_bias = torch.cat([ws.w(q + "gate_proj.bias"), ws.w(q + "up_proj.bias")]) if c.moe_bias else None
        experts.append((ws.lin(cat_rows([ws.w(q + "gate_proj.weight"), ws.w(q + "up_proj.weight")]), gu_bias),
                        ws.lin(ws.w(q + "down_proj.weight"), ws.w(q + "down_proj.bias") if c.moe_bias else None)))
    shared = None
    if c.shared_expert_intermediate_size:
        q = p + "shared_expert."
        gate = ws.w(p + "shared_expert_gate.weight")
        gate = (gate.dequantize() if not isinstance(gate, torch.Tensor) else gate).float().contiguous()
        shared = (ws.lin(cat_rows([ws.w(q + "gate_proj.weight"), ws.w(q + "up_proj.weight")])),
                  ws.lin(ws.w(q + "down_proj.weight")), gate)
    bias = ws.w(p + "gate.bias").float() if c.moe_bias else None
    return MoE(router, experts, c.num_experts_per_tok, c.norm_topk_prob, native, c.hidden_act, held, shared,
               bias, c.moe_routing, (c.swiglu_alpha, c.swiglu_limit), expert_scale)

