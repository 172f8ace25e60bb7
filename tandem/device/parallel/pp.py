"""Pipeline parallelism: the model's layers cut into pp_size contiguous stages, one device process each,
joined by torch.distributed (gloo on CPU, NCCL on CUDA: the same calls).

What each stage holds: its own layers' weights and KV cache (every KV slot, for its layers only). The
**first** stage also holds the embedding, the **last** the final norm, the LM head and the sampler (with
tied embeddings the last stage keeps the embedding matrix as its LM head).

A step travels like this: the scheduler writes the step into the shared step buffers and sends the launch to
every stage; each stage reads the step itself (no step broadcast), builds its attention layout, and
  first stage:  embed -> its layers -> send (hidden, residual) to stage 1
  stage s:      recv (hidden, residual) from s-1 -> its layers -> send to s+1
  last stage:   recv -> its layers -> final norm, LM head, sample -> sampled ids into the shared out buffer,
                then the "done" message to the scheduler (copy_done).
The residual travels because the layers defer the residual add into the next norm (llama.py's `delta`, on
both kernel sets): sending both keeps every row's arithmetic the same as with one stage.

FutureMap relay: the last stage samples and stashes into its own FutureMap (its penalties read input ids);
the first stage's FutureMap learns the sampled ids through the host: the executor keeps the ids of every
result it has waited for and sends them with the next launch (StepInput.stash_rows / stash_ids), stashed
before that step's poison and gather. The PP loop (scheduler/loops.py) launches a micro-batch only with
requests whose previous micro-batch was processed, so what it gathers has been relayed. Middle stages read
no ids.

Stages on other machines (`--nnodes M`, pp_size / M stages on each; device/parallel/pp_stage.py): node 0's stages read
the step from the shared buffers as above; a stage on node R > 0 has no scheduler beside it, so it receives
the step's packed words from the stage before it (device/parallel/step_wire.py), ahead of the hidden states, and passes
them on. The last stage sends its results (sampled ids, logprobs) back to node 0's last stage, the **relay**,
over a group of those two ranks; a thread there writes them into the out buffer and sends the "done"; the
relay sends the grammar masks the other way over a second such group.
"""
from __future__ import annotations


import logging

import torch
import torch.distributed as dist

from . import pp_split, step_wire
from ..ranks import DistInfo, init_group
from ..streams import now

log = logging.getLogger(__name__)

TIMEOUT_S = 600.0          # rendezvous of all stages, and any single send or recv


def check_pp_size(num_layers: int, pp_size: int, name: str = "the model", partition: str = "auto") -> None:
    """A clear ValueError before anything starts when the layers do not give every stage one, or when
    pp_layer_partition's layers do not add up to the model's."""
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} does not fit {name}: it has {num_layers} layers, and every "
                         f"pipeline stage needs at least one (pp sizes that fit it: 1..{num_layers})")
    sizes = pp_split.check_partition_text(partition, pp_size) if pp_size > 1 else None
    if sizes is not None:
        pp_split.check_sizes(sizes, num_layers, name)


class PPGroup(step_wire.WireControl):
    """One stage's place in the pipeline and its point-to-point sends of hidden states."""

    def __init__(self, info: DistInfo, device: torch.device, spec) -> None:
        init_group(info, device, TIMEOUT_S)
        self.rank, self.size, self.device = info.rank, info.size, device
        self.layers, self.cut = self._cut(spec)
        self.first, self.last = info.rank == 0, info.rank == info.size - 1
        per_node = info.size // info.nnodes
        self.spans_nodes = info.nnodes > 1
        self.passes_step = info.rank + 1 < info.size and info.rank + 1 >= per_node
        self.relay_rank = per_node - 1 if info.nnodes > 1 else None             # node 0's last stage
        self.relay = info.rank == self.relay_rank
        self.results = self.masks = None
        if self.relay_rank is not None:   # every rank creates them, in this order (torch.distributed's rule)
            self.results = dist.new_group([self.relay_rank, info.size - 1])
            self.masks = dist.new_group([self.relay_rank, info.size - 1])
        self._sends: list = []            # (work, tensor) of the sends in flight: the tensor lives until sent
        self._fresh = False               # sends of this step already posted (its step words): keep them
        self.comm_s = 0.0                 # seconds blocked in sends since the step began (the trace's comm)
        self.recv_done = 0.0              # when this step's hidden states arrived (its busy span starts)

    def _cut(self, spec) -> tuple[range, list[int]]:
        """This stage's layers, and every stage's count: rank 0 decides (pp_split.decide: measured, even or
        given) and broadcasts, so every stage holds one cut whatever it would decide itself."""
        sizes = torch.zeros(self.size, dtype=torch.int64)
        if self.rank == 0:
            cut, how = pp_split.decide(spec, self.device)
            log.info("pipeline stages hold %s layers: %s", " + ".join(map(str, cut)), how)
            sizes = torch.tensor(cut, dtype=torch.int64)
        dist.broadcast(sizes, 0)
        cut = sizes.tolist()
        return pp_split.ranges(cut)[self.rank], cut

    def _post(self, x: torch.Tensor) -> None:
        x = x.contiguous()
        self._sends.append((dist.isend(x, self.rank + 1), x))

    def _flush(self) -> None:
        t = now()
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        self.comm_s += now() - t

    def send_hidden(self, x: torch.Tensor) -> None:
        """To the next stage, without waiting for it to receive (it may still run the previous step); the
        previous step's sends are completed first, so only one step's are in flight, freed in order."""
        if not self._fresh:
            self._flush()
        self._fresh = False
        self._post(x)

    def send_step(self, kind: int, step_id: int = 0, step=None, ints=None, floats=None) -> None:
        """Pass a step's words (or a no-op / quit) on to the next stage, on another node (parallel/step_wire.py)."""
        self._flush()
        payload, words = step_wire.step_payload(step, ints, floats) if step is not None else (None, (0, 0, 0))
        step_wire.send_words(self._post, self.device, kind, step_id, payload, words)
        self._fresh = kind == step_wire.STEP
        if not self._fresh:
            self._flush()

    def recv_step(self):
        """(kind, step id, step, ints, floats) from the stage before (a stage on a node R > 0)."""
        def xfer(t: torch.Tensor) -> torch.Tensor:
            dist.recv(t, self.rank - 1)
            return t
        return step_wire.recv_words(xfer, self.device)[:5]

    def recv_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.rank - 1)
        self.recv_done = now()
        return x

    def _control(self, kind: int) -> None:            # keepalive() and quit() to the stages on other nodes
        self.send_step(kind)

    def min_int(self, v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        try:
            self._flush()
        except RuntimeError:
            pass
        self._sends = []
        if dist.is_initialized():
            dist.destroy_process_group()
