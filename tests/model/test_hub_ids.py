"""Hub ids as models (model/hub.py): `org/name` (a safetensors repo) and `org/name:QUANT` / `org/name:file.gguf`
(a GGUF repo) resolved from a Hugging Face cache laid out as huggingface_hub lays it out, offline; the model is
served under its id; an id the cache lacks offline, an ambiguous GGUF repo and a split GGUF are clear errors."""
from __future__ import annotations

import os
import shutil

import pytest

from tandem.model.hub import is_hub_id
from tandem.model.loader import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def lay_out(cache, repo: str, files: dict[str, str]) -> str:
    """models--org--name/{refs/main, snapshots/COMMIT/...}: files copied from their sources (the real cache
    links them to blobs; huggingface_hub reads either)."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(COMMIT)
    for name, src in files.items():
        shutil.copy(src, snap / name)
    return str(snap)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hub"


def test_ids_and_paths_are_told_apart(tmp_path):
    assert is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("org/name:Q4_K_M") and is_hub_id("org/name:m.Q8_0.gguf")
    assert not is_hub_id("just-a-name") and not is_hub_id("/abs/path") and not is_hub_id("a/b/c")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not is_hub_id(str(tmp_path / "org" / "name"))


def test_a_safetensors_repo_from_the_cache(hub, tiny_llama):
    files = {n: os.path.join(tiny_llama, n) for n in os.listdir(tiny_llama)}
    snap = lay_out(hub, "org/tiny", files)
    src = resolve_model("org/tiny")
    assert src.name == "org/tiny" and src.weight_files[0].startswith(snap) and src.gguf_file is None


def test_a_gguf_repo_by_quantization_or_file(hub, tiny_llama, tmp_path, make_llm):
    from tests.helpers.tiny_models import write_tiny_gguf
    q8 = str(write_tiny_gguf(tmp_path / "q8.gguf", tiny_llama, quant="Q8_0"))
    f32 = str(write_tiny_gguf(tmp_path / "f32.gguf", tiny_llama, quant="F32"))
    lay_out(hub, "org/tiny-GGUF", {"tiny.Q8_0.gguf": q8, "tiny.F32.gguf": f32, "README.md": q8})
    src = resolve_model("org/tiny-GGUF:q8_0")
    assert src.name == "org/tiny-GGUF:q8_0" and src.gguf_file.endswith("tiny.Q8_0.gguf")
    assert resolve_model("org/tiny-GGUF:tiny.F32.gguf").gguf_file.endswith("tiny.F32.gguf")
    with pytest.raises(FileNotFoundError, match="2 GGUF files.*name one"):
        resolve_model("org/tiny-GGUF")
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        resolve_model("org/tiny-GGUF:Q2_K")
    llm = make_llm("org/tiny-GGUF:Q8_0", device_backend="inline")      # loads and generates from the cache
    assert llm.engine.model_name == "org/tiny-GGUF:Q8_0"
    assert len(llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0].token_ids) > 0


def test_offline_misses_and_split_files_are_clear_errors(hub, tmp_path):
    with pytest.raises(FileNotFoundError, match="org/absent.*HF_HUB_OFFLINE"):
        resolve_model("org/absent")
    part = tmp_path / "m-00001-of-00002.gguf"
    part.write_bytes(b"GGUF")
    lay_out(hub, "org/split", {"m-00001-of-00002.gguf": str(part)})
    with pytest.raises(ValueError, match="split GGUF"):
        resolve_model("org/split")
