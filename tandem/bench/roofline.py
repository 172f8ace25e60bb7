"""`tandem bench roofline`: what this machine allows for the model's decode step, next to what tandem gets.

Per batch size b, the fp32 GEMMs of one decode step are timed on the model's own shapes with F.linear
(x [b, in] @ W[out, in]^T): per layer qkv fused [(H+2KVH)*D, hidden], o [hidden, H*D], gate_up fused
[2I, hidden], down [hidden, I]; once lm_head [V, hidden]. Attention is estimated as reading every running
request's KV (mean context input_len + output_len / 2) at the measured memory bandwidth (a large tensor
copy). The upper bound on decode tokens/s is b / (matmul time + attention time) per step; the batch-1
memory-bound limit is bandwidth / weight bytes, in fp32 and, for a GGUF model, in the bytes a native decode
step reads (quantized_bytes: the blocks kept as they are, other types dequantized to fp32 at load, the
LM head once, the embedding one row a token, so not counted). tandem's decode tokens/s at the same b comes from the
difference of two offline runs (output_len and 1 token: prefill cancels out) through the overlap loop.
For a GGUF model the batch-1 bound is also given as issue 46 defines it: the bytes a step reads (blocks and KV)
over the read bandwidth of a sum on the engine's threads (read_bandwidth), with tandem's TPOT as a ratio to it.
"""
from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from . import engine_threads, machine_info
from .datasets import BenchRequest, random_requests
from .offline import timed_generate, warm_up

FP32 = 4


def layer_shapes(mc) -> dict[str, tuple[int, int, int]]:
    """name -> (out features, in features, calls per decode step)."""
    h, d, n = mc.hidden_size, mc.head_dim, mc.num_layers
    return {"qkv": ((mc.num_heads + 2 * mc.num_kv_heads) * d, h, n),
            "o": (h, mc.num_heads * d, n),
            "gate_up": (2 * mc.intermediate_size, h, n),
            "down": (h, mc.intermediate_size, n),
            "lm_head": (mc.vocab_size, h, 1)}


def time_call(fn, min_s: float = 0.1, min_reps: int = 5) -> float:
    """Median seconds of fn() after one warm-up call, over at least min_reps calls and min_s seconds."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def matmul_seconds(out_f: int, in_f: int, batch: int, min_s: float) -> float:
    w = torch.randn(out_f, in_f)          # [out, in]
    x = torch.randn(batch, in_f)          # [b, in]
    with torch.inference_mode():
        return time_call(lambda: F.linear(x, w), min_s)


def quantized_bytes(model_path: str | None, tied: bool, expert_share: float = 1.0) -> dict | None:
    """Bytes of weights one decode step reads under kernels="native", from the GGUF file (None otherwise):
    per ggml type kept as blocks, plus what is dequantized to fp32 at load. An MoE file's expert blocks (3-D
    `*_exps` tensors) count `expert_share` of their bytes: at batch 1 a token reads only its chosen experts
    (top-k over the experts)."""
    if not model_path or not model_path.endswith(".gguf"):
        return None
    import gguf

    from ..kernels.quant import NATIVE_QTYPES
    by_type: dict[str, int] = {}
    for t in gguf.GGUFReader(model_path).tensors:
        if t.name == "token_embd.weight" and not tied:
            continue                                      # a lookup of one row per token, not a matmul
        experts = "_exps." in t.name
        kept = int(t.tensor_type) in NATIVE_QTYPES and (len(t.shape) == 2 or experts)
        key = t.tensor_type.name if kept else "fp32"
        n = int(t.n_bytes) if kept else int(t.n_elements) * FP32
        by_type[key] = by_type.get(key, 0) + int(n * expert_share if experts else n)
    return {"total": sum(by_type.values()), "by_type": by_type}


def memory_bandwidth(megabytes: int = 256, min_s: float = 0.2) -> float:
    """Bytes per second of a large tensor copy (each byte read once and written once)."""
    src = torch.randn(megabytes * 2 ** 20 // FP32)
    dst = torch.empty_like(src)
    return 2 * src.numel() * FP32 / time_call(lambda: dst.copy_(src), min_s)


def read_bandwidth(megabytes: int = 1024, min_s: float = 0.5) -> float:
    """Bytes per second read by a sum over a tensor far past the caches, on torch's threads (set them to the
    engine's): the rate a decode step's weight stream can reach at best."""
    src = torch.ones(megabytes * 2 ** 20 // FP32)
    return src.numel() * FP32 / time_call(lambda: src.sum(), min_s)


def decode_bytes_per_token(model_path: str, mc, context: int, kv_bytes: float = 2) -> dict:
    """Bytes one batch-1 decode step reads: every matrix of the GGUF as its blocks (the embedding only as the
    tied head; its lookup is one row; of an MoE's experts only the chosen: the active bytes), plus the KV cache
    at `context` tokens (kv_bytes an element), plus a hybrid's linear-attention state, read and written once a token."""
    share = mc.num_experts_per_tok / mc.num_experts if getattr(mc, "num_experts", 0) else 1.0
    q = quantized_bytes(model_path, mc.tie_word_embeddings, share) or {"total": 0}
    linear = len(mc.linear_layers)                   # a hybrid's: no KV; a state read and written each token
    kv = int(2 * (mc.num_layers - linear) * mc.num_kv_heads * mc.head_dim * context * kv_bytes)
    state = 2 * linear * mc.linear_num_value_heads * mc.linear_key_head_dim * mc.linear_value_head_dim * 4
    return {"weights": q["total"], "kv": kv, "state": state, "total": q["total"] + kv + state}


def tandem_decode_tps(llm, batch: int, input_len: int, output_len: int, seed: int) -> float:
    """Decode tokens/s of `batch` requests run together: b (O - 1) / (t(O tokens) - t(1 token))."""
    vocab = llm.engine.model_config.vocab_size
    prompts = [r.prompt for r in random_requests(batch, input_len, 1, vocab, 0.0, seed)]
    cap = llm.engine.config.max_running_requests
    llm.engine.config = llm.engine.config.replace(max_running_requests=max(cap, batch))

    def wall(n: int) -> float:
        return timed_generate(llm, [BenchRequest(p, input_len, n) for p in prompts], "overlap")[0]

    try:
        one = wall(1)
        return batch * (output_len - 1) / max(1e-9, wall(output_len) - one)
    finally:
        llm.engine.config = llm.engine.config.replace(max_running_requests=cap)


def roofline(mc, batch_sizes: list[int], input_len: int, output_len: int, bandwidth_mb: int,
             min_s: float) -> dict:
    shapes = layer_shapes(mc)
    bw = memory_bandwidth(bandwidth_mb, min_s)
    weight_bytes = sum(o * i * n for o, i, n in shapes.values()) * FP32
    kv_bytes_per_req = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * (input_len + output_len // 2) * FP32
    rows = []
    for b in batch_sizes:
        per_call = {name: matmul_seconds(o, i, b, min_s) for name, (o, i, n) in shapes.items()}
        mm = sum(per_call[name] * n for name, (_, _, n) in shapes.items())
        attn = b * kv_bytes_per_req / bw
        flops = sum(2 * b * o * i * n for o, i, n in shapes.values())
        rows.append({"batch_size": b, "matmul_ms": {k: 1e3 * v for k, v in per_call.items()},
                     "matmul_ms_per_step": 1e3 * mm, "attention_ms_per_step": 1e3 * attn,
                     "step_ms": 1e3 * (mm + attn), "matmul_gflops": flops / mm / 1e9,
                     "bound_tokens_per_s": b / (mm + attn)})
    return {"shapes": {k: list(v) for k, v in shapes.items()}, "memory_bandwidth_gb_s": bw / 1e9,
            "weight_bytes": weight_bytes, "kv_bytes_per_request": kv_bytes_per_req,
            "memory_bound_batch1_tokens_per_s": bw / weight_bytes, "batches": rows}


def bench_roofline(args) -> dict:
    from ..cli import engine_config
    from ..llm import LLM
    config = engine_config(args)
    threads = engine_threads(config)
    llm = LLM(**dataclasses.asdict(config))
    try:
        torch.set_num_threads(threads)    # the device process's thread count, here in the measuring process
        mc = llm.engine.model_config
        out = roofline(mc, args.batch_sizes, args.input_len, args.output_len, args.bandwidth_mb, args.min_seconds)
        from ..model.loader import resolve_model
        gguf_file = resolve_model(config.model, cache_dir=config.cache_dir).gguf_file
        q = quantized_bytes(gguf_file, mc.tie_word_embeddings)
        if q is not None:
            out["quantized_bytes"] = q
            out["memory_bound_batch1_tokens_per_s_quantized"] = out["memory_bandwidth_gb_s"] * 1e9 / q["total"]
            # The bound of a batch-1 step: the bytes it reads over the read bandwidth of the engine's threads
            out["read_bandwidth_gb_s"] = read_bandwidth(args.bandwidth_mb * 4, args.min_seconds) / 1e9
            kv_bytes = {"float32": 4, "q8_0": 34 / 32}.get(config.kv_cache_dtype, 2)   # per element; "auto": bf16
            kv_bytes = 4 if config.kernels_act == "fp32" and config.kv_cache_dtype == "auto" else kv_bytes
            step = decode_bytes_per_token(gguf_file, mc, args.input_len + args.output_len // 2, kv_bytes)
            out["bytes_per_token"] = step
            out["bound_tpot_ms"] = 1e3 * step["total"] / (out["read_bandwidth_gb_s"] * 1e9)
        warm_up(llm)
        for row in out["batches"]:
            tps = tandem_decode_tps(llm, row["batch_size"], args.input_len, args.output_len, args.seed)
            row["tandem_decode_tokens_per_s"] = tps
            row["percent_of_bound"] = 100.0 * tps / row["bound_tokens_per_s"]
            if row["batch_size"] == 1 and "bound_tpot_ms" in out:
                out["tpot_ms"] = 1e3 / tps
                out["tpot_vs_bound"] = out["tpot_ms"] / out["bound_tpot_ms"]
        name = llm.engine.model_name
    finally:
        llm.shutdown()
    out = {"model": name, "threads": threads, "input_len": args.input_len, "output_len": args.output_len, **out,
           "machine": machine_info(threads)}
    print_roofline(out)
    return out


def print_roofline(out: dict) -> None:
    print(f"{out['model']}: fp32, {out['threads']} threads; memory bandwidth {out['memory_bandwidth_gb_s']:.1f} GB/s; "
          f"weights {out['weight_bytes'] / 1e6:.0f} MB -> batch-1 memory-bound limit "
          f"{out['memory_bound_batch1_tokens_per_s']:.1f} tok/s")
    if "quantized_bytes" in out:
        q = out["quantized_bytes"]
        parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in q["by_type"].items())
        print(f"GGUF blocks a native decode step reads: {q['total'] / 1e6:.1f} MB ({parts}) -> batch-1 limit "
              f"{out['memory_bound_batch1_tokens_per_s_quantized']:.1f} tok/s")
    if "bound_tpot_ms" in out:
        b = out["bytes_per_token"]
        line = (f"decode bound: {b['total'] / 1e6:.1f} MB a token ({b['weights'] / 1e6:.1f} weights, {b['kv'] / 1e6:.2f} "
                f"KV) / read bandwidth {out['read_bandwidth_gb_s']:.1f} GB/s = {out['bound_tpot_ms']:.2f} ms")
        if "tpot_ms" in out:
            line += f"; tandem TPOT {out['tpot_ms']:.2f} ms = {out['tpot_vs_bound']:.2f}x the bound"
        print(line)
    names = list(out["shapes"])
    print(f"{'batch':>5s} " + " ".join(f"{n:>8s}" for n in names) + "  (ms per call)"
          f" {'step ms':>8s} {'GFLOP/s':>8s} {'bound tok/s':>11s} {'tandem tok/s':>12s} {'% bound':>7s}")
    for r in out["batches"]:
        print(f"{r['batch_size']:5d} " + " ".join(f"{r['matmul_ms'][n]:8.3f}" for n in names) + " " * 15 +
              f"{r['step_ms']:8.2f} {r['matmul_gflops']:8.1f} {r['bound_tokens_per_s']:11.1f} "
              f"{r['tandem_decode_tokens_per_s']:12.1f} {r['percent_of_bound']:6.1f}%")
