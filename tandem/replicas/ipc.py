"""The messages between the frontend and the engine process: small dataclasses, msgpack over pyzmq.

frontend -> engine (PUSH/PULL):  AddRequest, AbortRequest, Shutdown
engine -> frontend (PUSH/PULL):  Ready | Failed (once), Replies (accept/reject of each AddRequest),
                                 Outputs (one per processed step: token ids, not text), Stats
Each message is encoded as [tag, field values...]; StepOutputs travel as plain lists.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import msgpack

from ..request import StepOutput

ACCEPTED = 200


@dataclass
class AddRequest:
    rid: str
    prompt_ids: list[int]
    params: dict[str, Any]          # SamplingParams fields


@dataclass
class AbortRequest:
    rid: str


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    model_name: str
    max_context: int                # the model's context, capped by the KV cache
    vocab_size: int
    pid: int


@dataclass
class Failed:
    message: str                    # the engine could not start, or its loop died


@dataclass
class Replies:
    items: list[list]               # [rid, status (200 accepted | 400 | 503), message]


@dataclass
class Outputs:
    outputs: list[StepOutput]       # everything one processed step says
    stats: dict[str, float]


@dataclass
class Stats:
    stats: dict[str, float]         # num_running, num_waiting, kv_usage, device_idle_fraction ...


MESSAGES = (AddRequest, AbortRequest, Shutdown, Ready, Failed, Replies, Outputs, Stats)
_TAG = {cls: i for i, cls in enumerate(MESSAGES)}
_STEP_FIELDS = [f.name for f in fields(StepOutput)]


def encode(msg: Any) -> bytes:
    values = [getattr(msg, f.name) for f in fields(msg)]
    if isinstance(msg, Outputs):
        values[0] = [[getattr(o, n) for n in _STEP_FIELDS] for o in msg.outputs]
    return msgpack.packb([_TAG[type(msg)], *values])


def decode(data: bytes) -> Any:
    tag, *values = msgpack.unpackb(data, strict_map_key=False)    # logit_bias maps token ids
    cls = MESSAGES[tag]
    if cls is Outputs:
        values[0] = [StepOutput(*o) for o in values[0]]
    return cls(*values)


__all__ = [c.__name__ for c in MESSAGES] + ["ACCEPTED", "encode", "decode"]
