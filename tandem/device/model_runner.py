"""ModelRunner, the device side of a step: owns weights, KV cache, request table (req_to_token) and FutureMap.

An Executor calls it inline (InlineExecutor: CUDA streams, or CPU synchronously) or inside the CPU device process
(process/main.py); the code is the same.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..kernels.quant import INT8_ACT_QTYPES
from .kv_disk import DiskKV
from ..model.kv_cache import AttentionMeta, GroupedKVCache, PagedKVCache, kv_row_bytes
from ..model.llama import LlamaModel
from ..model.loader import load_weights
from ..model.recurrent_state import RecurrentState, state_bytes_per_row
from ..model.numerics import DTYPES, Cpu, NumericOptions, every_rank, native_kernels, resolve, wants_native
from .heap import release_load_memory
from ..model.shard import TPLayout, shard_state
from ..model.weights import in_layers, layer_index
from ..sampler import Logprobs, SamplingBatch, apply_token_bitmask, logprobs, prompt_logprobs, sample
from .verify import accepted_counts, kept_rows, stash_values
from .future_map import FutureMap
from .penalties import PenaltyState, apply_logit_bias
from .runner_spec import RunnerSpec
from .step import StepInput, prompt_logprob_targets
from .attention_layout import AttentionLayouts
from .step_layout import TokenLayout, token_layout
from .embed import mean_index, pooled

PROMPT_LOGPROB_ROWS = 256    # prompt positions whose logits exist at once (256 x 49,152 fp32: 50 MB)


def _layer_weights(state: dict) -> int:
    """Weights of the layers' matrices (the linears prefill_act="bf16" copies)."""
    return sum(t.numel() for k, t in state.items() if layer_index(k) is not None and len(t.shape) == 2)


def _free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class _StepTensors(NamedTuple):
    """What _prepare gives the forward and the sampler: one step's inputs on the device."""
    rows: torch.Tensor                  # [B] request-table row of each batch row
    positions: torch.Tensor             # [T]
    input_ids: torch.Tensor             # [T] host ids, and the FutureMap's where use_future
    meta: AttentionMeta
    index: torch.Tensor                 # [B (+ prompt positions)] flat tokens whose hidden states the head reads
    plp: tuple[np.ndarray, np.ndarray] | None    # prompt_logprob_targets(step)
    penalized: bool                     # this model runner samples and some row has penalties


@dataclass(frozen=True)
class ForwardOutput:
    """What one step gives back (ModelRunner.run), on the device; the executor copies what it needs to the host."""
    tokens: torch.Tensor                        # [B] sampled ids (a speculating row's draft positions included)
    logprobs: Logprobs | None = None            # of every row, where some row asked (step.num_logprobs)
    prompt_logprobs: Logprobs | None = None     # of the prompt positions asked (prompt_logprob_targets)
    embeddings: torch.Tensor | None = None      # [E, H] of the rows whose embedding is done (embed.pooled)


class ModelRunner:
    """tp: this model runner is one rank of a tensor-parallel group (device/parallel/tp.py): it holds its shard of the
    weights and KV heads, and only rank 0 samples (run returns None on the others).
    pp: this model runner is one pipeline stage (device/parallel/pp.py): its layers' weights and KV cache; only the
    last stage samples (run returns None on the others)."""

    def __init__(self, spec: RunnerSpec, state: dict[str, torch.Tensor] | None = None, tp=None,
                 pp=None) -> None:
        self.spec = spec
        self.config = spec.source.config
        self.device = torch.device(spec.device) if tp is None and pp is None else (tp or pp).device
        self.tp, self.pp = tp, pp
        self.samples = (tp is None or tp.rank == 0) and (pp is None or pp.last)
        dtype = DTYPES[spec.dtype]
        c = self.config
        group = tp or pp
        if tp is not None or (pp is not None and pp.spans_nodes):     # one node's stages share the executor's spec
            check_same(group.size, "tp rank" if tp is not None else "pipeline stage", "engine options",
                       spec.fingerprint())
        # The numeric path (model/numerics.py): the CPU's facts, then the weights', each every rank's
        options = NumericOptions.of(spec)
        cpu = Cpu.probe(library=wants_native(options, self.device, dtype)).agreed(group)
        native = native_kernels(options, cpu, self.device, dtype)
        owned = state is None                 # loaded here: the model may take its entries out as it builds
        if owned:
            state = load_weights(spec.source, quantized=native, layers=None if pp is None else pp.layers)
        # Before sharding, so that every tp rank sees the same: do the linears round x to int8?
        int8_blocks = any(getattr(t, "qtype", None) in INT8_ACT_QTYPES for t in state.values())
        layout = TPLayout.of(c, 1 if tp is None else tp.size, 0 if tp is None else tp.rank)
        if tp is not None:
            state = shard_state(state, c, layout)
        stage = range(c.num_layers) if pp is None else pp.layers
        # The KV cache's layers: the attention layers (but gemma4's KV-shared ones), with their KV heads and head dim
        kv_shapes = layout.kv_shapes(c, stage)
        num_layers = len(kv_shapes)
        linear_layers = sum(1 for i in stage if c.is_linear(i))         # a hybrid's: a state slot a row
        rows = spec.max_running + spec.spare_rows + 1
        if pp is not None:                  # a stage keeps its own layers' weights only
            state = {k: t for k, t in state.items() if in_layers(k, pp.layers)}
        bf16_fits, = every_rank(group, 2 * _layer_weights(state) <= _free_memory_bytes(self.device) // 4)
        self.numerics = n = resolve(options, cpu, self.device, dtype, c.head_dim, int8_blocks, bool(bf16_fits))
        kv_dtype = n.kv_dtype
        bytes_per_slot = max(1, sum(2 * kvh * kv_row_bytes(kv_dtype, d) for kvh, d in kv_shapes))
        if spec.kv_cache_tokens is not None:
            num_slots = spec.kv_cache_tokens
        else:
            weight_bytes = sum(t.numel() for t in state.values()) * dtype.itemsize
            free = _free_memory_bytes(self.device) - (weight_bytes if self.device.type == "cuda" else 0)
            free -= 2 * _layer_weights(state) if n.prefill_bf16 else 0    # the bf16 copies the model is to make
            free -= (rows + spec.state_checkpoints) * state_bytes_per_row(layout.local(c), linear_layers)
            num_slots = max(256, min(int(free * spec.kv_memory_fraction) // bytes_per_slot, 1 << 20))
            num_slots, = every_rank(group, num_slots)    # slot ids come from one scheduler: every rank holds all
        max_context = c.max_position_embeddings if spec.max_model_len is None else spec.max_model_len
        self.max_context = min(max_context, num_slots)
        self.num_slots = num_slots
        self.model = LlamaModel(c, state, self.max_context, self.device, n, tp=tp, pp=pp, consume_state=owned)
        del state
        release_load_memory()                # each weight held once: what loading read or copied goes back
        # Cascade extend attention (model/cascade.py): CPU's flash op gives the log-sum-exp it merges by. Not
        # under the native extend op (extend_native): it reads every row's whole kv_index in place, so the
        # step's view must keep the prefix's columns.
        cascade = (spec.shared_prefix_attention and self.device.type == "cpu" and not n.extend_native
                   and not any(layer["window"] for layer in self.model.layers))
        kvh, d = kv_shapes[0] if kv_shapes else (layout.kv_heads, c.head_dim)
        self.kv_cache = (PagedKVCache(num_slots, num_layers, kvh, d, kv_dtype, self.device) if len(set(kv_shapes)) <= 1
                         else GroupedKVCache(num_slots, kv_shapes, kv_dtype, self.device))
        # A hybrid's linear layers keep a state per request-table row (model/recurrent_state.py)
        self.recurrent = (RecurrentState(layout.local(c), linear_layers, rows, self.device, spec.state_checkpoints)
                          if linear_layers else None)
        self.kv_slot_bytes = sum(t[0].numel() * t.element_size() for t in self.kv_cache.tensors())
        self.kv_disk = (DiskKV(spec.kv_disk_folder, spec.kv_disk_fingerprint, self.kv_cache.tensors(),
                               () if self.recurrent is None else (self.recurrent.saved_conv, self.recurrent.saved_ssm))
                        if spec.kv_disk_folder else None)
        # Request table: req_to_token[row, position] = KV slot. Row 0 is the padding row.
        self.req_to_token = torch.zeros(rows, self.max_context, dtype=torch.int32, device=self.device)
        self.layouts = AttentionLayouts(self.device, self.req_to_token, self.kv_cache, self.model, cascade)
        self.future_map = FutureMap(rows, self.device, poison=spec.poison_future_map)
        self.embed_sums = {}                # mean pooling's sums, across a prompt's chunks (embed.pooled)
        self.penalties = PenaltyState(rows, c.vocab_size, self.device) if self.samples else None

    @torch.inference_mode()
    def save_kv(self, saves: np.ndarray, state_saves: np.ndarray, state_ops: np.ndarray) -> None:
        """The disk tier's saves an idle engine sends (no step in flight): the checkpoint copies of released rows
        still queued first (their state entries copy those checkpoints), then the saves."""
        if self.recurrent is not None and len(state_ops):
            self.recurrent.copy(state_ops, after_forward=False)
        self.kv_disk.run(saves, state_saves)

    def _tensor(self, a: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(a).to(device=self.device, dtype=dtype, non_blocking=True)

    @torch.inference_mode()
    def run(self, step: StepInput, masks: Callable[[], np.ndarray] | None = None,
            between: Callable[[int], None] | None = None) -> ForwardOutput | None:
        """Forward, sample and stash into the FutureMap. Returns the step's ForwardOutput, on the device (None on a
        tp rank other than 0 and on a pipeline stage but the last: they run the forward only).

        The grammar branch: with grammar rows, `masks()` gives their token bitmasks ([G, W] int32). It is
        called after the forward, so a mask the host computes while the forward runs (overlap loop) costs
        the device only the wait for what is left of it. The urgent-step branch: `between(i)` before each
        layer i > 0 may run other steps there, in nested() (process/main.py)."""
        if self.kv_disk is not None:       # the disk tier's copies: saves, then loads, then the forward
            self.kv_disk.run(step.kv_saves, step.kv_state_saves, step.kv_loads, step.kv_state_loads)
        inputs = self._prepare(step)
        if self.recurrent is not None and len(step.state_ops):
            self.recurrent.copy(step.state_ops, after_forward=False)    # released rows saved, resumed rows restored
        forward = self._forward(step, inputs, between)
        if self.recurrent is not None and len(step.state_ops):
            self.recurrent.copy(step.state_ops, after_forward=True)     # the states at this step's chunk ends
        if forward is None:
            return None
        logits, prompt_lp, embeddings = forward
        tokens, accepted, lp = self._sample(step, inputs, logits, masks)
        if accepted is not None and self.recurrent is not None:
            # verify runs' linear-attention states back to their kept tokens (model/verify_runs.py), before any
            # later step reads them
            self.model.roll_back(inputs.meta.recurrent, (accepted[1] + 1).tolist())
        self._stash(step, inputs.rows, tokens, accepted)
        return ForwardOutput(tokens, lp, prompt_lp, embeddings)

    def run_step(self, step: StepInput, masks: Callable[[], np.ndarray] | None = None,
                 between: Callable[[int], None] | None = None) -> torch.Tensor | None:
        """run()'s sampled ids alone [B] (None where it returns None): for callers that read nothing else (the draft
        model, benchmarks)."""
        out = self.run(step, masks, between)
        return None if out is None else out.tokens

    def _prepare(self, step: StepInput) -> _StepTensors:
        """The step's inputs on the device, from its host index arrays: the request table written (prefix hits,
        new slots), the FutureMap relayed, poisoned and read, the attention layout, the penalties' input ids."""
        if self.model.native:     # a process-wide switch of the op: set per step, engines may share a process
            torch.ops.tandem.shared_prefix_attention(int(self.spec.shared_prefix_attention))
        rows = self._tensor(step.rows)
        reads_ids = self.pp is None or self.pp.first or self.pp.last     # middle stages take hidden states
        if len(step.stash_rows) and (self.pp is None or self.pp.first):
            # The FutureMap relay (device/parallel/pp.py): ids the last stage sampled, through the host, before the
            # poison and the gather of this step (the order a single device stashes, poisons and gathers in).
            self.future_map.stash(self._tensor(step.stash_rows), self._tensor(step.stash_ids))
        if len(step.poison_rows) and reads_ids:
            self.future_map.poison(self._tensor(step.poison_rows))
        lay = token_layout(step.extend_lens, step.seq_lens)
        positions = self._tensor(lay.positions)                                  # [T]
        out_cache_loc = self._tensor(step.out_cache_loc)
        tok_req_row = rows if lay.one_each else self._tensor(step.rows[lay.tok_row])
        if len(step.prefix_slots):
            # Prefix cache hit: the row's leading positions point at KV slots the radix tree owns.
            plen = step.prefix_lens
            p_pos = np.arange(len(step.prefix_slots)) - np.repeat(np.cumsum(plen) - plen, plen)
            self.req_to_token[self._tensor(np.repeat(step.rows, plen)), self._tensor(p_pos)] = \
                self._tensor(step.prefix_slots, torch.int32)
        self.req_to_token[tok_req_row, positions] = out_cache_loc.to(torch.int32)
        input_ids = self._input_ids(step, lay, tok_req_row, reads_ids)
        meta = self.layouts.for_step(step, rows, positions, out_cache_loc, lay)
        if self.recurrent is not None:
            meta.recurrent = self.recurrent.rows_of(step.rows, step.extend_lens, step.seq_lens, step.draft_lens)
        plp = prompt_logprob_targets(step)          # (flat indices, target ids) of prompt logprobs, or None
        index = mean_index(step, meta.last_index if plp is None else torch.cat([meta.last_index, self._tensor(plp[0])]))
        penalized = self.samples and step.has_penalties
        if penalized:
            self.penalties.update_inputs(step, rows, self._tensor(lay.tok_row), positions, input_ids)
        return _StepTensors(rows, positions, input_ids, meta, index, plp, penalized)

    def _input_ids(self, step: StepInput, lay: TokenLayout, tok_req_row: torch.Tensor, reads_ids: bool) -> torch.Tensor:
        """[T]: the host's ids, where a row reads the FutureMap (decode) the token the previous step sampled for it,
        gathered on the device. A step whose every token reads it (pure decode) is the gather alone."""
        fut = step.use_future[lay.tok_row] != 0 if reads_ids else None
        if fut is not None and fut.all():
            return self.future_map.gather(tok_req_row)
        input_ids = self._tensor(step.input_ids)
        if fut is not None and fut.any():
            at = self._tensor(np.flatnonzero(fut))
            input_ids[at] = self.future_map.gather(tok_req_row[at])
        return input_ids

    def nested(self):
        """The context of a step run between two layers of another (urgent steps): its own gather buffers.
        Nothing else of a step outlives a layer but its residual stream (LlamaModel.final_hidden)."""
        return self.kv_cache.nested()

    def _forward(self, step: StepInput, inputs: _StepTensors, between=None
                 ) -> tuple[torch.Tensor, Logprobs | None, torch.Tensor | None] | None:
        """The layers, then the LM head: the rows' logits [B, V], the prompt positions' logprobs (the head run on
        them in pieces) and the embeddings done [E, H]. None where this model runner does not sample: a pipeline
        stage but the last (its hidden states went on to the next) or a tp rank other than 0 (the logits gather
        ends on rank 0)."""
        b = step.batch_size
        # [B (+ N + M), H]: each row's last token, the prompt positions whose logprobs were asked, mean pooling's
        hidden = self.model.final_hidden(inputs.input_ids, inputs.positions, inputs.meta, inputs.index, between)
        if hidden is None:
            return None                             # a pipeline stage but the last: sent on to the next
        embeddings, prompt_lp = pooled(step, hidden, self.embed_sums), None                 # [E, H]
        if inputs.plp is not None:
            prompt_lp = self._prompt_logprobs(hidden[b:], self._tensor(inputs.plp[1]), int(step.prompt_logprobs.max()))
        logits = self.model.logits(hidden[:b])                                     # [B, V]
        return None if logits is None else (logits, prompt_lp, embeddings)

    def _sample(self, step: StepInput, inputs: _StepTensors, logits: torch.Tensor,
                masks: Callable[[], np.ndarray] | None) -> tuple[torch.Tensor, tuple | None, Logprobs | None]:
        """Penalties, logit biases and grammar masks on the logits in place, then one token per row [B], the
        speculative rows' accepted counts (heads, acc) or None, the penalties' output counts and the logprobs
        of the rows that ask (None where none asks). The masks are waited for only here, after the forward."""
        rows, input_ids, penalized = inputs.rows, inputs.input_ids, inputs.penalized
        if penalized:
            self.penalties.apply(step, rows, logits, input_ids)
        if len(step.bias_rows):
            apply_logit_bias(step, logits)
        if len(step.grammar_rows):
            apply_token_bitmask(logits, self._tensor(step.grammar_rows),
                                torch.from_numpy(masks()).to(self.device, non_blocking=True))
        tokens = sample(logits, SamplingBatch.from_host(step.temperature, step.top_p, step.top_k, step.min_p,
                                                        step.draw_seed, self.device), native=self.model.native)
        accepted = None
        if (step.draft_lens > 0).any():
            accepted = accepted_counts(step.draft_lens, tokens, input_ids)         # verify.py's rule: (heads, acc)
        if penalized:
            self.penalties.count_outputs(step, rows, tokens,
                                         kept_rows(step.draft_lens, *accepted) if accepted is not None else None)
        # Logprobs of the rows that ask (all rows of the step are computed: one batched log_softmax).
        lp = None
        if (step.num_logprobs >= 0).any():
            lp = logprobs(logits, self._tensor(step.temperature, torch.float32), tokens, int(step.num_logprobs.max()))
        return tokens, accepted, lp

    def _stash(self, step: StepInput, rows: torch.Tensor, tokens: torch.Tensor, accepted: tuple | None) -> None:
        """FutureMap write: the next step of these rows reads its input ids from here, on the device (no host
        trip). A speculating request keeps the last token of its accepted run (verify.py), written once at its
        head row. The other tp ranks stash the same with the next step's broadcast."""
        st_rows, st_tokens = rows, tokens
        if accepted is not None:
            st_rows, st_tokens = stash_values(step.draft_lens, rows, tokens, *accepted)
        self.future_map.stash(st_rows, st_tokens)
        if self.tp is not None:
            self.tp.sampled(st_rows, st_tokens)

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, k: int) -> Logprobs | None:
        """Prompt logprobs of N positions (hidden [N, H], targets [N]) in bounded memory: the LM head runs on
        PROMPT_LOGPROB_ROWS positions at a time and only the chosen and top-k logprobs outlive a piece, never
        an [N, vocab] tensor (2048 x 49,152 fp32 logits and their log_softmax were 0.8 GB at a time). Under
        tp every rank runs the pieces (the logits gather is a collective); rank 0 returns them, others None."""
        parts = []
        for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):       # hidden's rows after N: mean pooling's
            logits = self.model.logits(hidden[i:min(i + PROMPT_LOGPROB_ROWS, len(targets))])
            if logits is not None:
                parts.append(prompt_logprobs(logits, targets[i:i + PROMPT_LOGPROB_ROWS], k))
        if not parts:
            return None
        return Logprobs(*(torch.cat([getattr(p, f) for p in parts]) for f in ("chosen", "top_ids", "top")))

def check_same(size: int, who: str, what: str, fingerprint: dict) -> None:
    """Every rank of the group raises the same clear error when the ranks (tp ranks or pipeline stages, on
    this machine or others) were started with different options."""
    every: list = [None] * size
    dist.all_gather_object(every, fingerprint)
    for r, fp in enumerate(every):
        diff = sorted(k for k in set(fp) | set(every[0]) if fp.get(k) != every[0].get(k))
        if diff:
            raise ValueError(f"{who} {r} was started with other {what} than {who} 0: {', '.join(diff)} "
                             f"differ (give every node the same model and engine options)")
