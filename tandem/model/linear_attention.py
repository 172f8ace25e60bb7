"""The Gated DeltaNet layer of the hybrid models (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): linear attention whose memory
is a fixed-size state per request (recurrent_state.py), not KV pages that grow with its tokens.

For each token: one projection gives q / k / v (through a short causal depthwise conv with SiLU, whose state is the
last conv-width - 1 inputs), the output gate z, and b / a, which make the write strength beta = sigmoid(b) and the
decay g = -exp(A_log) * softplus(a + dt_bias). Per value head, with q and k L2-normed (q also by 1 / sqrt(Dk)):
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q          (S: [Dk, Dv], the delta rule)
then o is RMS-normed per head, times w and silu(z), and projected out.

Under batch_invariant (EngineConfig's default) the rule runs token by token (its recurrent form) at decode and at
prefill alike. So a token's arithmetic depends only on its request's earlier tokens: a prompt in one chunk or many,
a state restored from a checkpoint, a row alone or among others give the same bits (the batch invariance
attention_paths.py states). The recurrent form costs ~4 Dk Dv flops a head a token on a state that stays in L2
(Qwen3.6-35B-A3B: 32 heads x 64 K flops x 30 layers ~ 63 MFLOP a token, about 1 % of its 3 B active weights'
6 GFLOP), but it reads and writes that state twice a token, so it runs at the cache's pace, not the FMA units'.

Without batch invariance (Numerics.linear_chunk > 0, native ops) a prefill step's rows take the chunked (matrix)
form for each full chunk of linear_chunk tokens from the row's start (delta_chunked.py), the tail token by token:
faster prefill, but a token's bits then depend on where its chunks start. Decode steps stay recurrent.

The native ops (csrc/gated_delta_rule.cpp, csrc/gated_delta_rule_chunked.cpp) and the torch references here and in
delta_chunked.py compute the same rule; tests compare them. The torch path runs the recurrent reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .elementwise import elementwise
from .linear import cat_rows
from .verify_runs import VerifyRuns


@dataclass
class RecurrentRows:
    """Where a step's rows keep their state, built once a step (model_runner) and read by every linear layer.

    slots: [B] int64, each row's state slot (its request-table row); starts: B + 1 host ints, row b's tokens are
    [starts[b], starts[b + 1]) of the step; fresh: B host bools, the row's first token is its position 0 (its state
    starts from zero, whatever the slot held). starts_t / fresh_t: the same as tensors (int64 [B + 1], bool [B]),
    for the native op, made once a step rather than once a layer."""
    slots: torch.Tensor
    starts: list[int]
    fresh: list[bool]
    conv: torch.Tensor          # [linear layers, slots, conv channels, width - 1] of the pool (recurrent_state.py)
    ssm: torch.Tensor           # [linear layers, slots, value heads, Dk, Dv] fp32
    starts_t: torch.Tensor
    fresh_t: torch.Tensor
    runs: VerifyRuns | None = None      # a verify step's speculating requests, each one row (verify_runs.py)

    @property
    def decode_only(self) -> bool:
        return len(self.starts) - 1 == self.starts[-1]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         state: torch.Tensor) -> torch.Tensor:
    """One request's tokens, in order, in torch: q, k [n, H, Dk] (already normed and scaled, heads repeated to
    the value heads), v [n, H, Dv], g, beta [n, H] fp32; state [H, Dk, Dv] fp32, updated in place.
    Returns o [n, H, Dv] fp32."""
    out = torch.empty_like(v)
    s = state
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = (s * k[t][:, :, None]).sum(dim=1)                         # [H, Dv]
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(dim=1)
    state.copy_(s)
    return out


def causal_conv(x: torch.Tensor, w: torch.Tensor, conv_state: torch.Tensor, fresh: bool) -> torch.Tensor:
    """One request's n tokens [n, C] through the depthwise causal conv (w [C, width]) and SiLU; conv_state [C, width
    - 1], the inputs before them, is read (zeros when fresh) and left holding the last width - 1 inputs. Each
    output is sum_j w[:, j] * input[t - width + 1 + j] added in order of j, so its bits do not depend on n."""
    width = w.shape[1]
    before = torch.zeros_like(conv_state) if fresh else conv_state
    win = torch.cat([before.to(x.dtype), x.t()], dim=1)                   # [C, width - 1 + n]
    n = x.shape[0]
    acc = win[:, 0:n] * w[:, 0:1]
    for j in range(1, width):
        acc = acc + win[:, j:j + n] * w[:, j:j + 1]
    conv_state.copy_(win[:, n:])
    return elementwise(F.silu, acc.t().contiguous())


def causal_conv_decode(x: torch.Tensor, w: torch.Tensor, conv: torch.Tensor, rec: RecurrentRows) -> torch.Tensor:
    """causal_conv for a step of one token a row, every row at once: x [B, C]; conv the layer's pool [slots, C,
    width - 1]. Each output is the same sequence of products and sums as causal_conv's, so the same bits."""
    before = conv[rec.slots]                                                # [B, C, width - 1] (a copy)
    if any(rec.fresh):
        before[rec.fresh_t] = 0
    win = torch.cat([before.to(x.dtype), x[:, :, None]], dim=2)             # [B, C, width]
    acc = win[..., 0] * w[:, 0]
    for j in range(1, w.shape[1]):
        acc = acc + win[..., j] * w[:, j]
    conv[rec.slots] = win[..., 1:]
    return elementwise(F.silu, acc.contiguous())


class GatedDeltaNet:
    """Layer i's weights: q / k / v / z / b / a in one projection (rows in that order), the conv, the decay's
    A and dt_bias, the gated norm's weight (as it is: not a (1 + w) norm) and the output projection."""

    def __init__(self, ws, c: ModelConfig, i: int, j: int, native: bool, chunk: int = 0) -> None:
        p = f"model.layers.{i}.linear_attn."
        self.j, self.native = j, native           # j: the layer's index among the linear layers (its state)
        self.chunk = chunk                        # Numerics.linear_chunk: rows' full chunks in matrix form; 0: off
        self.tiled = c.linear_value_heads_tiled
        self.heads_k, self.heads_v = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv, self.eps = c.linear_key_head_dim, c.linear_value_head_dim, c.rms_norm_eps
        self.key_dim, self.value_dim = self.heads_k * self.dk, self.heads_v * self.dv
        self.in_proj = ws.lin(cat_rows([ws.w(p + n) for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                                                "in_proj_b.weight", "in_proj_a.weight")]))
        self.conv_w = ws.w(p + "conv1d.weight").float().reshape(c.linear_conv_dim, -1).contiguous()
        self.neg_a = -ws.w(p + "A_log").float().exp()                         # [Hv]
        self.dt_bias = ws.w(p + "dt_bias").float()
        self.norm_w = ws.w(p + "norm.weight")
        self.norm_w_heads = self.norm_w.float().expand(self.heads_v, -1).contiguous()      # the native norms' [heads, D]
        self.qk_norm_w = torch.cat([torch.full((self.heads_k, self.dk), 1.0 / self.dk),
                                    torch.full((self.heads_k, self.dk), self.dk ** -0.5)]).to(self.norm_w.device)
        self.out_proj = ws.lin(ws.w(p + "out_proj.weight"))

    def linears(self) -> list:
        return [self.in_proj, self.out_proj]

    def __call__(self, x: torch.Tensor, rec: RecurrentRows) -> torch.Tensor:
        """x [T, hidden] (normed) -> [T, hidden]; the rows' states in rec advance by their tokens."""
        return self.out_proj(self.mix(self.in_proj(x), rec))

    def mix(self, proj: torch.Tensor, rec: RecurrentRows) -> torch.Tensor:
        """The projections [T, q k v | z | b | a] -> the gated norm's output [T, Hv Dv]: conv, delta rule, norm.
        A token's bits depend only on its own request's tokens (every op per row, elementwise() for the rest)."""
        t = proj.shape[0]
        mixed, z, b, a = proj.split([2 * self.key_dim + self.value_dim, self.value_dim,
                                     self.heads_v, self.heads_v], dim=-1)
        conv, ssm = rec.conv[self.j], rec.ssm[self.j]
        slots = rec.slots.tolist()
        if rec.runs is not None:
            rec.runs.before_conv(self.j, conv, mixed)
        if rec.decode_only:
            mixed = causal_conv_decode(mixed, self.conv_w, conv, rec)
        else:
            mixed = torch.cat([causal_conv(mixed[s:e], self.conv_w, conv[slot], fresh)
                               for slot, s, e, fresh in zip(slots, rec.starts, rec.starts[1:], rec.fresh)])
        q, k, v = self._qk_normed(mixed.float())
        v = v.reshape(t, self.heads_v, self.dv)
        beta = elementwise(torch.sigmoid, b.float())
        g = self.neg_a * elementwise(F.softplus, a.float() + self.dt_bias)
        o = self._delta_rule(q, k, v, g, beta, ssm, rec, slots)
        return self._gated_norm(o, z)

    def _delta_rule(self, q, k, v, g, beta, ssm: torch.Tensor, rec: RecurrentRows, slots: list[int]) -> torch.Tensor:
        """The step's rows through the delta rule, their states in ssm [slots, Hv, Dk, Dv] advanced: the native op
        in one call (q, k [T, Hk, Dk], value head h reading key head h div (Hv / Hk): a file's tiled value heads get
        their key heads repeated first; a prefill step's rows in the chunked form where self.chunk > 0), else the
        recurrent reference row by row."""
        if self.native:
            if self.tiled and self.heads_v != self.heads_k:
                q, k = self._to_value_heads(q), self._to_value_heads(k)
            q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
            if rec.runs is not None:
                rec.runs.before_rule(self.j, ssm, k, v, g, beta)
            if self.chunk > 0 and not rec.decode_only:      # a verify run (< a chunk) keeps the recurrent bits
                return torch.ops.tandem.gated_delta_rule_chunked_(q, k, v, g, beta, ssm, rec.slots, rec.starts_t,
                                                                  rec.fresh_t, self.chunk)
            return torch.ops.tandem.gated_delta_rule_(q, k, v, g, beta, ssm, rec.slots, rec.starts_t, rec.fresh_t)
        q, k = self._to_value_heads(q), self._to_value_heads(k)
        if rec.runs is not None:
            rec.runs.before_rule(self.j, ssm, k, v, g, beta)
        o = torch.empty_like(v)
        for slot, s, e, fresh in zip(slots, rec.starts, rec.starts[1:], rec.fresh):
            state = ssm[slot]
            if fresh:
                state.zero_()
            o[s:e] = delta_rule_reference(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e], state)
        return o

    def roll_back(self, rec: RecurrentRows, kept: list[int]) -> None:
        """Each verify run of the step that keeps fewer tokens than it ran (kept[i]: run i's accepted drafts + 1):
        its state from before the step, advanced again by the kept tokens alone (verify_runs.py): the conv state
        their last inputs, the delta rule the same op on the same inputs, so the bits of k + 1 decode steps."""
        runs = rec.runs
        r = runs.layers.pop(self.j)
        back = runs.kept_back(kept)
        if not back:
            return
        conv, ssm = rec.conv[self.j], rec.ssm[self.j]
        for i in back:
            s, n, slot = runs.offsets[i], kept[i], runs.slots[i]
            conv[slot] = torch.cat([r.conv[i].to(r.x.dtype), r.x[s:s + n].t()], dim=1)[:, n:]
            ssm[slot] = r.ssm[i]
        idx, starts = runs.kept_tokens(back, kept)
        k, v, g, beta = (t[idx.to(t.device)].contiguous() for t in r.rule)
        slots = [runs.slots[i] for i in back]
        if self.native:                          # q: any (the output is not read); k stands in
            dev = v.device
            torch.ops.tandem.gated_delta_rule_(k, k, v, g, beta, ssm, torch.tensor(slots, device=dev),
                                               torch.tensor(starts, device=dev),
                                               torch.zeros(len(slots), dtype=torch.bool, device=dev))
            return
        for slot, a, b in zip(slots, starts, starts[1:]):
            delta_rule_reference(k[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], ssm[slot])

    def _qk_normed(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q / sqrt(Dk) and k, each head L2-normed, and v, from the conv's output [T, q k v]. Native: per row in
        tandem.head_rms_norm_ (weights 1 / Dk and 1 / sqrt(Dk), eps / Dk: x / sqrt(sum x^2 + eps)), whose bits follow
        neither the row count nor the batch (torch's sum over a short last dim does); else transformers' form."""
        t = mixed.shape[0]
        if self.native:
            mixed = mixed.contiguous()
            torch.ops.tandem.head_rms_norm_(mixed, self.qk_norm_w, 1e-6 / self.dk)
            q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            return q.reshape(t, self.heads_k, self.dk), k.reshape(t, self.heads_k, self.dk), v
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (l2norm(q.reshape(t, self.heads_k, self.dk)) * self.dk ** -0.5,
                l2norm(k.reshape(t, self.heads_k, self.dk)), v)

    def _to_value_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[T, key heads, Dk] -> [T, value heads, Dk]: each value head's key head (grouped, HF's order; or tiled,
        the order llama.cpp's Qwen3.5 files keep value heads in)."""
        r = self.heads_v // self.heads_k
        return x.repeat(1, r, 1) if self.tiled else x.repeat_interleave(r, dim=1)

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head's output [T, Hv, Dv] (fp32), times w, times silu(z); -> [T, Hv Dv]."""
        dtype = z.dtype
        if self.native:                             # per row, as _qk_normed's
            o = o.reshape(o.shape[0], -1)
            torch.ops.tandem.head_rms_norm_(o, self.norm_w_heads, self.eps)
            return (o * elementwise(F.silu, z.float())).to(dtype)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        o = self.norm_w * o.to(dtype)
        o = o * elementwise(F.silu, z.float()).reshape(o.shape)
        return o.to(dtype).reshape(o.shape[0], -1)
