"""Where pipeline stages cut the layers (device/parallel/pp_split.py, pp_probe.py): the balanced cut is the best
contiguous one (checked against every cut), "even" and a given cut are honoured, bad cuts are refused before
anything starts, the probe measures a layer of each kind and the head on a real model runner, and a stage loads
only its own layers' weights."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.device.parallel import pp_probe
from tandem.device.parallel.pp import check_pp_size
from tandem.device.parallel.pp_split import balanced_sizes, check_partition_text, even_sizes, micro_batch, ranges


def brute_force(costs: list[float], p: int, first: float, last: float) -> float:
    """The least max stage cost over every contiguous cut."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(costs)), p - 1):
        bounds = (0, *cuts, len(costs))
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[0] += first
        stage[-1] += last
        best = min(best, max(stage))
    return best


def stage_costs(sizes: list[int], costs: list[float], first: float, last: float) -> list[float]:
    out = [sum(costs[r.start:r.stop]) for r in ranges(sizes)]
    out[0] += first
    out[-1] += last
    return out


def test_the_balanced_cut_is_the_best_contiguous_cut():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 9)
        p = rng.randint(1, n)
        costs = [rng.uniform(0.5, 2.0) for _ in range(n)]
        first, last = rng.uniform(0, 1), rng.uniform(0, 6)
        sizes = balanced_sizes(costs, p, first, last)
        assert len(sizes) == p and min(sizes) >= 1 and sum(sizes) == n
        assert max(stage_costs(sizes, costs, first, last)) == pytest.approx(brute_force(costs, p, first, last))


def test_equal_layers_and_a_head_of_six_layers_cut_18_12():
    """SmolLM2's measured shape: 30 equal layers, a head of ~6 of them; no head gives the even cut."""
    assert balanced_sizes([1.0] * 30, 2, 0.0, 6.0) == [18, 12]
    assert balanced_sizes([1.0] * 30, 4, 0.0, 0.0) == even_sizes(30, 4) == [8, 8, 7, 7]
    assert [list(r) for r in ranges([2, 1])] == [[0, 1], [2]]


def test_bad_cuts_are_refused_before_anything_starts():
    assert check_partition_text("auto", 2) is None and check_partition_text("even", 3) is None
    assert check_partition_text("19,11", 2) == [19, 11]
    for text, words in (("19,x", "comma-separated"), ("10,10,10", "names 3 stages"), ("30,0", "at least one")):
        with pytest.raises(ValueError, match=words):
            check_partition_text(text, 2)
    with pytest.raises(ValueError, match="sums to 29 layers"):
        check_pp_size(30, 2, "SmolLM2", "19,10")
    with pytest.raises(ValueError, match="needs pp_size > 1"):
        EngineConfig(pp_layer_partition="2,1")
    with pytest.raises(ValueError, match="names 3 stages"):
        EngineConfig(pp_size=2, pp_layer_partition="1,1,1")


def test_the_probe_micro_batch_follows_the_pp_loop():
    assert micro_batch(64, 2) == 32 and micro_batch(5, 2) == 3 and micro_batch(1000, 2) == 32 and micro_batch(1, 4) == 1


def test_layer_kinds_tell_block_types_and_shapes_apart():
    """A Q4_K_M-like mix: some layers' down projection Q6_K; the probe builds one layer of each kind."""
    from types import SimpleNamespace
    c = SimpleNamespace(num_layers=4, is_linear=lambda i: i == 3, is_moe=lambda i: False, window=lambda i: 0,
                        layer_head_dim=lambda i: 64, layer_kv_heads=lambda i: 2, mlp_width=lambda i: 128)
    index = {f"model.layers.{i}.mlp.down_proj.weight": ("14" if i in (0, 2) else "12", 100 + 10 * i)
             for i in range(4)}
    index["model.embed_tokens.weight"] = ("8", 5000)
    kinds, size = pp_probe.layer_kinds(c, index)
    assert kinds[0] == kinds[2] != kinds[1] and kinds[3][0] is True
    assert size == [100, 110, 120, 130]
    reps = pp_probe.representatives(kinds)
    assert reps == [0, 1, 3]
    costs = pp_probe.spread(kinds, size, reps, {0: 2.0, 1: 1.0, 3: 4.0})
    assert costs == [2.0, 1.0, 2.0, 4.0]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    from tests.helpers.tiny_models import make_tiny_model, write_tiny_gguf
    llama = make_tiny_model(tmp_path_factory.mktemp("cut-llama"), "llama", num_hidden_layers=3)
    return write_tiny_gguf(tmp_path_factory.mktemp("cut-q8") / "tiny-q8_0.gguf", llama, quant="Q8_0")


def test_the_probe_times_every_layer_and_the_head(three_layers):
    from tandem.device.ranks import runner_spec
    from tandem.model.loader import resolve_model
    config = EngineConfig(model=three_layers, pp_size=2, device="cpu", max_running_requests=8)
    costs = pp_probe.measure(runner_spec(config, resolve_model(three_layers)), torch.device("cpu"), 4)
    assert len(costs.layers) == 3 and costs.batch == 4
    assert all(t > 0 for t in costs.layers) and costs.head > 0 and costs.embed > 0


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_moe", "gemma3"])
def test_the_probe_builds_one_layer_of_each_kind(arch, tmp_path):
    """Linear-attention and attention layers, experts and dense MLPs, sliding and global layers: one of each is
    built and timed, every layer gets its kind's cost."""
    from tests.helpers.tiny_models import make_tiny_model
    from tandem.device.ranks import runner_spec
    from tandem.model.loader import resolve_model
    path = make_tiny_model(tmp_path, arch)
    source = resolve_model(path)
    c = source.config
    kinds, _ = pp_probe.layer_kinds(c, pp_probe.weight_index(source))
    reps = pp_probe.representatives(kinds)
    assert len(reps) == len(set(kinds)) > 1 and [kinds[i] for i in reps] == sorted(set(kinds), key=kinds.index)
    costs = pp_probe.measure(runner_spec(EngineConfig(model=path, pp_size=2, device="cpu"), source),
                             torch.device("cpu"), 3)
    assert len(costs.layers) == c.num_layers and min(costs.layers) > 0 and costs.head > 0
    assert all(costs.layers[i] == costs.layers[reps[[kinds[r] for r in reps].index(k)]] for i, k in enumerate(kinds))


def test_a_stage_loads_only_its_layers(three_layers):
    from tandem.model.loader import load_weights, resolve_model
    from tandem.model.weights import layer_index
    source = resolve_model(three_layers)
    full = load_weights(source, quantized=True)
    part = load_weights(source, quantized=True, layers=[1])
    assert {layer_index(k) for k in part} == {None, 1}
    assert set(part) == {k for k in full if layer_index(k) in (None, 1)}


@pytest.mark.parametrize("partition, cut", [("2,1", [2, 1]), ("even", [2, 1]), ("auto", None)])
def test_every_cut_gives_pp1s_tokens(three_layers, partition, cut):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[3 + (7 * i + 5 * j) % 400 for j in range(4 + 9 * i)] for i in range(4)]
    engine = dict(kv_cache_tokens=1024, max_running_requests=8, device_threads=1)
    ref = LLM(three_layers, **engine)
    try:
        want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    finally:
        ref.shutdown()
    llm = LLM(three_layers, pp_size=2, pp_layer_partition=partition, **engine)
    try:
        got_cut = llm.engine.executor.pp_cut
        assert got_cut == cut if cut is not None else (sum(got_cut) == 3 and min(got_cut) >= 1)
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
    finally:
        llm.shutdown()
