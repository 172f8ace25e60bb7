"""The engine: model source, device executor and scheduler, driven by the loop the config names.

The offline LLM API and the server's engine process both drive this class.
"""
from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
import uuid
from typing import Callable

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, StopStrings
from .device.ranks import runner_spec, rank_threads
from .memory.disk_folder import open_disk_tier
from .request import Req, StepOutput
from .model.recurrent_state import state_bytes_per_row
from .sampling_params import SamplingParams
from .scheduler.loops import LOOPS
from .scheduler.grammar import Grammars
from .scheduler.scheduler import Scheduler
from .scheduler.speculative import verify_rows
from .scheduler.urgent import UrgentSteps
from .speculative.speculation import Speculation
from .trace.recorder import Recorder

MAX_IDLE_SPINS = 10_000


class Engine:
    def __init__(self, config: EngineConfig, sink: Callable[[list[StepOutput]], None] | None = None,
                 poll: Callable[[], None] | None = None) -> None:
        from .model.loader import load_tokenizer, resolve_model
        from .model.row_parallel import check_chunks
        from .model.shard import check_tp_size
        from .device.parallel.pp import check_pp_size
        if config.node_rank > 0:
            raise ValueError(f"node_rank {config.node_rank} runs only device ranks, no engine: start it with "
                             f"`tandem serve --node-rank {config.node_rank} ...`")
        self.config = config
        self.source = resolve_model(config.model, config.cache_dir)
        self.model_config = self.source.config
        self.model_name = self.source.name
        check_tp_size(self.model_config, config.tp_size, self.model_name)
        check_chunks(self.model_config, config.tp_reduce_chunks, self.model_name)
        check_pp_size(self.model_config.num_layers, config.pp_size, self.model_name, config.pp_layer_partition)
        check_hybrid(self.model_config, config, self.model_name)
        config = self.config = fit_hybrid_state(self.model_config, config)
        spec = runner_spec(config, self.source)
        self.disk = open_disk_tier(config, self.source, self.model_config, self.model_name)
        if self.disk is not None:
            spec = spec.with_disk_tier(self.disk.folder, self.disk.fingerprint)
        self.device_threads: int | None = None
        if config.resolved_backend() == "process":
            from .device.process.executor import ProcessExecutor
            cap = config.max_model_len or self.model_config.max_position_embeddings
            if config.kv_cache_tokens is not None:
                cap = min(cap, config.kv_cache_tokens)
            threads = rank_threads(config, self.model_config)
            step_tokens = max(config.max_prefill_tokens, cap) + config.max_running_requests + spec.max_draft_rows
            # Prefix-cache hits send their cached slots once; no row's prefix is longer than the context.
            prefix_slots = cap * config.max_running_requests if config.prefix_cache else 0
            if self.disk is not None:
                self.disk.max_op_tokens = step_tokens     # the room the step buffers keep for its copies
            self.executor = ProcessExecutor(spec, threads, step_tokens, max_prefix_slots=prefix_slots,
                                        nnodes=config.nnodes, dist_init_addr=config.dist_init_addr,
                                        nests_steps=config.runs_urgent_steps())
            self.device_threads = threads
        else:
            from .device.executor import InlineExecutor
            self.executor = InlineExecutor(spec)
        try:
            self.tokenizer = load_tokenizer(self.source)     # while the device process loads the weights
            self.executor.wait_ready()
            drafter = self._drafter(config)
        except BaseException:
            self.executor.shutdown()
            if self.disk is not None:
                self.disk.close()
            raise
        if self.disk is not None:
            self.disk.set_slot_bytes(self.executor.kv_slot_bytes)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_context = self.executor.max_context
        self.recorder = Recorder(enabled=True, loop=config.scheduler,
                                 ring_steps=config.trace_ring_steps)
        self._sink = sink
        from .grammar import GrammarCompiler
        self.grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        speculation = Speculation(max_draft_rows=spec.max_draft_rows, max_verify_rows=verify_rows(spec),
                                  drafter=drafter)
        from .scheduler.policy import make_policy
        self.scheduler = Scheduler(config, self.executor, self._emit, self.recorder, poll, Grammars(self.grammar),
                                   speculation, make_policy(config), UrgentSteps(self.executor.nests_steps),
                                   recurrent=state_bytes_per_row(mc := self.model_config, len(mc.linear_layers)),
                                   disk=self.disk)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.output_tokens = 0
        self._closed = False

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        """Swap run-time options (e.g. the loop) between runs; the scheduler reads the same config.
        speculative_config may be switched off, or to one whose draft rows fit the buffers sized at start."""
        sc = config.speculative_config
        if hasattr(self, "scheduler") and sc is not None and sc.method == "draft_model" and \
                (self.scheduler.spec.drafter is None or sc.model != self.scheduler.spec.drafter.path):
            raise ValueError("speculative_config: a draft model is loaded at start; start the engine with it")
        if hasattr(self, "scheduler") and sc is not None and sc.extra_rows > self.scheduler.spec.max_draft_rows:
            raise ValueError(f"speculative_config needs {sc.extra_rows} draft rows a step; this engine was started "
                             f"with room for {self.scheduler.spec.max_draft_rows} (start it with that config)")
        self._config = config
        if hasattr(self, "scheduler"):
            self.scheduler.config = config

    def _drafter(self, config: EngineConfig):
        """The draft model of speculative_config method "draft_model" (checked against the target here)."""
        sc = config.speculative_config
        if sc is None or sc.method != "draft_model":
            return None
        from .speculative.draft import DraftModel
        return DraftModel(sc.model, self.model_config, self.tokenizer, config.max_running_requests,
                          self.executor.num_slots, self.executor.max_context, config.kernels, config.cache_dir,
                          kernels_act=config.kernels_act, prefill_act=config.prefill_act,
                          prefill_attention=config.prefill_attention, decode_attention=config.decode_attention)

    # ---- requests ------------------------------------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def make_request(self, prompt_ids: list[int], params: SamplingParams, rid: str | None = None) -> Req:
        """Validate and build a request; raises ValueError naming the field. Nothing is queued here."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        params.validate(vocab)
        if params.embed and self.config.pp_size > 1 and self.config.nnodes > 1:
            raise ValueError("embeddings are not served with pipeline stages on several nodes (the last stage's "
                             "results reach node 0 without them): use pp on one node, or tp")
        if not prompt_ids:
            raise ValueError("prompt is empty: give at least one token")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise ValueError("prompt token ids must be integers")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of range [0, {vocab})")
        if len(prompt_ids) + 1 > self.max_context:    # max_context is already capped by the KV cache
            raise ValueError(f"prompt has {len(prompt_ids)} tokens, more than this engine can hold "
                             f"(context {self.max_context}, KV cache {self.executor.num_slots} tokens, "
                             f"one generated token included)")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        req = Req(rid=rid or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}", prompt_ids=list(prompt_ids),
                  params=params, seed=seed, eos_token_ids=self.eos_token_ids,
                  max_len=self.max_context)
        if params.stop:
            req.stop_checker = StopStrings(self.detokenizer(prompt_ids, params), params.stop,
                                           params.include_stop_str_in_output)
        return req

    def detokenizer(self, prompt_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)

    def add_request(self, req: Req, bounded: bool = True) -> str:
        """Queue a validated request. `bounded`: refuse past max_waiting_requests (the server's 503)."""
        if bounded and len(self.scheduler.waiting) + len(self.scheduler.inbox) >= self.config.max_waiting_requests:
            raise OverflowError(f"waiting queue is full ({self.config.max_waiting_requests} requests)")
        self.scheduler.add(req)
        return req.rid

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    # ---- the loop ------------------------------------------------------------------------------------------
    def _emit(self, outputs: list[StepOutput]) -> None:
        self.output_tokens += sum(len(o.new_token_ids) for o in outputs)
        if self._sink is not None:
            self._sink(outputs)

    def run(self, idle: Callable[[], bool] | None = None) -> None:
        """Run the configured loop until `idle()` returns False (default: until no work is left)."""
        spins = 0

        def until_done() -> bool:
            nonlocal spins
            if not self.scheduler.has_work():
                return False
            grammars = self.scheduler.grammars
            if grammars is not None and grammars.compiling:
                time.sleep(0.001)             # waiting for a grammar to compile is progress, not a stall
                return True
            spins += 1
            if spins > MAX_IDLE_SPINS:
                raise RuntimeError(f"scheduler made no progress: {self.scheduler.stats()}")
            return True

        # Pipeline stages: "overlap" is the PP loop (the overlap loop at depth pp_size; loops.py), whose pick
        # keeps a request out of a second in-flight micro-batch: the overlap loop's one-step lag would gather
        # tokens the last stage has not relayed yet.
        loop = "pp" if self.config.pp_size > 1 and self.config.scheduler == "overlap" else self.config.scheduler
        yields = contextlib.nullcontext()
        if self.config.resolved_backend() == "process":
            from .device.process.host_thread import host_yields_to_device
            yields = host_yields_to_device()       # the device process goes first on the shared cores
        with yields:
            LOOPS[loop](self.scheduler, idle or until_done)

    def probe_device(self) -> None:
        """A no-op round trip to the device processes (ProcessExecutor.probe): blocks while one is stopped or
        stuck, DeviceProcessError if one died. Only with no step in flight (an idle loop)."""
        probe = getattr(self.executor, "probe", None)
        if probe is not None and not self.scheduler.result_queue:
            probe()

    def device_seen(self) -> float:
        """When the device last proved alive: the end of its newest processed step (a probe counts too, see
        EngineProc), on the clock of device.streams.now."""
        devices = self.recorder.devices
        return devices[-1].end if devices else float("-inf")

    def stats(self) -> dict:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                if self.config.trace_dir:
                    from .trace.export import write_live_trace
                    write_live_trace(self.recorder, self.config.trace_dir, self.model_name)
            finally:
                if self.scheduler.grammars is not None:
                    self.scheduler.grammars.shutdown()
                self.executor.shutdown()
                if self.disk is not None:
                    self.disk.close()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def check_hybrid(c, config: EngineConfig, name: str) -> None:
    """What a hybrid linear-attention model's state does not follow yet: a verify run's rejected drafts are taken
    back out of the state by the device that samples (model/verify_runs.py), which under tp is rank 0 alone."""
    if c.linear_layers and config.speculative_config is not None and config.tp_size > 1:
        raise ValueError(f"speculative_config: {name} is a hybrid linear-attention model ({c.architecture}); "
                         f"speculative decoding under tp_size > 1 does not take the other ranks' states back "
                         f"past rejected drafts yet: serve it with tp_size 1 or without speculation")


def fit_hybrid_state(c, config: EngineConfig) -> EngineConfig:
    """A hybrid model's states in state_memory_fraction of free memory: every running request holds one (a row of
    the request table, spare rows included), the prefix cache's checkpoints one each. Where they would not all fit,
    the checkpoints keep a third at most and fewer requests run, said once in the log (the states a verify step
    keeps, one a speculating request of it, count as rows): Qwen3.6-35B-A3B's state is
    ~66 MB, so 128 rows alone would take 8.8 GB."""
    if not c.linear_layers:
        return config
    import logging
    import os

    per = state_bytes_per_row(c, len(c.linear_layers)) // max(1, config.tp_size)
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fits = int(free * config.state_memory_fraction) // per
    spare = config.spare_rows() + 1
    if config.speculative_config is not None:      # a verify step keeps its runs' states (model/verify_runs.py)
        spare += config.speculative_config.disable_by_batch_size
    if config.max_running_requests + spare + config.checkpoints() <= fits:
        return config
    ckpts = min(config.checkpoints(), fits // 3)            # a third at most: a prefix cache that still hits
    rows = min(config.max_running_requests, max(1, fits - ckpts - spare))
    logging.getLogger(__name__).warning(
        "%s: a request's linear-attention state takes %.1f MB; state_memory_fraction %.2f of free memory holds %d: "
        "max_running_requests %d -> %d, state checkpoints %d -> %d", c.architecture, per / 1e6,
        config.state_memory_fraction, fits, config.max_running_requests, rows, config.checkpoints(), ckpts)
    return config.replace(max_running_requests=rows, state_checkpoints=ckpts)
