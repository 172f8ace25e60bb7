"""The draft-model proposer: a smaller model with the target's tokenizer proposes k tokens per drafting request.

It runs in the scheduler's process on its own model_runner (own weights, KV cache and request table; the CPU, fp32),
so the target's device process is untouched. Per request it keeps the ids whose KV its cache holds; a proposal
first extends over what is new since (the tokens the target accepted, at least the last one), then decodes k - 1
more. Its draws are coupled to the target's: draft j of a request is sampled with the request's temperature /
top-k / top-p / min-p and the noise of the output position it stands for, so a draft that matches the target's
distribution is accepted for sampled requests too. Drafts only propose: verification decides every token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..device.model_runner import ModelRunner
from ..device.runner_spec import RunnerSpec
from ..device.step import StepInput
from ..memory.kv_allocator import KVSlotAllocator
from ..memory.radix_cache import common_prefix
from ..memory.req_table import ReqRowAllocator
from ..request import Req
from ..sampler import draw_seeds


@dataclass
class _DraftState:
    row: int
    slots: list[int] = field(default_factory=list)      # KV slot of each position held
    ids: list[int] = field(default_factory=list)        # the tokens whose KV the draft cache holds, by position


class DraftModel:
    def __init__(self, path: str, target_config, target_tokenizer, max_running: int, num_slots: int,
                 max_context: int, kernels: str, cache_dir: str | None = None, kernels_act: str = "int8",
                 prefill_act: str = "auto", prefill_attention: str = "auto", decode_attention: str = "auto") -> None:
        from ..model.loader import load_tokenizer, resolve_model
        self.path = path
        source = resolve_model(path, cache_dir)
        if source.config.vocab_size != target_config.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({source.config.vocab_size} tokens) "
                             f"differs from the target's ({target_config.vocab_size})")
        if source.config.linear_layers:
            raise ValueError(f"speculative_config: the draft model is a hybrid linear-attention model "
                             f"({source.config.architecture}): its state would keep the drafts the target rejects; "
                             f"draft with an attention-only model")
        if load_tokenizer(source).get_vocab() != target_tokenizer.get_vocab():
            raise ValueError("speculative_config: the draft model's tokenizer differs from the target's")
        spec = RunnerSpec(source=source, device="cpu", dtype="float32", max_running=max_running,
                            max_model_len=max_context, kv_cache_tokens=num_slots, kv_memory_fraction=0.1,
                            kernels=kernels, kernels_act=kernels_act, prefill_act=prefill_act,
                            prefill_attention=prefill_attention, decode_attention=decode_attention)
        self.model_runner = ModelRunner(spec)
        self.kv = KVSlotAllocator(self.model_runner.num_slots)
        self.rows = ReqRowAllocator(max_running)
        self.max_context = self.model_runner.max_context
        self.state: dict[Req, _DraftState] = {}
        self._steps = 0
        self.step_s: float | None = None        # EMA of one draft step's wall time (the adaptive rule's draft cost)

    def release(self, req: Req) -> None:
        """The request left (finish, abort, retraction): its draft row and slots go back."""
        st = self.state.pop(req, None)
        if st is not None:
            self.kv.free(st.slots)
            self.rows.free(st.row)

    def propose(self, want: dict[Req, int]) -> dict[Req, list[int]]:
        """Up to want[req] drafts for each request (fewer where the draft's context or memory runs out)."""
        plan = []
        kmax = max(want.values(), default=0)               # every row runs the same number of draft steps
        for req, k in want.items():
            fill = req.fill_ids()
            st = self.state.get(req)
            if k < 1 or len(fill) + kmax - 1 > self.max_context or (st is None and not self.rows.available()):
                continue
            if st is None:
                st = self.state[req] = _DraftState(self.rows.alloc())
            keep = common_prefix(st.ids, fill[:-1])     # positions whose KV still holds the right tokens
            need = len(fill) + kmax - 1 - len(st.slots)    # the new tokens' and the kmax - 1 drafts' positions
            if need > self.kv.available():
                continue
            if need > 0:
                st.slots.extend(self.kv.alloc(need))
            del st.ids[keep:]
            plan.append((req, st, fill, keep, k))
        if not plan:
            return {}
        steps = max(k for *_, k in plan)
        out: dict[Req, list[int]] = {req: [] for req, *_ in plan}
        every: dict[Req, list[int]] = {req: [] for req, *_ in plan}
        for j in range(steps):
            for (req, *_), tok in zip(plan, self._run(plan, j).tolist()):
                every[req].append(tok)
        for req, st, fill, keep, k in plan:
            out[req] = every[req][:k]
            st.ids = fill + every[req][:steps - 1]        # every input the draft cache has written, by position
        return {req: d for req, d in out.items() if d}

    def _run(self, plan: list, j: int) -> np.ndarray:
        """Step j of a proposal: j = 0 extends each row over its new tokens, j > 0 decodes draft j (the token
        the previous step sampled, read from the draft model_runner's FutureMap)."""
        ids, locs, ext, seq, fut, pos = [], [], [], [], [], []
        for req, st, fill, keep, k in plan:
            n = len(fill) + j
            if j == 0:
                ids.extend(fill[keep:])
                locs.extend(st.slots[keep:len(fill)])
                ext.append(len(fill) - keep)
            else:
                ids.append(0)
                locs.append(st.slots[n - 1])
                ext.append(1)
            seq.append(n)
            fut.append(int(j > 0))
            pos.append(len(req.output_ids) + j)                # the output position draft j + 1 stands for
        reqs = [p[0] for p in plan]
        samp = np.array([r.sampling_row for r in reqs], np.float64).reshape(len(reqs), 4)
        bias = ([], [], [])                 # the target's logit_bias and min_tokens bans (penalties are not drafted)
        for i, (r, p) in enumerate(zip(reqs, pos)):
            bans = (set(r.eos_token_ids) | set(r.params.stop_token_ids)) if p < r.params.min_tokens else set()
            for tok, val in ((r.params.logit_bias or {}) | dict.fromkeys(bans, -np.inf)).items():
                for lst, v in zip(bias, (i, tok, val)):
                    lst.append(v)
        self._steps += 1
        t = time.perf_counter()
        step = StepInput(
            step_id=self._steps, rows=np.array([p[1].row for p in plan], np.int64),
            extend_lens=np.array(ext, np.int64), seq_lens=np.array(seq, np.int64),
            use_future=np.array(fut, np.int64), input_ids=np.array(ids, np.int64),
            out_cache_loc=np.array(locs, np.int64), temperature=samp[:, 0].copy(), top_p=samp[:, 1].copy(),
            top_k=np.array([r.sampling_row[2] for r in reqs], np.int64), min_p=samp[:, 3].copy(),
            draw_seed=draw_seeds(np.array([r.seed for r in reqs], np.int64), np.array(pos, np.int64)),
            poison_rows=np.zeros(0, np.int64), bias_rows=np.array(bias[0], np.int64),
            bias_ids=np.array(bias[1], np.int64), bias_vals=np.array(bias[2], np.float64))
        out = self.model_runner.run_step(step).cpu().numpy()
        dt = time.perf_counter() - t
        self.step_s = dt if self.step_s is None else 0.8 * self.step_s + 0.2 * dt
        return out
