"""tp_reduce_chunks (model/row_parallel.py): o and down add their chunks' partials in one order, so TP 1, 2 and 3
give the same tokens and logprobs bit for bit on a quantized file with the default int8 kernels; without it
they do not (each rank's sum all-reduced: the grouping follows tp_size). Chunks that cut a quant block or do not
divide among the ranks are refused."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig

CHUNKS = 6          # TP 1, 2, 3
ENGINE = dict(kv_cache_tokens=2048, max_running_requests=8, device_threads=1, max_prefill_tokens=128)
SAMPLING = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, str]:
    """A tiny Llama with 6 heads and 6 KV heads (TP 2 and 3 fit), Q8_0 and Q5_1 (the int8 GEMM at every row
    count): hidden 192, MLP 384, so 6 chunks of o and down hold whole 32-weight blocks."""
    d = tmp_path_factory.mktemp("tp_canonical")
    hf = make_tiny_model(d / "hf", "llama", hidden_size=192, intermediate_size=384, num_attention_heads=6,
                         num_key_value_heads=6, num_hidden_layers=3, seed=3)
    return {q: str(write_tiny_gguf(d / f"{q}.gguf", hf, quant=q)) for q in ("Q8_0", "Q5_1")}


def prompts() -> list[list[int]]:
    """Short prompts (decode-sized steps) and a 300-token one (prefill chunks of 128)."""
    return [[5 + (11 * i + 3 * j) % 3000 for j in range(n)] for i, n in enumerate((3, 17, 40, 300))]


def run(path: str, tp: int, chunks: int) -> list[tuple]:
    llm = LLM(path, tp_size=tp, tp_reduce_chunks=chunks, **ENGINE)
    try:
        outs = llm.generate(prompts(), SAMPLING, use_tqdm=False)
        return [(o.token_ids, [sorted(lp.items()) for lp in o.outputs[0].logprobs]) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("quant", ["Q8_0", "Q5_1"])
def test_tp_sizes_give_the_same_bits(ggufs, quant):
    ref = run(ggufs[quant], 1, CHUNKS)
    for tp in (2, 3):
        assert run(ggufs[quant], tp, CHUNKS) == ref, f"tp {tp} differs from tp 1 with tp_reduce_chunks {CHUNKS}"


def test_without_chunks_the_grouping_shows(ggufs):
    """The check above can fail: the plain all-reduce of TP 3 rounds otherwise than TP 1 somewhere."""
    assert run(ggufs["Q8_0"], 3, 0) != run(ggufs["Q8_0"], 1, 0)


def test_bad_chunk_counts_are_refused(ggufs):
    with pytest.raises(ValueError, match="multiple of tp_size 2"):
        EngineConfig(tp_size=2, tp_reduce_chunks=3)
    with pytest.raises(ValueError, match="tp_reduce_chunks must be 0"):
        EngineConfig(tp_reduce_chunks=-1)
    with pytest.raises(ValueError, match="not 12 chunks of whole 32-weight blocks"):    # 192 / 12 = 16
        LLM(ggufs["Q8_0"], tp_reduce_chunks=12, **ENGINE)


def test_k_quant_blocks_are_checked_where_they_load(tmp_path):
    """Chunks of 32-weight multiples that cut a K-quant's 256-weight super-blocks: refused, naming the weight."""
    from tandem.kernels.quant import Q4_K, QuantWeight
    from tandem.model.row_parallel import chunk_width
    w = QuantWeight(torch.zeros(4, 2 * 144, dtype=torch.uint8), Q4_K, 512)
    assert chunk_width(512, 2, w, "down") == 256
    with pytest.raises(ValueError, match="256-weight blocks of down"):
        chunk_width(512, 4, w, "down")
