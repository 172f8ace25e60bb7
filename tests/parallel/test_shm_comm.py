"""The shared-memory collectives of tp ranks on one host (device/parallel/shm_collectives.py) against gloo's, in spawned
processes: all-reduce sums over ragged sizes and dtypes at 2 and 3 ranks (chunked through a small slot too),
every rank getting the same bits; the logits gather; the fallback to gloo when a rank opts out or sits on
another host; a peer that dies mid-op raises instead of hanging."""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import traceback

import pytest

SIZES = (1, 7, 576, 64 * 576 + 3, 3001)
DTYPES = ("float32", "bfloat16", "float16")


def _init(rank: int, size: int, store: str):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    return torch, dist


def _run(fn, size: int, tmp_path, *args) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(fn, r, size, str(tmp_path / "store"), errors, *args))
             for r in range(size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _worker(fn, rank: int, size: int, store: str, errors, *args) -> None:
    try:
        fn(rank, size, store, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise


def _sums(rank: int, size: int, store: str, slot_bytes: int) -> None:
    torch, dist = _init(rank, size, store)
    from tandem.device.parallel import shm_collectives as shm_comm
    shm_comm.SLOT_BYTES = slot_bytes
    shm = shm_comm.ShmComm.join(rank, size, True)
    assert shm is not None
    for dt in DTYPES:
        dtype = getattr(torch, dt)
        for n in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + n)
            exact = torch.randint(-64, 64, (n,), generator=g).to(dtype)     # sums exact in any order
            noisy = torch.randn(n, generator=g).to(dtype)
            for x, same_bits in ((exact, True), (noisy, size == 2)):        # a + b is a + b in any order
                ours, ref = x.clone(), x.clone()
                shm.all_reduce(ours)
                dist.all_reduce(ref)
                if same_bits:
                    assert torch.equal(ours, ref), (dt, n)
                else:                               # two orders of rounding: 2 eps of the terms' |sum| apart
                    mass = x.abs().float()
                    dist.all_reduce(mass)
                    bound = 2 * torch.finfo(dtype).eps * mass
                    assert ((ours.float() - ref.float()).abs() <= bound).all(), (dt, n)
                every = [torch.empty_like(ours) for _ in range(size)]
                dist.all_gather(every, ours)
                assert all(torch.equal(e, ours) for e in every), (dt, n)    # ranks stay bit-identical
    for rows in (1, 5, 64):
        x = torch.randn(rows, 301, generator=torch.Generator().manual_seed(rank))
        parts = [torch.empty_like(x) for _ in range(size)] if rank == 0 else None
        dist.gather(x, parts, dst=0)
        full = shm.gather_rows(x)
        assert (full is None) == (rank != 0)
        if rank == 0:
            assert torch.equal(full, torch.cat(parts, dim=1))
    shm.close()
    dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_all_reduce_and_gather_equal_gloo(size, tmp_path):
    _run(_sums, size, tmp_path, 4 << 20)


def test_ops_larger_than_a_slot_go_in_chunks(tmp_path):
    _run(_sums, 2, tmp_path, 4096)              # 4 KB slots: every size above 1024 fp32 is chunked


def _fallback(rank: int, size: int, store: str, why: str) -> None:
    torch, dist = _init(rank, size, store)
    from tandem.device.parallel import shm_collectives as shm_comm
    if why == "other host" and rank == 1:
        shm_comm.host_key = lambda: ("elsewhere",)
    assert shm_comm.ShmComm.join(rank, size, enabled=not (why == "opted out" and rank == 1)) is None
    dist.destroy_process_group()


@pytest.mark.parametrize("why", ["opted out", "other host"])
def test_gloo_stays_when_a_rank_opts_out_or_sits_elsewhere(why, tmp_path):
    _run(_fallback, 2, tmp_path, why)


def _dies(rank: int, size: int, store: str) -> None:
    torch, dist = _init(rank, size, store)
    from tandem.device.parallel import shm_collectives as shm_comm
    shm = shm_comm.ShmComm.join(rank, size, True, shm_comm.WaitPolicy(yield_s=0.001, check_s=0.01))
    if rank == 1:
        os._exit(0)                             # gone without posting: rank 0 must not wait forever
    with pytest.raises(RuntimeError, match="tp rank 1 died"):
        shm.all_reduce(torch.ones(8))
    os._exit(0)                                 # gloo's teardown would wait for the dead peer


def test_a_dead_peer_raises_instead_of_hanging(tmp_path):
    _run(_dies, 2, tmp_path)
