"""The disk tier's files and index without an engine (memory/disk_format.py, memory/disk_tier.py): entries that are
truncated, corrupt or another engine's are refused and dropped, the size cap holds under churn, a restart finds
what the last run wrote, two servers on one folder take folders of their own, and a writer killed mid-write leaves
nothing that reads as an entry."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tandem.config import EngineConfig
from tandem.memory.disk_format import (CHUNK_TOKENS, BadEntry, chain_keys, entry_path, read_entry, words_key,
                                       key_words, write_entry)
from tandem.memory.disk_folder import parse_size
from tandem.memory.disk_tier import DiskTier

FP = "fp_test"
C = CHUNK_TOKENS


def _ids(n, base=1):
    return [(base * 7919 + 31 * i) % 50000 for i in range(n)]


def _write_chain(tier: DiskTier, ids: list[int], payload_bytes: int = 256) -> list[bytes]:
    """Entries for ids' whole chunks as the device writer makes them, then seen by the index."""
    keys = chain_keys(ids, len(ids) // C, FP)
    tier.save(ids, list(range(len(ids))))
    saves, loads, *_ = tier.take_ops()
    assert len(loads) == 0 and len(saves) == len(keys) * (2 + C)
    for e in saves.reshape(-1, 2 + C):
        key = words_key(int(e[0]), int(e[1]))
        write_entry(tier.folder, key, FP, bytes([key[0]]) * payload_bytes)
    return keys


def test_format_round_trip_and_refusals(tmp_path):
    key = chain_keys(_ids(C), 1, FP)[0]
    assert words_key(*key_words(key)) == key
    write_entry(str(tmp_path), key, FP, b"\x01\x02" * 100)
    path = entry_path(str(tmp_path), key)
    assert bytes(read_entry(path, key, FP)) == b"\x01\x02" * 100
    with pytest.raises(BadEntry, match="another engine"):
        read_entry(path, key, "fp_other")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-7])
    with pytest.raises(BadEntry, match="truncated"):
        read_entry(path, key, FP)
    flipped = bytearray(data)
    flipped[-50] ^= 0x40
    open(path, "wb").write(bytes(flipped))
    with pytest.raises(BadEntry, match="checksum"):
        read_entry(path, key, FP)
    open(path, "wb").write(b"not an entry at all")
    with pytest.raises(BadEntry, match="magic"):
        read_entry(path, key, FP)
    os.unlink(path)
    with pytest.raises(BadEntry, match="missing"):
        read_entry(path, key, FP)


def test_chain_keys_name_the_whole_prefix():
    a, b = _ids(3 * C), _ids(3 * C)
    b[5] += 1                                                     # one token early on: every later key differs
    ka, kb = chain_keys(a, 3, FP), chain_keys(b, 3, FP)
    assert all(x != y for x, y in zip(ka, kb))
    assert chain_keys(a, 3, "fp_other")[0] != ka[0]               # another engine's chain never meets this one's
    assert chain_keys(a + [1, 2, 3], 3, FP) == ka


def test_restore_reads_the_chain_past_the_ram_hit_and_drops_bad_entries(tmp_path):
    tier = DiskTier(str(tmp_path), 1 << 30, FP)
    ids = _ids(4 * C + 10)
    keys = _write_chain(tier, ids)
    got = tier.restorable(ids, 70)                # the RAM hit ends inside chunk 1: its tokens 6.. are read
    assert [(k, skip, n) for k, skip, n in got] == [(keys[1], 6, C - 6), (keys[2], 0, C), (keys[3], 0, C)]
    tier.load(got, list(range(sum(n for _, _, n in got))))
    saves, loads, *_ = tier.take_ops()
    assert len(saves) == 0 and loads[:4].tolist() == [*key_words(keys[1]), 6, C - 6]
    assert tier.stats.hits == 4 * C - 70
    # chunk 2 corrupted: the chain stops before it, the file is dropped, a warning and no error
    path = entry_path(tier.folder, keys[2])
    data = bytearray(open(path, "rb").read())
    data[-1] ^= 1
    open(path, "wb").write(bytes(data))
    assert [k for k, _, _ in tier.restorable(ids, 0)] == keys[:2]
    assert not os.path.exists(path) and keys[2] not in tier.index and tier.stats.bad == 1
    # another prompt: a miss
    assert tier.restorable(_ids(3 * C, base=5), 0) == [] and tier.stats.misses == 1


def test_size_cap_holds_under_churn_and_a_restart_finds_the_entries(tmp_path):
    payload = 10_000
    cap = 20 * (payload + 400)
    tier = DiskTier(str(tmp_path), cap, FP, slot_bytes=payload // C)
    for r in range(12):
        _write_chain(tier, _ids(3 * C, base=r + 1), payload)
        tier.sweep()
        on_disk = sum(os.path.getsize(os.path.join(tier.folder, f)) for f in os.listdir(tier.folder))
        assert on_disk <= cap and tier.used <= cap
    assert tier.stats.evicted > 0
    newest = _ids(3 * C, base=12)
    folder = tier.folder
    tier.close()
    open(os.path.join(folder, "deadbeef.kv.123.tmp"), "wb").write(b"half")   # a write a kill cut short
    again = DiskTier(str(tmp_path), cap, FP, slot_bytes=payload // C)
    assert again.folder == folder                 # the restarted server takes its folder back
    assert not any(f.endswith(".tmp") for f in os.listdir(folder))
    assert sum(n for _, _, n in again.restorable(newest, 0)) == 3 * C
    again.close()


def test_two_servers_on_one_root_take_folders_of_their_own(tmp_path):
    a, b = DiskTier(str(tmp_path), 1 << 30, FP), DiskTier(str(tmp_path), 1 << 30, FP)
    assert a.folder != b.folder
    a.close()
    c = DiskTier(str(tmp_path), 1 << 30, FP)
    assert c.folder == a.folder                   # freed by a's exit, taken by the next server
    b.close(), c.close()


_KILLED_WRITER = """
import sys
from tandem.memory.disk_format import write_entry
print("ready", flush=True)
while True:
    write_entry(sys.argv[1], bytes.fromhex(sys.argv[2]), "fp_test", b"\\x07" * (64 << 20))
"""


def test_a_writer_killed_mid_write_leaves_no_entry_read_as_valid(tmp_path):
    key = chain_keys(_ids(C), 1, FP)[0]
    for delay in (0.05, 0.2):
        p = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), key.hex()],
                             stdout=subprocess.PIPE)
        assert p.stdout.readline().startswith(b"ready")
        time.sleep(delay)
        p.send_signal(signal.SIGKILL)
        p.wait()
        path = entry_path(str(tmp_path), key)
        if os.path.exists(path):                  # a rename that landed: the whole entry, valid
            assert len(read_entry(path, key, FP)) == 64 << 20
        tier = DiskTier(str(tmp_path), 1 << 34, FP)   # a restart: the cut write's temporary file is gone
        assert not any(f.endswith(".tmp") for f in os.listdir(tier.folder))
        tier.close()


def test_a_write_error_disables_only_the_tier(tmp_path):
    import torch
    from tandem.device.kv_disk import DiskKV
    folder = tmp_path / "gone"
    folder.mkdir()
    kv = torch.zeros(2 * C, 3, dtype=torch.bfloat16)
    disk = DiskKV(str(folder), FP, [kv])
    folder.rmdir()                                # the folder taken away under the server: every write fails
    key = chain_keys(_ids(C), 1, FP)[0]
    disk.save(np.array([*key_words(key), *range(C)], np.int64))
    disk.flush()
    assert disk.failed is not None and not folder.exists()
    disk.save(np.array([*key_words(key), *range(C)], np.int64))    # later saves are dropped at once
    disk.close()


def test_device_side_copies_the_slots_bit_for_bit(tmp_path):
    import torch
    from tandem.device.kv_disk import DiskKV
    a = torch.randn(3 * C, 2, 4).to(torch.bfloat16)
    b = torch.randint(0, 255, (3 * C, 5), dtype=torch.uint8)
    src = DiskKV(str(tmp_path), FP, [a, b])
    key = chain_keys(_ids(C), 1, FP)[0]
    slots = list(range(2 * C - 1, C - 1, -1))     # the chunk's tokens in slots 127 .. 64
    src.save(np.array([*key_words(key), *slots], np.int64))
    src.flush()
    a2, b2 = torch.zeros_like(a), torch.zeros_like(b)
    dst = DiskKV(str(tmp_path), FP, [a2, b2])
    dst.load(np.array([*key_words(key), 10, C - 10, *range(C - 10)], np.int64))   # tokens 10.. into slots 0..
    want = torch.tensor(slots[10:])
    assert torch.equal(a2[:C - 10], a[want]) and torch.equal(b2[:C - 10], b[want])
    assert not a2[C - 10:].any()
    src.close(), dst.close()


def test_config_refusals():
    assert parse_size("20GiB") == 20 << 30 and parse_size("500MB") == 500 * 10**6 and parse_size("4096") == 4096
    for bad in ("-1G", "lots", "0", "12XB"):
        with pytest.raises(ValueError, match="kv_disk_size"):
            EngineConfig(kv_disk_dir="/tmp/x", kv_disk_size=bad)
    with pytest.raises(ValueError, match="prefix_cache"):
        EngineConfig(kv_disk_dir="/tmp/x", prefix_cache=False)
    with pytest.raises(ValueError, match="tp_size or pp_size"):
        EngineConfig(kv_disk_dir="/tmp/x", tp_size=2)


def test_an_eviction_drops_the_queued_saves_of_its_slots(tmp_path):
    """A slot the RAM cache evicts may go to an urgent step that runs before the next launch's copies: its queued
    save is dropped and unindexed, the others stay."""
    tier = DiskTier(str(tmp_path), 1 << 30, FP)
    ids = _ids(2 * C)
    keys = chain_keys(ids, 2, FP)
    tier.save(ids, list(range(100, 100 + 2 * C)))
    tier.forget_slots([100 + C + 3])              # a slot of the second chunk
    saves, *_ = tier.take_ops()
    assert saves.reshape(-1, 2 + C)[:, 2:].tolist() == [list(range(100, 100 + C))]
    assert keys[0] in tier.index and keys[1] not in tier.index and keys[1] not in tier.pending
    tier.save(ids, list(range(2 * C)), written=False)
    assert len(tier.take_idle_saves()[0]) == 2 + C and len(tier.take_idle_saves()[0]) == 0   # an idle engine: all
    tier.close()


def test_state_entries_index_survive_a_restart_and_the_deepest_valid_one_is_found(tmp_path):
    """A hybrid's state entries: keyed by their parent chunk and tail, found deepest first past the RAM state,
    with their KV chunks; a restart re-indexes them from their headers; a checkpoint id handed out again drops the
    save still queued for it."""
    tier = DiskTier(str(tmp_path), 1 << 30, FP, slot_bytes=4)
    tier.state_bytes = 100
    ids = _ids(2 * C + 30)
    _write_chain(tier, ids[:2 * C])
    for depth, cid in ((C + 5, 1), (2 * C + 20, 2)):
        tier.save_state(ids[:depth], list(range(depth % C)), cid, after_step=True)
    tier.take_ops()                               # the launch that runs the checkpoint copies
    *_, states, _ = tier.take_ops()               # the next one carries the state saves
    i = 0
    while i < len(states):                        # what the device writes for each
        key, tail = words_key(int(states[i]), int(states[i + 1])), int(states[i + 3])
        parent = words_key(int(states[i + 4]), int(states[i + 5]))
        write_entry(tier.folder, key, FP, b"s" * (tail + 100), ".st", parent=parent.hex(), tail=tail)
        i += 6 + tail
    kv, (key, tail, depth) = tier.restorable_state(ids, 10)
    assert (tail, depth) == (20, 2 * C + 20) and sum(n for _, _, n in kv) == 2 * C - 10
    assert tier.restorable_state(ids[:2 * C + 10], 10)[1][2] == C + 5     # too short for the deeper one
    folder = tier.folder
    tier.close()
    again = DiskTier(str(tmp_path), 1 << 30, FP)
    assert again.folder == folder and again.restorable_state(ids, 0)[1][2] == 2 * C + 20
    again.save_state(_ids(C + 3, base=9), [0, 1, 2], 7, after_step=False)
    again.forget_cid(7)
    assert len(again.take_idle_saves()[1]) == 0
    again.close()
