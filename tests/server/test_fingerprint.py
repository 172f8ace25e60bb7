"""OpenAI's system_fingerprint (tandem/fingerprint.py): on every completion, chat completion and stream chunk,
the same across requests of one server; a hash that moves with what decides the bits (the weights, an arithmetic
option, the kernel build and body) and not with what does not (the loop, threads, the prefix cache)."""
from __future__ import annotations

from tandem.config import EngineConfig
from tandem import fingerprint
from tandem.fingerprint import file_digest, source_digest, system_fingerprint


def test_every_response_and_chunk_carries_one_fingerprint(client):
    a = client.completions.create(model="tiny", prompt="hello there", max_tokens=3)
    b = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3, stream=True, stream_options={"include_usage": True}))
    texts = list(client.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True))
    fps = {a.system_fingerprint, b.system_fingerprint} | {c.system_fingerprint for c in chunks + texts}
    assert len(fps) == 1 and fps.pop().startswith("fp_")


def test_the_hash_follows_what_decides_the_bits(tmp_path, monkeypatch):
    w = tmp_path / "w.gguf"
    w.write_bytes(bytes(range(256)) * 40000)
    base = system_fingerprint(EngineConfig(), [str(w)])
    assert len(base) == 15 and base == system_fingerprint(EngineConfig(), [str(w)])
    for same in (dict(scheduler="serial"), dict(device_threads=1), dict(prefix_cache=False),
                 dict(max_prefill_tokens=64)):
        assert system_fingerprint(EngineConfig(**same), [str(w)]) == base, same
    for other in (dict(kernels_act="fp32"), dict(kv_cache_dtype="q8_0"), dict(batch_invariant=False),
                  dict(decode_attention="fp32")):
        assert system_fingerprint(EngineConfig(**other), [str(w)]) != base, other
    before = file_digest(str(w))
    data = bytearray(w.read_bytes())
    data[len(data) // 2] ^= 1                                   # one byte in the middle of the weights
    w.write_bytes(bytes(data))
    assert file_digest(str(w)) != before and system_fingerprint(EngineConfig(), [str(w)]) != base
    flipped = system_fingerprint(EngineConfig(), [str(w)])
    from tandem import kernels
    monkeypatch.setattr(kernels, "isa", lambda: "another-body")     # TANDEM_ISA=avx2, or another CPU
    monkeypatch.setattr(kernels, "available", lambda: True)
    body = system_fingerprint(EngineConfig(), [str(w)])
    assert body != flipped
    from tandem.kernels import library
    monkeypatch.setattr(library, "_path", "/x/tandem_kernels-0123456789abcdef.so")   # other sources or compiler
    assert system_fingerprint(EngineConfig(), [str(w)]) != body


def test_the_hash_follows_the_python_sources(tmp_path, monkeypatch):
    """Which op a token takes is decided in Python (model/attention_paths.py): a change there moves the hash where
    the version string stays."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not a source")
    before = source_digest(str(tmp_path / "pkg"))
    (tmp_path / "pkg" / "notes.txt").write_text("still not a source")
    assert source_digest(str(tmp_path / "pkg")) == before
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert source_digest(str(tmp_path / "pkg")) != before
    w = tmp_path / "w.gguf"
    w.write_bytes(b"GGUF" * 1000)
    base = system_fingerprint(EngineConfig(), [str(w)])
    monkeypatch.setattr(fingerprint, "package_digest", lambda: "another")
    assert system_fingerprint(EngineConfig(), [str(w)]) != base
