"""A request's host-side state and the records the engine hands back."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

import numpy as np

from .sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecState:
    """One request's state in the speculative branch (tandem/speculative/speculation.py and
    tandem/scheduler/speculative.py read and write it)."""
    # EMAs of accepted drafts and of draft trials per verified run (their ratio estimates a draft's acceptance;
    # the prior 0.6), and decode steps since it last drafted.
    acc: float = 0.6
    trials: float = 1.0
    skipped: int = 0
    probe_gap: int = 16                    # steps without drafts before a probe draft (speculation.PROBE_EVERY;
                                           # doubles while probes fail)
    probing: bool = False                  # its current draft is a probe
    # The overlap loop's assumption (scheduler/speculative.py): one entry per output token its launched but
    # unprocessed steps sample (len == num_launched - len(output_ids)), the token assumed there (a draft, or the
    # n-gram's continuation after the last draft), -1 where nothing is assumed. fill_ids() + guess is the text a
    # step picked now continues, if every in-flight run is accepted whole.
    guess: list[int] = field(default_factory=list)
    ngram: object | None = None            # its NgramIndex (speculative/ngram.py), built at its first proposal
    hold: float = 1.0                      # EMA of its drafting runs that held what a pick ahead assumes
    stale: bool = False                    # its FutureMap row holds a dropped step's token: the next head row
                                           # takes its last token from the host


@dataclass(eq=False)
class Req:
    """Host bookkeeping for one request.

    KV intervals (positions of prompt + output tokens):
      [0, kv_committed)          KV written by steps whose results were processed: valid and owned
      [kv_committed, allocated)  KV slots handed to launched steps still in flight (at most one step)
  Ownership of `slots`: [0, cached_len) belong to the radix prefix cache (locked through `cache_node`),
  [cached_len, allocated) to the request.
  Chunked prefill: admission allocates the whole fill, so during a prefill [filled, allocated) are slots of
  chunks not launched yet; `filled` counts positions whose KV-writing step was launched (== allocated once
  the last chunk is launched; decode keeps them equal).
    `num_launched` counts output tokens sampled by launched steps; `output_ids` holds those processed
    so far, so under the overlap loop `num_launched` runs one step ahead of `len(output_ids)`.
    """
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    eos_token_ids: frozenset[int] = frozenset()
    max_len: int = 0                       # prompt + output cap (context length)
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    finish_reason: str | None = None
    row: int = 0                           # request-table row; 0 means none held
    slots: list[int] = field(default_factory=list)   # KV slot of each position, len == allocated
    kv_committed: int = 0
    filled: int = 0                        # positions whose KV-writing step has been launched
    cached_len: int = 0                    # leading slots matched in the prefix cache at admission
    cache_node: object | None = None       # the radix node that match ends at, locked while running
    state_from: int | None = None          # hybrid models: the state checkpoint its first chunk resumes from
    prompt_state: tuple[int, int] | None = None   # hybrid: (length, checkpoint) of its prompt's state, saved before
                                           # the tree held its KV there (a batch mate's prefix); attached as it leaves
    num_cached_tokens: int | None = None   # prompt tokens served from the cache at first admission
    queue_time: float | None = None        # seconds from arrival to first admission (a retraction keeps it)
    num_launched: int = 0
    stood_aside: bool = False              # a started chunked prefill left one step to new arrivals (once a chunk)
    aborted: bool = False
    stop_checker: object | None = None     # StopStrings for requests with stop strings
    text: str | None = None                # final text when a stop string cut it
    error: str | None = None               # why the engine failed this request (finish_reason "error")
    error_status: int | None = None        # with error: 503 (waited past max_queue_time), 408 (its timeout passed)
    queue_deadline: float = math.inf       # max_queue_time: ended if still not admitted then (inf once admitted)
    deadline: float = math.inf             # its own timeout: ended wherever it is then
    sampling_row: tuple | None = None      # (temperature, top_p, top_k, min_p) as sent to the device; see prepare
    grammar: object | None = None          # GrammarMatcher of a structured-output request, once compiled
    prompt_lp: list | None = None          # prompt logprobs gathered over the prefill chunks, until sent
    spec: SpecState = field(default_factory=SpecState)   # the speculative branch's state of this request
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    @property
    def allocated(self) -> int:
        return len(self.slots)

    @property
    def prefilling(self) -> bool:
        """Admitted, with prefill chunks still to launch: invisible to decode until its last chunk."""
        return self.filled < self.allocated

    @property
    def finished(self) -> bool:
        return self.status is ReqStatus.FINISHED

    def fill_ids(self) -> list[int]:
        """Tokens a (re-)prefill computes: the prompt plus outputs kept across a retraction."""
        return self.prompt_ids + self.output_ids

    def prepare(self) -> None:
        """Convert what every step of this request sends to the device once, when the scheduler takes it in:
        a value the device arrays cannot hold fails this request there, not a batch mid-pick."""
        p = self.params
        row = (0.0 if p.greedy else float(p.temperature), float(p.top_p), int(p.top_k), float(p.min_p))
        np.array([row[2], self.seed], np.int64)          # raises OverflowError past int64
        self.sampling_row = row

    def max_new_tokens(self) -> int:
        cap = self.max_len - len(self.prompt_ids)
        return cap if self.params.max_tokens is None else min(cap, self.params.max_tokens)


@dataclass
class StepOutput:
    """What one processed step says about one request: the engine's only output record."""
    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    text: str | None = None                # set at finish when a stop string cut the text
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None               # set with finish_reason "error": the engine failed this request
    num_cached_tokens: int = 0             # prompt tokens whose KV came from the prefix cache
    # With SamplingParams.logprobs: per new token [its logprob, [[top id, top logprob], ...]]. (Fields are
    # encoded positionally by replicas/ipc.py: new ones go last, with a default.)
    logprobs: list | None = None
    # With SamplingParams.prompt_logprobs, on the first output: the same for prompt tokens 1.. (token 0 has none)
    prompt_logprobs: list | None = None
    # With finish_reason "error": the HTTP status the server answers with when it is not 500 (an engine fault):
    # 503 for a request that waited past max_queue_time, 408 for one whose own timeout passed.
    error_status: int | None = None
    queue_time: float | None = None        # with the first token: seconds it waited for its first admission
    # With SamplingParams.embed, on its only (finished) output: the prompt's vector, L2-normalized, as
    # little-endian float32 bytes (device/embed.py).
    embedding: bytes | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None   # per token: {token: logprob} of it and its top alternatives
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """Returned by LLM.generate, in input order (vLLM's shape, flattened for n=1)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None               # with finish_reason "error": why the engine failed this request
    num_cached_tokens: int = 0             # prompt tokens served from the prefix cache
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (None for the first)


@dataclass
class EmbeddingOutput:
    embedding: list[float] | None          # L2-normalized; None when the engine failed the request


@dataclass
class EmbeddingRequestOutput:
    """Returned by LLM.embed, in input order (vLLM's shape: .outputs.embedding)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    error: str | None = None               # why the engine failed this request
