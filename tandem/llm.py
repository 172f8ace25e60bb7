"""The offline API: LLM(model, **config).generate(prompts, sampling_params) and .chat(conversations).

LLM(..., dp_size=D) with D > 1 runs D engine processes (the server's replicas and router, see
tandem/replicas/offline_pool.py) instead of one in-process engine; the outputs are the same.
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Sequence

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer
from .engine import Engine
from .device.embed import vector
from .request import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput, StepOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, dp_size: int = 1, router: str = "least-load",
                 **config: Any) -> None:
        """`dp_size` engine replicas (each its own engine process, pinned to its share of the cores) picked
        per request by `router` ("least-load" or "cache-aware"); 1: one engine in this process."""
        from .replicas.replica_set import DataParallel
        dp = DataParallel(dp_size, router)
        self.config = EngineConfig.from_kwargs(model, **config)
        self.engine: Engine | None = None
        self.pool = None
        if dp.size == 1:
            self.engine = Engine(self.config, sink=self._collect)
            self.tokenizer = self.engine.tokenizer
        else:
            from .model.loader import load_tokenizer, resolve_model
            from .replicas.offline_pool import ReplicaPool
            self.pool = ReplicaPool(self.config, dp)
            self.tokenizer = load_tokenizer(resolve_model(self.config.model, self.config.cache_dir))
        self._results: dict[str, list[StepOutput]] = {}
        self._prompt_logprobs: dict[str, list] = {}
        self._bar = None

    # ---- public API ----------------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = self._as_list(prompts)
        params = self._params_for(sampling_params, len(prompts))
        encoded = [(p, self._encode(p)) for p in prompts]
        return self._run(encoded, params, use_tqdm)

    def chat(self, conversations: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        texts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        params = self._params_for(sampling_params, len(texts))
        encoded = [(t, self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]
        return self._run(encoded, params, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool = True,
              pooling: str = "last") -> list[EmbeddingRequestOutput]:
        """vLLM's LLM.embed: each prompt's vector, L2-normalized, in input order. pooling: "last" (its last
        token's final-normed hidden state) or "mean" (the mean of every prompt position's; no prefix-cache hit).
        Prefill-only requests through the same scheduler as generate()."""
        prompts = self._as_list(prompts)
        params = [SamplingParams(max_tokens=1, temperature=0.0, embed=True, pooling=pooling) for _ in prompts]
        encoded = [(p, self._encode(p)) for p in prompts]
        outs = []
        for (prompt, ids), [rid] in zip(encoded, self._groups(encoded, params, use_tqdm, "embed")):
            last = self._results.pop(rid)[-1]
            vec = vector(last.embedding) if last.embedding is not None else None
            outs.append(EmbeddingRequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                                               EmbeddingOutput(vec), last.error))
        return outs

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> str:
        if not isinstance(conversation, list) or not all(isinstance(m, dict) and "role" in m for m in conversation):
            raise ValueError("a conversation is a list of {'role': ..., 'content': ...} messages")
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template (a base model): chat() cannot format messages; "
                             "use generate() with a text prompt")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def stats(self) -> dict:
        return self.engine.stats() if self.engine is not None else self.pool.stats()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        else:
            self.pool.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- internals -----------------------------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]      # one prompt of token ids
        for p in prompts:
            if not isinstance(p, (str, list)):
                raise ValueError(f"a prompt is a string or a list of token ids, got {type(p).__name__}")
        return prompts

    @staticmethod
    def _params_for(sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, dict):
            return [SamplingParams.from_dict(sampling_params) for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        sampling_params = list(sampling_params)
        if len(sampling_params) != n:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {n} prompts")
        return [SamplingParams.from_dict(p) if isinstance(p, dict) else p for p in sampling_params]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def _groups(self, encoded: list[tuple[Prompt, list[int]]], params: list[SamplingParams], use_tqdm: bool,
                desc: str = "generate") -> list[list[str]]:
        """Run the requests to the end: the request ids of each prompt's samples (outputs in self._results)."""
        if use_tqdm:
            from tqdm import tqdm
            self._bar = tqdm(total=sum(p.n for p in params), desc=desc, unit="req")
        try:
            return self._queue_and_run(encoded, params) if self.pool is None else \
                self._run_replicas(encoded, params)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None

    def _run(self, encoded: list[tuple[Prompt, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        groups = self._groups(encoded, params, use_tqdm)
        outs = []
        for (prompt, ids), group, p in zip(encoded, groups, params):
            samples = [self._completion(i, ids, rid, p) for i, rid in enumerate(group)]
            first, errors = samples[0][0], [e for _, e, _ in samples if e]
            outs.append(RequestOutput(group[0], prompt if isinstance(prompt, str) else None, ids, first.text,
                                      first.token_ids, first.finish_reason, [c for c, _, _ in samples],
                                      errors[0] if errors else None, num_cached_tokens=samples[0][2],
                                      prompt_logprobs=self._prompt_logprobs.pop(group[0], None)))
        return outs

    def _queue_and_run(self, encoded, params: list[SamplingParams]) -> list[list[str]]:
        """One engine in this process: the request ids of each prompt's samples, once all have finished."""
        # Validate everything before queueing anything: a bad input raises and leaves the engine untouched
        # (an invalid schema, regex or grammar included: compiling it is cached for the engine).
        for p in params:
            if p.structured_outputs is not None:
                self.engine.grammar.compile(p.structured_outputs)
        # A prompt with n > 1 becomes n requests (sample i with its own derived seed).
        groups = [[self.engine.make_request(ids, p.sample(i)) for i in range(p.n)]
                  for (_, ids), p in zip(encoded, params)]
        for req in (r for g in groups for r in g):
            self._results[req.rid] = []
            self.engine.add_request(req, bounded=False)
        self.engine.run()
        return [[r.rid for r in g] for g in groups]

    def _run_replicas(self, encoded, params: list[SamplingParams]) -> list[list[str]]:
        """dp_size > 1: the same requests through the replica pool (each replica validates its own)."""
        groups = [[f"req-{uuid.uuid4().hex}" for _ in range(p.n)] for p in params]
        plan = [(rid, ids, dataclasses.asdict(p.sample(i))) for ((_, ids), p, g) in zip(encoded, params, groups)
                for i, rid in enumerate(g)]
        for rid, _, _ in plan:
            self._results[rid] = []
        try:
            self.pool.run(plan, lambda o: self._collect([o]))
        except BaseException:
            for rid, _, _ in plan:
                self._results.pop(rid, None)
            raise
        return groups

    def _completion(self, index: int, ids: list[int], rid: str,
                    p: SamplingParams) -> tuple[CompletionOutput, str | None, int]:
        """One sample's output from its collected steps, its error if the engine failed it, and its prompt
        tokens served from the prefix cache."""
        steps = self._results.pop(rid)
        plp = next((s.prompt_logprobs for s in steps if s.prompt_logprobs is not None), None)
        if plp is not None:         # vLLM's shape: None for the first token, then {token: logprob, ...}
            self._prompt_logprobs[rid] = [None] + [{tok: chosen, **dict(top)} for tok, (chosen, top)
                                                       in zip(ids[1:], plp)]
        token_ids = [t for s in steps for t in s.new_token_ids]
        last = steps[-1] if steps else None
        text = last.text if last is not None and last.text is not None else \
            IncrementalDetokenizer(self.tokenizer, ids, p.skip_special_tokens).add(token_ids)
        reason = last.finish_reason if last is not None else None
        out = CompletionOutput(index, text, token_ids, reason)
        if p.logprobs is not None:
            per_token = [(tok, lp) for s in steps if s.logprobs for tok, lp in zip(s.new_token_ids, s.logprobs)]
            out.logprobs = [{tok: chosen, **{a: b for a, b in top if a != tok}} for tok, (chosen, top) in per_token]
            out.cumulative_logprob = sum(chosen for _, (chosen, _) in per_token)
        return out, last.error if last is not None else None, last.num_cached_tokens if last is not None else 0

    def _collect(self, outputs: list[StepOutput]) -> None:
        for o in outputs:
            if o.rid in self._results:
                self._results[o.rid].append(o)
            if o.finished and self._bar is not None:
                self._bar.update(1)
