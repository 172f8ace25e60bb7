"""RunnerSpec: everything a ModelRunner needs to build itself (model_runner.py), as plain data, so that it
crosses a process boundary (the device process, tp ranks, pipeline stages) and ranks can compare it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.loader import ModelSource


@dataclass(frozen=True)
class RunnerSpec:
    """Everything the device side needs to build itself; plain data, so it crosses a process boundary."""
    source: ModelSource           # plain data: config, weight files, tokenizer dir
    device: str
    dtype: str
    max_running: int
    max_model_len: int | None
    kv_cache_tokens: int | None
    kv_memory_fraction: float
    kv_cache_dtype: str = "auto"  # "auto" (model/numerics.py); or float32 / bfloat16 / float16 / q8_0 (kernels/kv_quant.py)
    shared_prefix_attention: bool = True   # the native decode attention reads a shared prefix once for its rows
    poison_future_map: bool = False
    kernels: str = "torch"        # "native": GGUF blocks stay quantized, tandem.kernels ops (CPU fp32 only)
    kernels_act: str = "int8"     # "int8": the native decode linears quantize activations to int8 blocks; "fp32" exact
    batch_invariant: bool = False  # every token attends with the decode op's arithmetic (model/attention_paths.py)
    prefill_act: str = "auto"     # long prefill chunks: "bf16" GEMM + attention, "int8" (kernels_act's), "auto" (numerics.py)
    prefill_attention: str = "auto"   # the native extend op's products: "bf16", "fp32", "auto" (numerics.py)
    decode_attention: str = "auto"    # the native decode op's products: "bf16", "fp32", "auto" (numerics.py)
    tp_size: int = 1              # tensor-parallel ranks (device/parallel/tp.py); each model runner holds one shard
    tp_reduce_chunks: int = 0     # o and down in this many column chunks added in order (model/row_parallel.py); 0: off
    tp_comm: str = "auto"         # "auto": tp ranks on one host reduce through shared memory; "gloo"
    max_draft_rows: int = 0       # speculative decoding: batch rows a step may carry beyond max_running
    pp_size: int = 1              # pipeline stages (device/parallel/pp.py); each model runner holds one stage's layers
    pp_layer_partition: str = "auto"  # how the layers are cut into stages (device/parallel/pp_split.py)
    spare_rows: int = 0           # request-table rows past max_running, for urgent steps (scheduler/urgent.py)
    state_checkpoints: int = 0    # a hybrid model's saved states the prefix cache may hold (model/recurrent_state.py)
    kv_disk_folder: str | None = None   # the disk tier's folder of this server (memory/disk_tier.py); None: off
    kv_disk_fingerprint: str = ""       # what its entries are keyed by (the engine's fingerprint)

    def with_disk_tier(self, folder: str, fingerprint: str) -> "RunnerSpec":
        return dataclasses.replace(self, kv_disk_folder=folder, kv_disk_fingerprint=fingerprint)

    def fingerprint(self) -> dict:
        """What every tp rank must agree on (paths and the device may differ between machines)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("source", "device", "kv_disk_folder")}
        return {**d, "model": self.source.config.to_dict()}
