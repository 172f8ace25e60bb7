"""What the tensor-parallel ranks other than rank 0 run, and the start of node R > 0 (device/ranks.py spawns them).

On node 0 the ProcessExecutor starts rank 0 (the device process) and this node's other ranks; on node R > 0,
`tandem serve --node-rank R` starts that node's ranks (run_node) and waits for them: no scheduler, no HTTP
server there. A rank is `python -m tandem.device.parallel.tp_worker` with (RunnerSpec, DistInfo) pickled on stdin;
it dies with its parent (PR_SET_PDEATHSIG) and exits when rank 0 quits or a collective fails.
"""
from __future__ import annotations

import logging
import pickle
import signal
import sys

from ...lifeline import die_with_parent
from ..denormals import flush_denormals
from ..ranks import runner_spec, rank_device, rank_infos, rank_threads, spawn_rank
from .tp import TPGroup

log = logging.getLogger(__name__)


def rank_main() -> int:
    """A rank other than 0: join the group, load its shard, then run every step rank 0 broadcasts."""
    die_with_parent()
    import torch
    flush_denormals()                  # before the first parallel region: its threads inherit it
    spec, info = pickle.loads(sys.stdin.buffer.read())
    torch.set_num_threads(info.threads)
    tp = TPGroup(info, rank_device(spec.device, info))
    from ..model_runner import ModelRunner
    try:
        model_runner = ModelRunner(spec, tp=tp)
        with torch.inference_mode():
            while (msg := tp.recv_step()) is not None:
                step, rows, ids = msg
                model_runner.future_map.stash(rows, ids)        # the previous step's sampled ids (rank 0 sampled)
                model_runner.run(step)
    finally:
        tp.close()
    return 0


def run_node(config) -> int:
    """Node R > 0: start this node's ranks (tp ranks, or pipeline stages: device/parallel/pp_stage.py) and wait for
    them. SIGTERM / SIGINT stop them; the exit code is 0 when every rank ended because rank 0 quit, 1
    otherwise."""
    from ...model.loader import resolve_model
    from ...model.row_parallel import check_chunks
    from ...model.shard import check_tp_size
    from .pp import check_pp_size
    source = resolve_model(config.model, config.cache_dir)
    check_tp_size(source.config, config.tp_size, source.name)
    check_chunks(source.config, config.tp_reduce_chunks, source.name)
    check_pp_size(source.config.num_layers, config.pp_size, source.name, config.pp_layer_partition)
    spec = runner_spec(config, source)
    pp = config.pp_size > 1
    infos = rank_infos(config.pp_size if pp else config.tp_size, config.nnodes, config.node_rank,
                       rank_threads(config, source.config), f"tcp://{config.dist_init_addr}", config.tp_comm)
    module = "tandem.device.parallel.pp_stage" if pp else "tandem.device.parallel.tp_worker"
    procs = [spawn_rank(spec, info, module) for info in infos]
    log.info("node %d: %s %s started, joining %s", config.node_rank, "pipeline stages" if pp else "tp ranks",
             [i.rank for i in infos], config.dist_init_addr)

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.terminate()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(rank_main())
