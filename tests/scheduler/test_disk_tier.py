"""The prefix cache's disk tier in the engine (memory/disk_tier.py): a prefix evicted from RAM, or lost with a
restart, is read back with the same bits (tokens and logprobs as computed cold, both loops, chunked prefill, RAM
hits beside it, churn under a small KV cache), counted as cached tokens; the server reports it in usage and
/metrics."""
from __future__ import annotations

import time

import pytest

from tandem import SamplingParams
from tests.helpers.engine_checks import assert_no_leaks
from tests.scheduler.test_overlap import run_script

LOOPS = ("serial", "overlap")
C = 64


@pytest.fixture(scope="module")
def tiny_q8(tiny_llama, tmp_path_factory):
    """The tiny Llama as a Q8_0 GGUF: int8 linears, whose rows have the same bits at any row count (README: F32
    weights run MKL's GEMM, whose sums follow the row count, so a cached prefix may move a last bit there)."""
    from tests.helpers.tiny_models import write_tiny_gguf
    return write_tiny_gguf(tmp_path_factory.mktemp("q8") / "tiny-q8_0.gguf", tiny_llama, quant="Q8_0")


def _prompt(n, base=3):
    return [(base * 131 + 17 * i) % 900 + 5 for i in range(n)]


def _params(n=6):
    return SamplingParams(temperature=0, max_tokens=n, logprobs=2, ignore_eos=True)


def _landed(llm, timeout=30.0):
    """Wait until the device's writer has put every queued entry on disk."""
    end = time.monotonic() + timeout
    while llm.stats()["disk_pending"] and time.monotonic() < end:
        time.sleep(0.05)
    assert llm.stats()["disk_pending"] == 0


def _gen(llm, loop, prompts, params):
    llm.engine.config = llm.engine.config.replace(scheduler=loop)
    outs = llm.generate([list(p) for p in prompts], params, use_tqdm=False)
    assert_no_leaks(llm)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs], \
        [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("loop", LOOPS)
def test_evicted_prefix_comes_back_from_disk_with_the_same_bits(tiny_q8, make_llm, tmp_path, loop):
    llm = make_llm(tiny_q8, kv_disk_dir=str(tmp_path), max_prefill_tokens=96)    # chunks cut the restore's rest
    p = _prompt(3 * C + 21)
    cold, cached = _gen(llm, loop, [p], _params())
    assert cached == [0]
    _landed(llm)
    llm.engine.scheduler.memory.reset_prefix_cache()          # RAM forgets it
    warm, cached = _gen(llm, loop, [p], _params())
    assert warm == cold and cached == [3 * C]                  # whole chunks of the prompt but its last token
    s = llm.stats()
    assert s["disk_hits"] == 3 * C and s["disk_bytes_read"] > 0 and s["disk_bytes_written"] > 0
    # a RAM hit on the first chunks, the disk past it: a prompt sharing 100 tokens with one in RAM
    q = p[:100] + _prompt(2 * C, base=9)
    cold_q, _ = _gen(make_llm(tiny_q8, prefix_cache=False), loop, [q], _params())
    _gen(llm, loop, [q], _params())
    _landed(llm)
    llm.engine.scheduler.memory.reset_prefix_cache()
    _gen(llm, loop, [p[:100] + [7, 8]], _params(2))            # RAM holds p[:100] again
    again, cached = _gen(llm, loop, [q], _params())
    assert again == cold_q and cached == [(len(q) - 1) // C * C]


def test_churn_under_a_small_kv_cache_gives_the_cold_outputs(tiny_q8, make_llm, tmp_path):
    """Many prompts sharing long prefixes through a KV cache that holds a few: RAM evicts all the time, the disk
    serves, and every output equals the engine's without any cache."""
    prefixes = [_prompt(2 * C + 5, base=b) for b in range(4)]
    reqs = [(f"r{i}", prefixes[i % 4] + [50 + i, 60 + i], SamplingParams(temperature=0, max_tokens=5 + i % 3,
                                                                          ignore_eos=True)) for i in range(12)]
    plain = make_llm(tiny_q8, prefix_cache=False, kv_cache_tokens=1024)
    want = run_script(plain, "serial", reqs, {})
    llm = make_llm(tiny_q8, kv_disk_dir=str(tmp_path), kv_cache_tokens=320, max_running_requests=2)
    for loop in LOOPS:
        assert run_script(llm, loop, reqs, {}) == want
        _landed(llm)
    assert llm.stats()["disk_hits"] > 0


def test_retraction_beside_the_disk_tier_gives_the_cold_outputs(tiny_q8, make_llm, tmp_path):
    """Requests that outgrow the KV cache are retracted (their KV to the tree and the disk) and re-prefilled."""
    prefix = _prompt(2 * C + 2, base=31)
    reqs = [(f"r{i}", prefix + [i + 2] * (3 + i), SamplingParams(temperature=0, max_tokens=80, ignore_eos=True))
            for i in range(6)]
    want = run_script(make_llm(tiny_q8, prefix_cache=False, kv_cache_tokens=1024), "serial", reqs, {})
    llm = make_llm(tiny_q8, kv_disk_dir=str(tmp_path), kv_cache_tokens=300)
    for loop in LOOPS:
        before = llm.engine.scheduler.retractions
        assert run_script(llm, loop, reqs, {}) == want
        assert llm.engine.scheduler.retractions > before
        _landed(llm)


def test_a_corrupt_entry_costs_a_recompute_not_a_wrong_token(tiny_q8, make_llm, tmp_path):
    import os
    from tandem.memory.disk_format import chain_keys, entry_path, read_entry
    llm = make_llm(tiny_q8, kv_disk_dir=str(tmp_path))
    p = _prompt(3 * C + 5, base=11)
    cold, _ = _gen(llm, "overlap", [p], _params())
    _landed(llm)
    llm.engine.scheduler.memory.reset_prefix_cache()
    tier = llm.engine.disk
    path = entry_path(tier.folder, chain_keys(p, 2, tier.fingerprint)[1])
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x10                               # one bit of chunk 1's KV
    open(path, "wb").write(bytes(data))
    warm, cached = _gen(llm, "overlap", [p], _params())
    assert warm == cold and cached == [C]                      # chunk 0 from disk, the rest recomputed
    assert llm.stats()["disk_bad_entries"] == 1
    _landed(llm)                                               # the recomputed chunk is written again, whole
    assert os.path.getsize(path) == len(data)
    read_entry(path, chain_keys(p, 2, tier.fingerprint)[1], tier.fingerprint)       # checks its crc32


def test_two_engines_on_one_folder_keep_apart(tiny_q8, make_llm, tmp_path):
    a = make_llm(tiny_q8, kv_disk_dir=str(tmp_path))
    b = make_llm(tiny_q8, kv_disk_dir=str(tmp_path))
    assert a.engine.disk.folder != b.engine.disk.folder
    for llm, base in ((a, 21), (b, 22)):
        p = _prompt(2 * C + 3, base=base)
        cold, _ = _gen(llm, "overlap", [p], _params())
        _landed(llm)
        llm.engine.scheduler.memory.reset_prefix_cache()
        assert _gen(llm, "overlap", [p], _params()) == (cold, [2 * C])


def test_a_restart_hits_what_the_last_run_wrote(tiny_q8, make_llm, tmp_path):
    p = _prompt(2 * C + 9, base=5)
    first = make_llm(tiny_q8, kv_disk_dir=str(tmp_path))
    cold, _ = _gen(first, "overlap", [p], _params())
    _gen(first, "serial", [_prompt(2 * C + 3, base=6)], _params(1))   # one token: no decode step carries its saves
    first.shutdown()                                           # its queued writes land before it exits
    second = make_llm(tiny_q8, kv_disk_dir=str(tmp_path))
    warm, cached = _gen(second, "overlap", [p], _params())
    assert warm == cold and cached == [2 * C]
    assert _gen(second, "overlap", [_prompt(2 * C + 3, base=6)], _params(1))[1] == [2 * C]   # the idle flush wrote it
    assert second.stats()["disk_entries"] >= 4
    other = make_llm(tiny_q8, kv_disk_dir=str(tmp_path), kv_cache_dtype="float32")   # another arithmetic
    _, cached = _gen(other, "overlap", [p], _params())
    assert cached == [0]


def test_server_reports_restored_tokens_in_usage_and_metrics(tiny_llama, tmp_path):
    from tests.helpers.server_utils import ServerProcess
    args = ["--model", tiny_llama, "--kv-cache-tokens", "2048", "--device-threads", "1", "--served-model-name",
            "tiny", "--kv-disk-dir", str(tmp_path / "kv"), "--kv-disk-size", "64MiB"]
    prompt = " ".join(f"w{i}" for i in range(80))
    for run in range(2):
        srv = ServerProcess(args, str(tmp_path / f"server{run}.log"))
        try:
            client = srv.openai_client(timeout=60)
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0)
            cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
            if run == 0:
                assert cached == 0
            else:
                assert cached >= C and cached == (r.usage.prompt_tokens - 1) // C * C
                m = srv.metrics()
                assert m["tandem:kv_disk_hit_tokens_total"] == cached and m["tandem:kv_disk_bytes_read_total"] > 0
            client.close()
        finally:
            assert srv.stop() == 0, srv.log()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_hybrid_model_resumes_from_a_state_read_back_from_disk(tmp_path, make_llm, loop):
    """Qwen3.5-shaped (Gated DeltaNet layers beside attention): the prompt's state checkpoints go to disk with the KV
    of their tails, and after RAM (or a restart) lost them the request resumes from the deepest one, same bits."""
    from tests.helpers.tiny_hybrid import write_hybrid_gguf
    from tests.helpers.tiny_models import make_tiny_model
    model = write_hybrid_gguf(tmp_path / "h.gguf", make_tiny_model(tmp_path / "m", "qwen3_5"), quant="Q8_0",
                              with_tokenizer=True)
    p = _prompt(2 * C + 37, base=41)
    plain = make_llm(model, prefix_cache=False)
    want, _ = _gen(plain, loop, [p], _params())
    llm = make_llm(model, kv_disk_dir=str(tmp_path / "kv"), max_prefill_tokens=100)   # checkpoints at 100, 137..
    cold, _ = _gen(llm, loop, [p], _params())
    assert cold == want
    _landed(llm)
    llm.engine.scheduler.memory.reset_prefix_cache()
    warm, cached = _gen(llm, loop, [p], _params())
    assert warm == want and cached[0] >= 100, cached
    llm.shutdown()
    again = make_llm(model, kv_disk_dir=str(tmp_path / "kv"))
    after, cached = _gen(again, loop, [p + [9]], _params())      # a longer prompt: resumes at its prefix's state
    assert cached[0] >= 100 and after == _gen(plain, loop, [p + [9]], _params())[0]
