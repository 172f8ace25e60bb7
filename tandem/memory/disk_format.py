"""The disk tier's entry format, shared by its index (memory/disk_tier.py, the scheduler's) and its reader and
writer (device/kv_disk.py, the device side's): one file a chunk of CHUNK_TOKENS tokens' KV.

An entry is keyed by a hash chain over the token ids: chunk j's key hashes chunk j-1's key and chunk j's ids, so
a key names the whole prefix up to the chunk's end (as vLLM's block hashes do), and the chain starts from the
engine's fingerprint (fingerprint.py: the weights, the arithmetic, the KV dtype), so another model or another
arithmetic never reads an entry. The file: MAGIC, a 4-byte header length, a JSON header (version, key, tokens,
fingerprint, payload bytes, crc32 of the payload), then the payload: each KV tensor's rows of the chunk's slots, in
the cache's tensor order, as the cache holds them (the same bits a RAM hit reads).

Written as NAME.tmp and renamed, so a write cut short (SIGKILL, a full disk) leaves no file with an entry's name;
a file that is truncated, corrupt or foreign anyway fails read_entry and is dropped.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib

import numpy as np

CHUNK_TOKENS = 64           # tokens an entry holds: a prompt's tail past its last whole chunk is recomputed
MAGIC = b"TDMKV\x00\x01\n"
VERSION = 1
SUFFIX = ".kv"
STATE_SUFFIX = ".st"        # a hybrid model's state entry (a linear-attention state and the KV of a chunk's tail)
_LEN = struct.Struct("<I")


def chain_keys(ids: list[int], n_chunks: int, seed: str) -> list[bytes]:
    """The keys of the first n_chunks whole chunks of ids (16 bytes each)."""
    keys, prev = [], root_key(seed)
    for j in range(n_chunks):
        chunk = np.asarray(ids[j * CHUNK_TOKENS:(j + 1) * CHUNK_TOKENS], dtype=np.int64).tobytes()
        prev = hashlib.blake2b(prev + chunk, digest_size=16).digest()
        keys.append(prev)
    return keys


def key_words(key: bytes) -> tuple[int, int]:
    """A key as the two int64 words a StepInput carries."""
    a, b = struct.unpack("<qq", key)
    return a, b


def words_key(a: int, b: int) -> bytes:
    return struct.pack("<qq", a, b)


def load_entries(ops):
    """A load list's entries (StepInput.kv_loads and kv_state_loads share the layout: key words, a word, n, then n
    slots): (key, that word, n, its slots) each."""
    i = 0
    while i < len(ops):
        n = int(ops[i + 3])
        yield words_key(int(ops[i]), int(ops[i + 1])), int(ops[i + 2]), n, ops[i + 4:i + 4 + n]
        i += 4 + n


def entry_path(folder: str, key: bytes, suffix: str = SUFFIX) -> str:
    return os.path.join(folder, key.hex() + suffix)


def state_key(parent: bytes, tail: list[int]) -> bytes:
    """A hybrid model's state entry: the state after the chunk `parent` ends and `tail` more tokens (their KV rides in
    the entry, as the whole chunks' KV rides in theirs)."""
    return hashlib.blake2b(b"state" + parent + np.asarray(tail, dtype=np.int64).tobytes(), digest_size=16).digest()


def root_key(seed: str) -> bytes:
    """The chain's start: the parent of chunk 0 (and of a state entry shorter than a chunk)."""
    return hashlib.blake2b(seed.encode(), digest_size=16).digest()


def encode(key: bytes, fingerprint: str, payload: bytes | memoryview, **extra) -> bytes:
    """An entry's file bytes: MAGIC, header length, JSON header (`extra` fields besides), payload."""
    header = json.dumps({"v": VERSION, "key": key.hex(), "tokens": CHUNK_TOKENS, "fp": fingerprint,
                         "bytes": len(payload), "crc": zlib.crc32(payload), **extra}).encode()
    return MAGIC + _LEN.pack(len(header)) + header + bytes(payload)


def write_entry(folder: str, key: bytes, fingerprint: str, payload: bytes | memoryview, suffix: str = SUFFIX,
                **extra) -> int:
    """Write an entry atomically (a temporary name, then a rename). Returns the file's bytes; OSError as raised."""
    path = entry_path(folder, key, suffix)
    tmp = f"{path}.{os.getpid()}.tmp"
    data = encode(key, fingerprint, payload, **extra)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(data)


class BadEntry(Exception):
    """An entry file that cannot be used: missing, truncated, corrupt or another engine's."""


def read_entry(path: str, key: bytes, fingerprint: str, check: bool = True, header: bool = False):
    """The payload of a valid entry for `key` under `fingerprint` (with header: and its header dict); BadEntry saying
    why otherwise. check=False skips the payload's crc32 (the device's re-read of a file the scheduler checked a
    moment ago)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise BadEntry("missing") from None
    except OSError as e:
        raise BadEntry(f"unreadable: {e}") from None
    m = len(MAGIC)
    if len(data) < m + _LEN.size or data[:m] != MAGIC:
        raise BadEntry("not an entry (bad magic)")
    (n,) = _LEN.unpack_from(data, m)
    try:
        h = json.loads(data[m + _LEN.size:m + _LEN.size + n])
    except ValueError:
        raise BadEntry("bad header") from None
    payload = memoryview(data)[m + _LEN.size + n:]
    if not isinstance(h, dict) or h.get("v") != VERSION or h.get("tokens") != CHUNK_TOKENS:
        raise BadEntry("another version")
    if h.get("fp") != fingerprint or h.get("key") != key.hex():
        raise BadEntry("another engine's or another prefix's")
    if h.get("bytes") != len(payload):
        raise BadEntry(f"truncated ({len(payload)} of {h.get('bytes')} payload bytes)")
    if check and h.get("crc") != zlib.crc32(payload):
        raise BadEntry("checksum mismatch")
    return (payload, h) if header else payload


def read_header(path: str) -> dict | None:
    """An entry's JSON header alone (a restart's scan of state entries), None where unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + _LEN.size)
            if len(head) < len(MAGIC) + _LEN.size or head[:len(MAGIC)] != MAGIC:
                return None
            (n,) = _LEN.unpack_from(head, len(MAGIC))
            return json.loads(f.read(n))
    except (OSError, ValueError):
        return None
