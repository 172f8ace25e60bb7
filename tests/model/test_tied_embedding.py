"""A tied model whose LM head packs the matrix and drops its row layout (a Q4_K_M file's Q6_K embedding-and-head;
a Q8_0 one where its packed copy takes every row count) looks its tokens up in the head's packed copy
(tandem.packed_gather): the loaded model holds no row layout of the embedding, and its tokens, logprobs and
embeddings are bit for bit those of a model that keeps the rows. A pipeline stage or tensor-parallel rank shares
only where it holds both the embedding and the head."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem import kernels
from tandem.kernels.quant import Q6_K, Q8_0, QuantWeight
from tandem.model.numerics import Numerics

NATIVE_INT8 = Numerics(native=True, int8_act=True)     # the native ops, int8 activations

pytestmark = pytest.mark.skipif(not kernels.available() or torch.ops.tandem.gemv_packed_q8act_max_rows(Q6_K) == 0,
                                reason="needs the native kernels on a CPU with AVX2 (the packed copy)")


def _tied(root, quant: str) -> tuple[str, str]:
    """A tiny tied Llama written as `quant` (Q4_K_M: its embedding-and-head Q6_K), and a cache folder whose
    tokenizer is SmolLM2's (no slow build from the GGUF's metadata)."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem.model.loader import resolve_model
    hf = make_tiny_model(root / "hf", "llama", hidden_size=256, intermediate_size=512, tie_word_embeddings=True)
    path = write_tiny_gguf(root / f"tied-{quant}.gguf", hf, quant=quant, with_tokenizer=False)
    cache = str(root / "cache")
    with pytest.MonkeyPatch.context() as mp:
        skip_gguf_tokenizer_build(mp)
        resolve_model(path, cache_dir=cache)                  # the config and tokenizer, written once
    return path, cache


@pytest.fixture(scope="module")
def tied_q4km(tmp_path_factory) -> tuple[str, str]:
    return _tied(tmp_path_factory.mktemp("tied"), "Q4_K_M")


def _run(llm) -> list:
    from tandem import SamplingParams
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], list(range(100, 180))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    return [(o.token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("quant", ["Q4_K_M", "Q8_0"])
def test_tied_lookup_reads_the_heads_packed_copy_with_the_same_bits(quant, tied_q4km, tmp_path, make_llm,
                                                                    monkeypatch):
    """Q4_K_M: the Q6_K head always drops its rows. Q8_0: only where its packed copy takes every row count
    (AVX2: TANDEM_ISA=avx2 here), else the head keeps its rows and so does the embedding, as before."""
    import tandem.model.llama as llama
    from tandem.kernels.quant import BLOCK_BYTES, BLOCK_WEIGHTS, packed_rows
    from tandem.model.linear import ALL_ROWS
    path, cache = tied_q4km if quant == "Q4_K_M" else _tied(tmp_path, quant)
    llm = make_llm(path, cache_dir=cache, device_backend="inline")
    model = llm.engine.executor.model_runner.model
    head, qtype = model.lm_head, model.lm_head.parts[0].qtype
    assert qtype == (Q6_K if quant == "Q4_K_M" else Q8_0)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    if packed_rows(qtype) >= ALL_ROWS:
        assert model.embed is head and not head.holds_rows and head.parts[0].data.numel() == 0
        row_bytes = hidden // BLOCK_WEIGHTS[qtype] * BLOCK_BYTES[qtype]
        assert head.packed.numel() == -(-vocab // 16) * 16 * row_bytes         # the file's bytes (16-row groups)
    else:
        assert isinstance(model.embed, QuantWeight) and head.holds_rows
    ids = torch.arange(vocab)
    shared, shared_rows = _run(llm), model._embed(ids)
    llm.shutdown()
    # Today's model: the embedding keeps its own row layout beside the head's packed copy.
    monkeypatch.setattr(llama, "tied_table", lambda embed, head: embed)
    llm = make_llm(path, cache_dir=cache, device_backend="inline")
    kept = llm.engine.executor.model_runner.model
    assert isinstance(kept.embed, QuantWeight) and kept.embed.data.shape[1] > 0
    assert torch.equal(kept._embed(ids), shared_rows)
    assert _run(llm) == shared


def _state(path: str, cache: str) -> tuple:
    from tandem.model.loader import load_weights, resolve_model
    source = resolve_model(path, cache_dir=cache)
    return source.config, load_weights(source, quantized=True)


def test_only_a_stage_or_rank_holding_both_shares(tied_q4km):
    """pp: the first stage alone keeps the embedding's rows, the last alone packs the head and keeps the
    embedding only to make it (today's model), a single stage shares. tp: each rank's vocab shard of the
    embedding is its shard of the head, so a rank shares, and looks up its ids with zeros elsewhere."""
    from tandem.model.llama import LlamaModel
    from tandem.model.shard import TPLayout, shard_state
    config, state = _state(*tied_q4km)
    rows = state["model.embed_tokens.weight"]
    ids = torch.tensor([0, 1, 17, 24575, 24576, 30000, config.vocab_size - 1, 17])

    def model(pp=None, tp=None, st=state):
        return LlamaModel(config, dict(st), 64, numerics=NATIVE_INT8, pp=pp, tp=tp)

    def stage(first, last):
        return SimpleNamespace(first=first, last=last, layers=[0, 1])

    both, first, last = model(stage(True, True)), model(stage(True, False)), model(stage(False, True))
    assert both.embed is both.lm_head and not both.lm_head.holds_rows
    assert first.lm_head is None and first.embed is rows
    assert last.embed is rows and last.embed is not last.lm_head and not last.lm_head.holds_rows
    assert torch.equal(first._embed(ids), rows.rows(ids)) and torch.equal(both._embed(ids), rows.rows(ids))
    for rank in range(2):
        lay = TPLayout.of(config, 2, rank)
        tp = SimpleNamespace(size=2, rank=rank, all_reduce=lambda x: None)
        m = model(tp=tp, st=shard_state(dict(state), config, lay))
        assert m.embed is m.lm_head and not m.lm_head.holds_rows
        inside = ((ids >= lay.vocab_start) & (ids < lay.vocab_start + lay.vocab))[:, None]
        assert torch.equal(m._embed(ids), rows.rows(ids) * inside)
