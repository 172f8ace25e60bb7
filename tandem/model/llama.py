"""The one decoder definition (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen3-MoE, Mixtral): RMSNorm, RoPE, GQA, a
gated MLP (or a mixture of experts: moe.py) over a paged KV cache. Architectures differ only by ModelConfig
switches: q/k/v bias, QK-norm, sandwich norms, (1 + w) norms, GeGLU, a scaled embedding, the attention scale,
sliding-window layers with their own RoPE base, and expert layers.

Ragged prefill and batched decode take the same path: every layer writes the step's new K/V at its KV slots,
then attends over the slots the request table maps each row's positions to. A sliding-window layer keeps
every key in the cache (one slot holds all layers' K/V) and attends only its last W: its mask (torch path)
or the key range the decode kernel reads (native path) starts W positions back.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..kernels.quant import QuantWeight, small_m
from . import gemma4
from .attention_paths import Attention
from .config import ModelConfig
from .kv_cache import AttentionMeta
from .layer_ops import HeadShape, NativeOps, TorchOps
from .linear import Linear, QLinear, Weight, cat_rows, embedding_rows, hold_once, linear, run_rows, take_rows, tied_table
from .linear_attention import GatedDeltaNet, RecurrentRows
from .moe import build_moe
from .numerics import Numerics
from .rope import rope_tables
from .row_parallel import ChunkedRows, add_in_order, chunked_rows
from .shard import TPLayout, cols

_NONE = torch.empty(0, dtype=torch.uint8)       # decode_layer_'s packed entry of a linear without a packed copy


class _StateReader:
    """The state dict as the model holds it: on its device and dtype, QuantWeight blocks kept as blocks only for
    the native ops (else dequantized), norms with gemma's (1 + w) folded in once."""

    def __init__(self, state: dict, device: torch.device, dtype: torch.dtype, native: bool, int8_act: bool,
                 norm_offset: float, consume: bool = False) -> None:
        self.state, self.device, self.dtype, self.consume = state, device, dtype, consume
        self.native, self.int8_act, self.norm_offset = native, int8_act, norm_offset

    def w(self, name: str) -> "torch.Tensor | QuantWeight":
        t = self.state.pop(name) if self.consume else self.state[name]
        if isinstance(t, QuantWeight):
            return t if self.native else t.dequantize().to(device=self.device, dtype=self.dtype)
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def lin(self, weight: Weight, bias: torch.Tensor | None = None) -> "Linear | QLinear":
        return linear(weight, bias, self.int8_act)

    def norm(self, name: str) -> torch.Tensor:
        t = self.w(name)
        return t + self.norm_offset if self.norm_offset else t


class LlamaModel:
    """Weights as plain tensors (no nn.Module bookkeeping on the hot path); q/k/v and gate/up fused.

    numerics: the numeric path (model/numerics.py, resolved by the model runner); the model reads it and decides
    nothing. native: state matrices may be QuantWeight (GGUF blocks); they stay so and run tandem's native ops.
    int8_act: their decode linears quantize activations to int8 blocks (kernels_act="int8").
    tp: a tensor-parallel rank (device/parallel/tp.py): `state` is this rank's shard (model/shard.py); o and down
    partial sums and the vocab-parallel embedding are all-reduced, the LM head's vocab shards gathered on
    rank 0 (other ranks' forward returns None).
    reduce_chunks (tp_reduce_chunks): o and down run as that many column chunks over all ranks, their partials
    added in chunk order (row_parallel.py): the bits of every tp size dividing it, tp 1's included.
    pp: a pipeline stage (device/parallel/pp.py): only its layers (pp.layers), the embedding on the first stage, the
    final norm and LM head on the last; final_hidden receives and sends (hidden, residual) at the stage's ends
    and returns None on every stage but the last.
    prefill_bf16 (prefill_act="bf16"): the layers' quantized linears keep a bf16 copy, and a long prefill chunk
    (more than small_m() tokens: the rows that already attend by SDPA, not as decode rows) runs its linears and
    its attention in bf16 (_bulk_from). Decode rows, verify rows and short chunks keep the int8 kernels.
    extend_bf16 (prefill_attention): the native extend op of long chunks takes bf16 products (queries and
    probabilities rounded to bf16, fp32 sums) on the bf16 cache.
    decode_bf16 (decode_attention): the same for the native decode op, wherever it runs (decode rows, short
    chunks' tokens, verify rows: one op, so a token's attention stays the same bits on each).
    """

    def __init__(self, config: ModelConfig, state: dict, max_context: int, device: torch.device | str = "cpu",
                 numerics: Numerics = Numerics(), tp=None, pp=None, consume_state: bool = False) -> None:
        self.config, self.device, self.numerics = config, torch.device(device), numerics
        native, dtype = numerics.native, numerics.dtype
        self.tp, self.pp = tp, pp
        first, last = pp is None or pp.first, pp is None or pp.last
        c = config
        lay = TPLayout.of(c, tp.size, tp.rank) if tp is not None else TPLayout.of(c, 1, 0)
        self.layout = lay
        self.chunks_here = numerics.reduce_chunks // lay.size   # tp_reduce_chunks (row_parallel.py): chunks here
        self.num_heads, self.num_kv_heads = lay.heads, lay.kv_heads     # this rank's
        ws = _StateReader(state, self.device, dtype, native, numerics.int8_act, c.norm_offset, consume_state)
        self.embed = (ws.w("model.embed_tokens.weight")                # [V, hidden] (or its blocks; tied_table)
                      if first or (last and c.tie_word_embeddings) else None)
        self.lm_head = ws.lin(self.embed if c.tie_word_embeddings else ws.w("lm_head.weight")) if last else None
        self.final_norm = ws.norm("model.norm.weight") if last else None
        # gemma: the embedding times sqrt(hidden), rounded to the model dtype as transformers does
        self.embed_scale = (torch.tensor(c.hidden_size ** 0.5, dtype=dtype).item() if c.embed_scale else None)
        if c.per_layer_input_size and pp is not None:
            raise ValueError("gemma4's per-layer inputs are not split over pipeline stages yet (run it without --pp)")
        if c.num_kv_shared_layers and pp is not None:
            raise ValueError("gemma4's KV-shared layers read an earlier layer's KV: not split over pipeline stages yet")
        self.per_layer = gemma4.PerLayerInputs(ws, c) if c.per_layer_input_size else None
        self.scale = c.attn_scale
        # self.layers[j]: KV cache layer j. Each layer's row layouts go as soon as it is built (consume_state: the
        # state dict lets go of them too), so that loading never holds every matrix twice.
        self.layers = []
        for i in range(c.num_layers) if pp is None else pp.layers:
            self.layers.append(layer := self._layer(ws, i))
            hold_once([lin for k in ("qkv", "o", "gate_up", "down") if k in layer
                       for lin in getattr(layer[k], "lins", [layer[k]])]
                      + (layer["mixer"].linears() if "mixer" in layer else []) + gemma4.layer_linears(layer),
                      self.prefill_bf16)
            for k in ("moe", "experts"):    # experts keep the int8 kernels at every row count (no bf16 copy)
                if k in layer:
                    hold_once(layer[k].linears(), False, experts=True)
        if self.per_layer is not None:
            hold_once(self.per_layer.linears(), self.prefill_bf16)
        hold_once([self.lm_head], False)
        if c.tie_word_embeddings and first and last:    # one stage (rank) holds both: the head's copy serves both
            self.embed = tied_table(self.embed, self.lm_head)
        self.cos, self.sin, self.cos_local, self.sin_local = rope_tables(c, max_context, self.device, self.dtype)
        self.q_size = lay.heads * c.head_dim
        self.kv_size = lay.kv_heads * c.head_dim
        if native and tp is None:
            self._plan_decode_layer_ops()       # after release_rows: it holds the rows it passes
        # The layers holding KV (attention layers but gemma4's KV-shared ones: TPLayout.kv_shapes' order)
        attending = [layer for layer in self.layers if "mixer" not in layer and "kv_from" not in layer]
        self.attention = Attention(numerics, self.scale, self.num_heads, [layer["window"] for layer in attending],
                                   [layer.get("sinks") for layer in attending])

    # The record's choices under the names the body, attention_layout.py, tests and benchmarks read
    native = property(lambda self: self.numerics.native)
    dtype = property(lambda self: self.numerics.dtype)
    int8_act = property(lambda self: self.numerics.int8_act)
    prefill_bf16 = property(lambda self: self.numerics.prefill_bf16)
    decode_bf16 = property(lambda self: self.numerics.decode_bf16)
    extend_native = property(lambda self: self.numerics.extend_native)

    def _layer(self, ws: "_StateReader", i: int) -> dict:
        """Decoder layer i's weights: q/k/v and gate/up fused, norms with their offset folded in. kv: its layer
        in the KV cache, which holds only the attention layers; a linear-attention layer has a mixer instead."""
        c, lay, p = self.config, self.layout, f"model.layers.{i}."
        layer = dict(attn_norm=ws.norm(p + "input_layernorm.weight"), window=c.window(i))     # window 0: global
        if c.is_linear(i):
            layer["mixer"] = GatedDeltaNet(ws, lay.local(c), i, sum(1 for l in self.layers if "mixer" in l),
                                           self.native, self.numerics.linear_chunk)    # a tp rank's heads (shard.py)
        else:
            layer.update(self._attention_weights(ws, p, i))
            if (src := c.kv_source(i)) != i:     # gemma4's KV-shared layer: attends layer src's KV (no pp: index src)
                layer["kv_from"] = self.layers[src]["kv"]
                self.layers[src]["kv_stash"] = True
            else:
                layer["kv"] = sum(1 for l in self.layers if "mixer" not in l and "kv_from" not in l)
        if c.is_moe(i):                     # a router and its experts in place of the dense MLP
            layer["moe"] = build_moe(ws, c, i, self.native, lay.held_experts)     # expert parallelism: a range
        else:
            layer.update(gate_up=ws.lin(cat_rows([ws.w(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")])),
                         down=self._row_parallel_lin(ws, p + "mlp.down_proj.weight"))   # gate_up: [2I, hidden]
        if c.sandwich_norm:                 # gemma3: post_attention_layernorm is the norm *after* attention
            layer.update(post_attn_norm=ws.norm(p + "post_attention_layernorm.weight"),
                         mlp_norm=ws.norm(p + "pre_feedforward_layernorm.weight"),
                         post_mlp_norm=ws.norm(p + "post_feedforward_layernorm.weight"))
        else:
            layer.update(mlp_norm=ws.norm(p + "post_attention_layernorm.weight"))
        if c.qk_norm and "mixer" not in layer:
            layer["qk_norm"] = self._head_norms(ws, p, layer["shape"])
        if c.layer_scalar or c.per_layer_input_size or c.moe_beside_mlp:
            layer.update(gemma4.layer_weights(ws, c, i, self.native, lay.held_experts))
        return layer

    def _head_norms(self, ws: "_StateReader", p: str, s: HeadShape) -> torch.Tensor:
        """[H + KVH, D]: q heads by q_norm, then k heads by k_norm; gemma4's v heads after them by ones (v_norm); a
        KV-shared layer's q heads only."""
        rows = [ws.norm(p + "self_attn.q_norm.weight").expand(s.heads, -1)]
        if s.kv_rows:
            rows.append(ws.norm(p + "self_attn.k_norm.weight").expand(s.kv_heads, -1))
            if self.config.v_norm:
                rows.append(torch.ones(s.kv_heads, s.head_dim, dtype=ws.dtype, device=ws.device))
        return torch.cat(rows)

    def _attention_weights(self, ws: "_StateReader", p: str, i: int) -> dict:
        """An attention layer's q/k/v rows [(H + 2 KVH) D, hidden] (a gated one's q_proj gives each head its q,
        then its gate: the gates' rows go after v, [(2 H + 2 KVH) D]) and o. gemma4: a full layer's own head
        shape; where attention_k_eq_v, k_proj's rows twice (V is K's projection, normed apart); a KV-shared
        layer's q rows only. shape: the layer's HeadShape on this rank."""
        c, h = self.config, self.layout.heads
        shared, d = c.kv_source(i) != i, c.layer_head_dim(i)
        kvh = self.layout.layer_kv(c, i)[0]        # this rank's: gemma4's full layers split their own count
        q = ws.w(p + "self_attn.q_proj.weight")
        gate = None
        if c.attn_output_gate:
            rows = torch.arange(2 * h * d).view(h, 2, d)
            q, gate = take_rows(q, rows[:, 0].reshape(-1)), take_rows(q, rows[:, 1].reshape(-1))
        kv = [] if shared else [ws.w(p + "self_attn.k_proj.weight")]
        if kv:
            kv.append(kv[0] if c.attention_k_eq_v and not c.is_sliding(i) else ws.w(p + "self_attn.v_proj.weight"))
        qkv = cat_rows([q] + kv + ([gate] if gate is not None else []))
        qkv_bias = (torch.cat([ws.w(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
                    if c.attention_bias else None)
        out = dict(qkv=ws.lin(qkv, qkv_bias), o=self._row_parallel_lin(ws, p + "self_attn.o_proj.weight",
                                                                        c.attention_out_bias),
                   shape=HeadShape(h, kvh, d, not shared))
        if c.attention_sinks:               # gpt-oss: each head's sink logit (this rank's heads), fp32
            out["sinks"] = ws.w(p + "self_attn.sinks").float().contiguous()
        return out

    def _row_parallel_lin(self, ws: "_StateReader", name: str, bias: bool = False
                          ) -> "Linear | QLinear | ChunkedRows":
        """o or down: one linear, or under tp_reduce_chunks this rank's column chunks of it (row_parallel.py).
        bias: the linear has one (name's .bias; under tp rank 0's, zeros elsewhere: shard.py)."""
        b = ws.w(name[:-len("weight")] + "bias") if bias else None
        if b is not None and self.chunks_here:
            raise ValueError(f"tp_reduce_chunks: {name} has a bias, which the column chunks do not add yet")
        if not self.chunks_here:
            return ws.lin(ws.w(name), b)
        return chunked_rows(ws.w(name), self.chunks_here, name, lambda w, a, b: cols(w, a, b, [], name), ws.lin)

    def _plan_decode_layer_ops(self) -> None:
        """A pure decode step of up to small_m() rows runs each layer as one native op (decode_layer_) where its
        linears are GGUF blocks (qkv one part or q, k, v of mixed types; the others one part), no
        tensor-parallel rank reduces between them (the caller's test), and the layer is a Llama / Qwen2 / Qwen3
        one (a global layer, SiLU, QK-norm or none, no sandwich norms: Gemma 3 keeps the op-by-op body). An MoE
        layer's op stops at its MLP's normed input ("blocks" without gate_up and down; the experts run after)."""
        c = self.config
        plain = (not c.sandwich_norm and c.hidden_act == "silu" and not c.attn_output_gate
                 and c.rotary_dim == c.head_dim and not c.attention_sinks and not c.attention_out_bias)
        for layer in self.layers if plain else []:
            lins = [layer[k] for k in (("qkv", "o") if "moe" in layer else ("qkv", "o", "gate_up", "down"))]
            if (not layer["window"] and all(isinstance(lin, QLinear) and not lin.gemm_always for lin in lins)
                    and all(len(lin.parts) == 1 for lin in lins[1:])):
                parts = [p for lin in lins for p in lin.parts]          # qkv: one part, or q, k, v
                packed = [pk if pk is not None else _NONE for lin in lins for pk in lin.packed_parts]
                layer["blocks"] = ([p.data for p in parts], [p.qtype for p in parts], packed)

    def _bulk_from(self, t: int, meta: AttentionMeta) -> int:
        """The step's first token whose linears run the bf16 GEMM (prefill_bf16): 0 for a prefill step of more
        than small_m() tokens, a mixed step's first prefill token when its prefill part is that long, else t
        (none). The same test as _attention's: those are the tokens that attend by SDPA, never bit for bit a
        decode row (_token_attention's invariant holds only below it)."""
        if not self.prefill_bf16:
            return t
        if meta.parts is not None:
            rows, m = meta.parts[-1]
            return rows.start if m.q_index is not None and rows.stop - rows.start > small_m() else t
        return 0 if meta.q_index is not None and t > small_m() else t

    def _rope(self, layer: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cos/sin tables [max_context, D]: a sliding layer's own base where it has one."""
        return (self.cos_local, self.sin_local) if layer["window"] else (self.cos, self.sin)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the ranks (in place)."""
        if self.tp is not None:
            x = x.contiguous()
            self.tp.all_reduce(x)
        return x

    def _row_parallel(self, lin: "Linear | QLinear | ChunkedRows", x: torch.Tensor, b0: int) -> torch.Tensor:
        """o or down, summed over the ranks: chunked (tp_reduce_chunks), every chunk's partial added in chunk
        order, the bits of any tp size dividing the chunks; else this rank's sum all-reduced."""
        if isinstance(lin, ChunkedRows):
            parts = lin.partials(x)                                     # [chunks here, T, N]
            return self.tp.all_reduce_in_order(parts) if self.tp is not None else add_in_order(parts)
        return self._reduce(run_rows(lin, x, b0))

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T, hidden]; vocab-parallel under tp: each rank looks up the ids of its shard, zeros elsewhere."""
        ids, inside = input_ids, None
        if self.tp is not None:
            ids = input_ids - self.layout.vocab_start
            inside = (ids >= 0) & (ids < self.layout.vocab)
            ids = torch.where(inside, ids, 0)
        x = embedding_rows(self.embed, ids)
        if inside is not None:
            x = self._reduce(x * inside[:, None].to(x.dtype))
        return x if self.embed_scale is None else x * self.embed_scale

    def logits(self, x: torch.Tensor) -> torch.Tensor | None:
        """x: final hidden states [N, hidden] -> [N, V] fp32; under tp the vocab shards gathered on rank 0
        (None on the others: every rank calls it, the gather is a collective)."""
        logits, cap = self.lm_head(x).float(), self.config.final_logit_softcapping
        if self.tp is None:
            return gemma4.soft_cap(logits, cap)
        full = self.tp.gather(logits.contiguous())
        return None if full is None else gemma4.soft_cap(full[:, :self.config.vocab_size], cap)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta) -> torch.Tensor:
        """input_ids, positions: [T]. Returns logits of each row's last token: [B, V] (fp32; None on a tp
        rank other than 0)."""
        return self.logits(self.final_hidden(input_ids, positions, meta, meta.last_index))

    @torch.inference_mode()
    def final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMeta,
                     index: torch.Tensor, between: Callable[[int], None] | None = None) -> torch.Tensor:
        """input_ids, positions: [T]; index: [N] flat token indices. The final-normed hidden states there:
        [N, hidden], for logits() (which callers may apply to a few rows at a time); None on a pipeline stage
        but the last (it sent its hidden states on). `between(i)` is called before each layer i > 0, when
        nothing of the step is in flight but its residual stream (the urgent-step branch: process/main.py)."""
        ops = (NativeOps if self.native else TorchOps)(self, positions)
        ple = None
        if self.pp is None or self.pp.first:
            x, delta = self._embed(input_ids), None                     # [T, hidden]
            if self.per_layer is not None:                             # gemma4's per-layer inputs [T, layers, P]
                ple = self.per_layer(ops, input_ids, x, self._bulk_from(x.shape[0], meta))
        else:
            x, delta = self.pp.recv_hidden((2, input_ids.shape[0], self.config.hidden_size), self.dtype).unbind(0)
        x, delta = self._layers(ops, x, delta, positions, meta, between, ple)
        if self.pp is not None and not self.pp.last:
            # To the next stage: the hidden states, and the last layer's residual still to be added.
            self.pp.send_hidden(torch.stack([x, torch.zeros_like(x) if delta is None else delta]))
            return None
        x = x if delta is None else x + delta
        return ops.norm(x[index], self.final_norm)                     # [N, hidden]

    def _layers(self, ops: "NativeOps | TorchOps", x: torch.Tensor, delta: torch.Tensor | None,
                positions: torch.Tensor, meta: AttentionMeta, between: Callable[[int], None] | None = None,
                ple: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers, one body for both kernel sets (`ops`: tandem's fused ops or torch's, each step the
        same on both): x [T, hidden] the residual stream, delta the residual still to add to it (None before a
        first layer, and after a gemma4 layer: its scalar scales the stream itself; ple: its per-layer inputs). Returns (x, delta): the last layer's add is left to the caller (final_hidden,
        or the next pipeline stage). The native set adds and norms in one pass (x updated in place), keeps
        q/k/v fused (QK-norm and RoPE in place), attends a pure decode step with one op (K/V write and
        attention) and runs a small one's layers with "blocks" as one decode_layer_ op each: a batch-1 decode
        step of SmolLM2-135M dispatches ~716 torch ops, ~23 a layer (was ~1,765)."""
        c = self.config
        fused = self.native and meta.decode_only and x.shape[0] <= small_m()    # layers with "blocks": one op each
        b0 = self._bulk_from(x.shape[0], meta)                          # rows from b0 on: bf16 linears
        shared_kv: dict = {}            # gemma4: this step's K, V of the layers KV-shared layers read (_attend)
        for i, layer in enumerate(self.layers):
            if between is not None and i:
                between(i)
            if fused and "blocks" in layer:
                delta = self._decode_layer(i, layer, x, delta, positions, meta)
                continue
            x, h = ops.add_norm(x, delta, layer["attn_norm"])
            if "mixer" in layer:                    # out_proj's partial sums over a tp rank's value heads, reduced
                o = self._reduce(layer["mixer"](h, meta.recurrent))
            else:
                o = self._attend(ops, layer, h, meta, b0, shared_kv)
            if c.sandwich_norm:         # gemma3: norm the attention output, add it, norm before the MLP
                o = ops.norm(o, layer["post_attn_norm"])
            x, h = ops.add_norm(x, o, layer["mlp_norm"])
            if "moe" in layer:
                delta = self._reduce(layer["moe"](h))
            else:
                delta = self._row_parallel(layer["down"], ops.gated(run_rows(layer["gate_up"], h, b0)), b0)
            if "experts" in layer:      # gemma4: experts beside the dense MLP
                delta = gemma4.beside_mlp(ops, layer, x, delta, self._reduce)
            if c.sandwich_norm:
                delta = ops.norm(delta, layer["post_mlp_norm"])
            if "scalar" in layer or ple is not None:
                x, delta = gemma4.layer_end(ops, layer, x, delta, None if ple is None else ple[:, i], b0), None
        return x, delta

    def roll_back(self, rec: "RecurrentRows", kept: list[int]) -> None:
        """A verify step's runs of a hybrid model: each linear layer's states back to the tokens kept (kept[i]: run
        i's accepted drafts + 1; model/verify_runs.py)."""
        for layer in self.layers:
            if "mixer" in layer:
                layer["mixer"].roll_back(rec, kept)

    def _attend(self, ops: "NativeOps | TorchOps", layer: dict, h: torch.Tensor, meta: AttentionMeta,
                b0: int, shared_kv: dict) -> torch.Tensor:
        """An attention layer's o projection of the normed input h [T, hidden]: q/k/v (QK-normed, turned), attention
        over the KV cache at its layer, a gated layer's output times sigmoid(gate). gemma4's KV-shared layer has
        q only: it attends its source layer's KV with that layer's K, V of this step (shared_kv, a dict of the
        step: the urgent-step branch runs other steps between layers), which it writes again (the same bits)."""
        c, s = self.config, layer["shape"]
        out = run_rows(layer["qkv"], h, b0)
        gate = None
        if c.attn_output_gate:                      # the gates' rows come after v's (_attention_weights)
            out, gate = out[:, :-self.q_size], out[:, -self.q_size:]
        qkv = ops.heads(out.contiguous(), s)        # [T, (H + 2 KVH) D]
        if c.qk_norm:
            qkv = ops.qk_norm(qkv, layer["qk_norm"], s)
        qkv = ops.rope(qkv, *self._rope(layer), s)
        decode = self.native and meta.decode_only
        if "kv_from" in layer:
            j = layer["kv_from"]
            k, v = shared_kv[j]                                         # [T, KVH D] each
            if decode:
                attn = self.attention.decode(j, torch.cat([qkv, k, v], dim=1), meta)
            else:
                q, d = ops.split(qkv, s)[0], s.head_dim
                attn = self.attention(j, q, k.view(k.shape[0], -1, d), v.view(v.shape[0], -1, d), meta)
            return self._row_parallel(layer["o"], attn, b0)
        j = layer["kv"]
        if layer.get("kv_stash"):
            shared_kv[j] = gemma4.kv_rows(qkv, s)
        attn = self.attention.decode(j, qkv, meta) if decode else self.attention(j, *ops.split(qkv, s), meta)
        if gate is not None:
            attn = attn * torch.sigmoid(gate.float()).to(attn.dtype)
        return self._row_parallel(layer["o"], attn, b0)

    def _decode_layer(self, i: int, layer: dict, x: torch.Tensor, delta: torch.Tensor | None, positions: torch.Tensor,
                      meta: AttentionMeta) -> torch.Tensor:
        """Layer i of a pure decode step as one decode_layer_ op (csrc/decode_layer.cpp): the same kernels on the
        same tensors as the op-by-op body, so bit for bit its result, with ~9 dispatched torch calls fewer. x is
        updated in place; returns the layer's MLP output (the next layer's delta)."""
        c, kv = self.config, meta.kv
        w, qtypes, packed = layer["blocks"]
        moe = "moe" in layer
        out = torch.ops.tandem.decode_layer_.default(
            x, delta, layer["attn_norm"], layer["mlp_norm"], c.rms_norm_eps, w, qtypes, packed, layer["qkv"].bias,
            self.int8_act, self.cos, self.sin, positions, self.num_heads, self.num_kv_heads, c.head_dim,
            kv.cache.data, layer["kv"], kv.out_cache_loc, kv.kv_index, kv.seq_lens, self.scale, self.decode_bf16,
            layer.get("qk_norm"), not moe)
        return layer["moe"](out) if moe else out      # an MoE layer's op returns its experts' input

