"""The engines `tandem bench peers` compares, behind one interface: run(prompts, output_len) -> wall seconds.

Every run generates exactly output_len tokens per prompt (greedy, EOS ignored) in the calling process's
torch threads, or llama.cpp's own threads set to the same count. Prompts have equal lengths (no padding).
"""
from __future__ import annotations

import math
import os
import time

import torch

from .datasets import BenchRequest
from .offline import timed_generate


class Peer:
    name = ""
    batch_size: int | None = None     # the batch it ran with, where it has one
    max_prompts: int | None = None    # single-stream engines time a subset (the whole set takes too long)

    def run(self, prompts: list[list[int]], output_len: int) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TandemPeer(Peer):
    """One loop of a shared LLM; `max_running` caps the running batch (admission reads the config per step)."""

    def __init__(self, llm, loop: str, max_running: int | None = None) -> None:
        self.llm, self.loop, self.batch_size = llm, loop, max_running
        self.name = f"tandem {loop}"

    def run(self, prompts, output_len):
        cfg = self.llm.engine.config
        self.llm.engine.config = cfg.replace(max_running_requests=self.batch_size or cfg.max_running_requests)
        try:
            wall, _, n_out = timed_generate(self.llm, [BenchRequest(p, len(p), output_len) for p in prompts],
                                            self.loop)
        finally:
            self.llm.engine.config = self.llm.engine.config.replace(max_running_requests=cfg.max_running_requests)
        assert n_out == len(prompts) * output_len, (n_out, len(prompts), output_len)
        return wall


def load_hf_model(model_path: str):
    """transformers' own loader on the same weights: a .gguf file (dequantized to fp32) or a HF folder."""
    from transformers import AutoModelForCausalLM
    kw = {"dtype": torch.float32}
    if model_path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path) or ".",
                                                    gguf_file=os.path.basename(model_path), **kw).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, **kw).eval()


class HFGeneratePeer(Peer):
    """`model.generate` on static batches of `batch_size` prompts."""

    def __init__(self, model, batch_size: int) -> None:
        self.model, self.batch_size = model, batch_size
        self.name = "transformers generate"

    def run(self, prompts, output_len):
        from transformers import GenerationConfig
        gc = GenerationConfig(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len,
                              pad_token_id=0)
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, len(prompts), self.batch_size):
                ids = torch.tensor(prompts[i:i + self.batch_size])      # [b, L]: equal lengths, no padding
                out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
                assert out.shape[1] == ids.shape[1] + output_len, out.shape
        return time.perf_counter() - start


def hf_continuous_reason(model) -> str | None:
    if not hasattr(model, "continuous_batching_context_manager"):
        import transformers
        return f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    return None


class HFContinuousPeer(Peer):
    """transformers continuous batching (the manager behind `model.generate_batch`). Timed from adding the
    requests to the last result; starting and stopping the manager's thread is left out."""

    PAGE = 256

    def __init__(self, model, max_batch: int | None = None) -> None:
        self.model, self.batch_size = model, max_batch
        self.name = "transformers generate_batch"

    def run(self, prompts, output_len):
        from transformers import ContinuousBatchingConfig, GenerationConfig
        from transformers.generation.continuous_batching.utils import WorkloadHints
        gc = GenerationConfig(do_sample=False, max_new_tokens=output_len, eos_token_id=-1, pad_token_id=0)
        per_req = math.ceil((max(map(len, prompts)) + output_len) / self.PAGE)
        cb = ContinuousBatchingConfig(page_size=self.PAGE, num_blocks=per_req * len(prompts) + 2,
                                      max_requests_per_batch=self.batch_size)
        hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=output_len,
                              num_requests=len(prompts))
        with self.model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb,
                                                            block=True, timeout=5, warmup=False,
                                                            workload_hints=hints) as manager:
            start = time.perf_counter()
            ids = manager.add_requests(inputs=prompts, max_new_tokens=output_len)
            done: dict = {}
            while len(done) < len(ids):
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    if r.error:
                        raise RuntimeError(f"generate_batch request failed: {r.error}")
                    done[r.request_id] = r
                elif r is None and not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped")
            wall = time.perf_counter() - start
        assert all(len(r.generated_tokens) == output_len for r in done.values())
        return wall


def llama_cpp_reason(model_path: str) -> str | None:
    if not model_path.endswith(".gguf"):
        return "llama.cpp needs a GGUF file; the model is a Hugging Face folder"
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not importable ({e}); `pip install llama-cpp-python` builds it (~12 min)"
    return None


class LlamaCppPeer(Peer):
    """llama.cpp on the GGUF file itself (its own quantized kernels). batch_size 1: one request at a time
    through Llama.generate; batch_size b: b sequences decoded together in one llama_batch (llama.cpp's
    `batched` example) on a context of b sequences, greedy argmax over each row's logits."""

    def __init__(self, model_path: str, threads: int, batch_size: int, context_len: int) -> None:
        from llama_cpp import Llama
        self.batch_size, self.threads = batch_size, threads
        self.name = "llama.cpp single" if batch_size == 1 else "llama.cpp batched"
        self.llm = Llama(model_path=model_path, n_ctx=context_len, n_threads=threads, n_threads_batch=threads,
                         verbose=False)
        self.n_vocab = self.llm.n_vocab()
        self.ctx = self.batch = None
        self.context_len = context_len

    def _batched_context(self, prompt_len: int) -> None:
        import llama_cpp
        from llama_cpp import _internals
        b = self.batch_size
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = b * self.context_len
        cp.n_batch = max(b * prompt_len, b)          # the whole prefill of a group in one llama_decode
        cp.n_ubatch = min(cp.n_batch, 512)
        cp.n_seq_max = b
        cp.n_threads = cp.n_threads_batch = self.threads
        self.ctx = _internals.LlamaContext(model=self.llm._model, params=cp, verbose=False)
        self.batch = _internals.LlamaBatch(n_tokens=cp.n_batch, embd=0, n_seq_max=1, verbose=False)
        self.prompt_len = prompt_len

    def _argmax(self, i: int) -> int:
        import numpy as np
        return int(np.ctypeslib.as_array(self.ctx.get_logits_ith(i), shape=(self.n_vocab,)).argmax())

    def run(self, prompts, output_len):
        if self.batch_size == 1:
            start = time.perf_counter()
            for p in prompts:
                self.llm.reset()
                for n, _ in enumerate(self.llm.generate(p, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                                        repeat_penalty=1.0), 1):
                    if n == output_len:
                        break
            return time.perf_counter() - start
        if self.ctx is None or self.prompt_len != len(prompts[0]):
            self._batched_context(len(prompts[0]))
        start = time.perf_counter()
        for g in range(0, len(prompts), self.batch_size):
            group = prompts[g:g + self.batch_size]
            self.ctx.kv_cache_clear()
            self.batch.reset()
            last = []
            for s, p in enumerate(group):                 # prefill: every prompt, logits at its last token
                self.batch.add_sequence(p, s, False)
                last.append(self.batch.n_tokens() - 1)
            self.ctx.decode(self.batch)
            toks, pos = [self._argmax(i) for i in last], [len(p) for p in group]
            raw = self.batch.batch
            for _ in range(output_len - 1):               # decode: one token per sequence, row s = sequence s
                for s, tok in enumerate(toks):
                    raw.token[s], raw.pos[s], raw.n_seq_id[s], raw.logits[s] = tok, pos[s], 1, True
                    raw.seq_id[s][0] = s
                    pos[s] += 1
                raw.n_tokens = len(toks)
                self.ctx.decode(self.batch)
                toks = [self._argmax(s) for s in range(len(toks))]
        return time.perf_counter() - start

    def close(self) -> None:
        for obj in (self.batch, self.ctx, self.llm):
            if obj is not None and hasattr(obj, "close"):
                obj.close()
