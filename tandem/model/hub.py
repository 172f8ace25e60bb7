"""Hugging Face Hub ids as models: `tandem serve --model org/name` (a safetensors repo), `org/name:Q4_K_M` (the
GGUF file of that quantization in a GGUF repo) or `org/name:file.gguf` (that file), as vLLM, SGLang and
llama.cpp's `-hf` take them.

The local Hub cache (huggingface_hub's layout, $HF_HUB_CACHE) is read first, so a model downloaded once serves
offline; where it lacks the files and HF_HUB_OFFLINE is not set, they are downloaded (a GGUF repo: only the
chosen file). Anything else is an error that names the id and what was tried.
"""
from __future__ import annotations

import fnmatch
import os
import re

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")
_CONFIG_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


def is_hub_id(model: str) -> bool:
    return bool(HUB_ID.match(model)) and not os.path.exists(model)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _pick_gguf(repo: str, files: list[str], tag: str | None) -> str:
    """The GGUF of `files` that the tag names (a file name, or a quantization matched case-insensitively); the
    only GGUF where no tag is given. Multi-part files (-00001-of-00002) are refused: not supported."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if tag is not None:
        ggufs = [f for f in ggufs if os.path.basename(f) == tag or
                 (not tag.lower().endswith(".gguf") and fnmatch.fnmatch(os.path.basename(f).lower(),
                                                                         f"*{tag.lower()}*"))]
    if len(ggufs) != 1:
        what = "no GGUF file" if not ggufs else f"{len(ggufs)} GGUF files ({', '.join(ggufs[:8])})"
        hint = "" if tag is not None or not ggufs else f"; name one: {repo}:<quantization or file name>"
        raise FileNotFoundError(f"{repo}{':' + tag if tag else ''}: {what} match{hint}")
    if re.search(r"-\d{5}-of-\d{5}\.gguf$", ggufs[0]):
        raise ValueError(f"{repo}: {ggufs[0]} is one part of a split GGUF; split files are not supported")
    return ggufs[0]


def hub_path(model: str) -> str:
    """The local path (a GGUF file or a model folder) of the Hub id `model`, from the cache or downloaded."""
    from huggingface_hub import HfApi, snapshot_download
    repo, _, tag = model.partition(":")
    tag = tag or None
    offline = _offline()
    cache = os.environ.get("HF_HUB_CACHE") or None      # read now, not at huggingface_hub's import
    try:
        local = snapshot_download(repo, local_files_only=True, cache_dir=cache)
    except Exception:                        # not in the cache (or only partly)
        local = None
    if local is not None:
        files = [os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs]
        if any(f.endswith(".gguf") for f in files) or tag is not None:
            try:
                return os.path.join(local, _pick_gguf(repo, files, tag))
            except FileNotFoundError:
                if offline:
                    raise
        elif os.path.isfile(os.path.join(local, "config.json")):
            return local
    if offline:
        raise FileNotFoundError(f"{model}: not in the local Hugging Face cache and HF_HUB_OFFLINE is set "
                                f"(download it once with network, or pass a local path)")
    try:
        files = HfApi().list_repo_files(repo)
        if any(f.endswith(".gguf") for f in files):
            name = _pick_gguf(repo, files, tag)
            return os.path.join(snapshot_download(repo, allow_patterns=[name], cache_dir=cache), name)
        if tag is not None:
            raise FileNotFoundError(f"{model}: the repo has no GGUF file for the tag {tag!r}")
        return snapshot_download(repo, allow_patterns=_CONFIG_FILES, cache_dir=cache)
    except (FileNotFoundError, ValueError):
        raise
    except Exception as e:
        raise FileNotFoundError(f"{model}: could not fetch it from the Hugging Face Hub "
                                f"({type(e).__name__}: {e})") from None
