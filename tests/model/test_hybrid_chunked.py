"""The delta rule's chunked form in a served hybrid model: without batch invariance a long prompt's linear layers
take the native chunked op (Numerics.linear_chunk), and its logprobs stay close to the recurrent form's (the
default, batch_invariant)."""
from __future__ import annotations

import pytest
import torch

from tandem import SamplingParams
from tandem.kernels import available
from tandem.model.numerics import LINEAR_CHUNK
from tests.helpers.engine_checks import run_with
from tests.model.test_hybrid import tiny_hybrid

pytestmark = pytest.mark.skipif(not available(), reason="native kernels not built")


def test_chunked_prefill_logprobs_match_recurrent(tmp_path_factory, tmp_path, monkeypatch, make_llm):
    """A 100-token prompt in one step (full chunks and a tail per row), the exact mode (fp32 linears and
    attention) so that only the paths' sums differ: each prompt token's top logprobs alike."""
    assert 100 > LINEAR_CHUNK and 100 % LINEAR_CHUNK
    m = tiny_hybrid("qwen3_5", tmp_path_factory)
    prompt = [(7 * i + 3) % m["ref"].config.vocab_size for i in range(100)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=4, logprobs=4)
    got = {}
    for invariant in (True, False):
        llm = make_llm(m["hf"], kernels="native", kernels_act="fp32", batch_invariant=invariant,
                       max_prefill_tokens=512, prefix_cache=False, device_backend="inline",
                       cache_dir=str(tmp_path / "cache"))
        chunk = llm.engine.executor.model_runner.numerics.linear_chunk
        assert chunk == (0 if invariant else LINEAR_CHUNK)
        calls = []
        op = torch.ops.tandem.gated_delta_rule_chunked_
        monkeypatch.setattr(torch.ops.tandem, "gated_delta_rule_chunked_",
                            lambda *a: (calls.append(a[0].shape[0]), op(*a))[1])
        got[invariant] = run_with(llm, "serial", [prompt], params)[0]
        monkeypatch.undo()
        assert calls == ([] if invariant else [100] * 3)        # three linear layers, the prefill step only
    want, out = got[True], got[False]
    assert out.token_ids == want.token_ids
    for a, b in zip(out.prompt_logprobs[1:] + out.outputs[0].logprobs, want.prompt_logprobs[1:]
                    + want.outputs[0].logprobs):
        keys = sorted(b)
        assert sorted(a) == keys
        torch.testing.assert_close(torch.tensor([a[t] for t in keys]), torch.tensor([b[t] for t in keys]),
                                   atol=1e-4, rtol=1e-4)
