"""The GGUF is the weights: tensors read from the file's memory map (native types as blocks, views where the
row bytes are kept), only the config and tokenizer cached (a few MB), equal to the fp32 dequantization the
cache used to hold, and a broken file refused with one clear error."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tandem import SamplingParams
from tandem.kernels.quant import NATIVE_QTYPES, Q4_K, Q5_0, Q6_K, Q8_0, QuantWeight
from tandem.model.gguf import weights as gguf_weights
from tandem.model.gguf.config import gguf_to_hf_name, unpermute_qk
from tandem.model.gguf.file import GGUFError, GGUFFile
from tandem.model.loader import default_model_path, load_weights, resolve_model

SMALL_CACHE = 5 << 20          # config + SmolLM2's tokenizer files: ~3.4 MB


def folder_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, fs in os.walk(d) for n in fs)


def safetensors_in(d) -> list[str]:
    return [n for _, _, fs in os.walk(d) for n in fs if n.endswith(".safetensors")]


def fp32_reference(path: str, config) -> dict:
    """The fp32 weights as cache format 1 wrote them: gguf-py's reader and dequantization, q/k un-permuted."""
    import gguf
    from gguf.quants import dequantize

    out = {}
    for t in gguf.GGUFReader(path).tensors:
        name = gguf_to_hf_name(t.name)
        a = dequantize(t.data, t.tensor_type).reshape(tuple(int(s) for s in reversed(t.shape)))
        if config.architecture == "llama" and ".q_proj." in name:
            a = unpermute_qk(a, config.num_heads)
        elif config.architecture == "llama" and ".k_proj." in name:
            a = unpermute_qk(a, config.num_kv_heads)
        out[name] = torch.from_numpy(np.array(a, dtype=np.float32))
    return out


def assert_same_weights(state: dict, ref: dict) -> None:
    assert set(state) == set(ref)
    for k, v in state.items():
        assert torch.equal(v.dequantize() if isinstance(v, QuantWeight) else v, ref[k]), k


@pytest.fixture
def q4_k_m_file(tmp_path, monkeypatch):
    """A tiny Llama of width 192 as llama.cpp writes Q4_K_M for it: Q5_0 + Q8_0 (K = 192), Q4_K + Q6_K (K = 512)."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf
    skip_gguf_tokenizer_build(monkeypatch)
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=192, intermediate_size=512)
    return write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", hf_dir, quant="Q4_K_M", with_tokenizer=False)


def test_q4_k_m_loads_from_the_file(q4_k_m_file, tmp_path, make_llm):
    cache = tmp_path / "cache"
    src = resolve_model(q4_k_m_file, cache_dir=str(cache))
    assert src.weight_files == (src.gguf_file,)
    assert folder_bytes(cache) < SMALL_CACHE and not safetensors_in(cache)
    state = load_weights(src, quantized=True)
    assert {v.qtype for v in state.values() if isinstance(v, QuantWeight)} == {Q5_0, Q8_0, Q4_K, Q6_K}
    ref = fp32_reference(q4_k_m_file, src.config)
    assert_same_weights(state, ref)
    assert_same_weights(load_weights(src), ref)                                # the torch path, in memory
    outs = []
    for opt in ("native", "torch"):
        llm = make_llm(q4_k_m_file, kernels=opt, kernels_act="fp32", cache_dir=str(cache), device_backend="inline")
        prompts = [llm.tokenizer.encode(t) for t in ["The capital of France is", "def fibonacci(n):"]]
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        outs.append([o.token_ids for o in res])
    assert outs[0] == outs[1]
    assert folder_bytes(cache) < SMALL_CACHE and not safetensors_in(cache)     # loading wrote nothing more


def test_kept_rows_are_views_of_the_map(q4_k_m_file, tmp_path):
    """Q6_K rows that are neither permuted nor fused are the file's bytes, not a copy; regrouped types own theirs,
    and so do the fp32 norms (they would hold the whole map)."""
    src = resolve_model(q4_k_m_file, cache_dir=str(tmp_path / "cache"))
    reader = GGUFFile(q4_k_m_file)
    lo = reader._map.ctypes.data
    hi = lo + reader._map.size
    state = gguf_weights.gguf_state_dict(reader, src.config, keep=NATIVE_QTYPES)

    def mapped(t: torch.Tensor) -> bool:
        return lo <= t.data_ptr() < hi
    down0 = state["model.layers.0.mlp.down_proj.weight"]
    assert down0.qtype == Q6_K and mapped(down0.data)
    assert not mapped(state["model.layers.1.mlp.down_proj.weight"].data)      # Q4_K: regrouped
    assert not mapped(state["model.layers.0.input_layernorm.weight"])
    before = open(q4_k_m_file, "rb").read()
    down0.data[0, 0] ^= 0xFF                                                    # copy-on-write: a private page
    assert open(q4_k_m_file, "rb").read() == before


def test_default_model_loads_from_the_file(tmp_path):
    cache = tmp_path / "cache"
    src = resolve_model(None, cache_dir=str(cache))
    assert src.weight_files == (os.path.abspath(default_model_path()),)
    assert folder_bytes(cache) < SMALL_CACHE and not safetensors_in(cache)
    state = load_weights(src, quantized=True)
    matrices = [k for k in state if k.endswith("proj.weight") or k == "model.embed_tokens.weight"]
    assert all(isinstance(state[k], QuantWeight) for k in matrices)
    assert_same_weights(state, fp32_reference(src.gguf_file, src.config))


@pytest.mark.parametrize("damage, message", [("half", "truncated"), ("header", "truncated"),
                                             ("magic", "not a GGUF file")])
def test_broken_gguf_is_one_clear_error(damage, message, q4_k_m_file, tmp_path):
    data = open(q4_k_m_file, "rb").read()
    bad = {"half": data[:len(data) // 2], "header": data[:100], "magic": b"GGML" + data[4:]}[damage]
    path = tmp_path / "broken.gguf"
    path.write_bytes(bad)
    with pytest.raises(GGUFError, match=message) as e:
        resolve_model(str(path), cache_dir=str(tmp_path / "cache"))
    assert str(path) in str(e.value)
    assert not [n for n in os.listdir(tmp_path / "cache") if n.startswith(("gguf-", ".tmp-"))]


def test_progress_bar_for_large_files(q4_k_m_file, tmp_path, monkeypatch, capsys):
    src = resolve_model(q4_k_m_file, cache_dir=str(tmp_path / "cache"))
    load_weights(src, quantized=True)
    assert "loading" not in capsys.readouterr().err                            # small and quick: no bar
    monkeypatch.setattr(gguf_weights, "LARGE_FILE_BYTES", 0)
    load_weights(src, quantized=True)
    assert "loading tiny-q4_k_m.gguf" in capsys.readouterr().err


def test_a_k_quant_model_keeps_each_weight_once(tmp_path, monkeypatch, make_llm):
    """Q4_K / Q6_K linears with int8 activations keep the packed copy alone (the row layout released): what the
    model holds for its matrices is the file's bytes, once (issue 46: a 1.12 GB file took 1.87 GB)."""
    from tests.helpers.tiny_models import make_tiny_model, skip_gguf_tokenizer_build, write_tiny_gguf

    from tandem.kernels.quant import packed_rows
    from tandem.model.linear import QLinear
    if packed_rows(Q4_K) == 0:
        pytest.skip("no packed GEMV body on this CPU")
    skip_gguf_tokenizer_build(monkeypatch)
    hf_dir = make_tiny_model(tmp_path / "hf", "llama", hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(tmp_path / "tiny-q4_k_m.gguf", hf_dir, quant="Q4_K_M", with_tokenizer=False)
    llm = make_llm(path, cache_dir=str(tmp_path / "cache"), device_backend="inline")
    model = llm.engine.executor.model_runner.model
    lins = [model.lm_head] + [layer[k] for layer in model.layers for k in ("qkv", "o", "gate_up", "down")]
    assert all(isinstance(lin, QLinear) and not lin.holds_rows for lin in lins)
    held = sum(pk.numel() for lin in lins for pk in lin.packed_parts)
    reader = GGUFFile(path)
    matrices = sum(t.nbytes for t in reader.tensors if len(t.shape) == 2 and t.name != "token_embd.weight")
    assert held == matrices
    res = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(res[0].token_ids) == 4
