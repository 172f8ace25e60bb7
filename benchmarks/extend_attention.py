"""The native extend attention op (csrc/extend_attention.cpp) next to what it replaced, the gather of the step's
keys from the paged cache (widened to fp32, padded) + ATen's flash SDPA with the causal bool mask, and the
batch-invariant causal op (decode rows' bits, csrc/causal_attention.cpp; fp32 products), on SmolLM2-135M's
heads (9 over 3 KV heads, head_dim 64, bf16 cache, 30 layers' slots), on the chunks the workloads of issue 22
prefill: a 256-token mixed chunk on 768 and 2,560 cached keys (the long workload), a fresh 924-token prompt, 32 rows
of 24 tokens on one 900-key prefix (shared prefix). Interleaved in one process, best of --reps, for each SIMD body
this CPU has (SDPA's own ISA is whatever torch picks: pass ONEDNN_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS to cap it),
and on CPUs with AVX512-BF16 the AVX-512 body's bf16 products (prefill_attention="bf16"; the causal op's with
decode_attention="bf16") beside them.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/extend_attention.py [--threads 2] [--json F]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tandem import kernels
from tandem.bench import interleaved_best, machine_info, write_json_md

H, KVH, D, LAYERS = 9, 3, 64, 30
CASES = {"256 new on 768 cached": (1, 256, 768), "256 new on 2,560 cached": (1, 256, 2560),
         "924 new (fresh prompt)": (1, 924, 0), "32 rows x 24 new on one 900 prefix": (32, 24, 900)}


def case(rows: int, new: int, cached: int, isa: int, g: torch.Generator):
    lk = cached + new
    slots = cached + rows * new + 2
    cache = torch.randn(slots + 1, LAYERS, 2, KVH, D, generator=g).to(torch.bfloat16)
    kv_index = torch.empty(rows, lk, dtype=torch.long)
    kv_index[:, :cached] = torch.arange(1, cached + 1)                       # one prefix, every row's
    kv_index[:, cached:] = cached + 1 + torch.arange(rows * new).view(rows, new)
    tok_row = torch.arange(rows).repeat_interleave(new)
    pos = torch.arange(cached, cached + new).repeat(rows)
    q = torch.randn(rows * new, H, D, generator=g)
    mask = torch.zeros(rows, 1, new, lk, dtype=torch.bool)
    mask[..., :cached] = True
    mask[..., cached:] = torch.ones(new, new, dtype=torch.bool).tril()

    def native():
        return torch.ops.tandem.extend_attention(q, cache, 3, kv_index, tok_row, pos, 0.125, 0, isa)

    def causal():                     # the batch-invariant op (csrc/causal_attention.cpp): decode rows' bits
        return torch.ops.tandem.causal_attention(q, cache, 3, kv_index, tok_row, pos, 0.125, 0, isa)

    def native_bf16():
        return torch.ops.tandem.extend_attention(q, cache, 3, kv_index, tok_row, pos, 0.125, 0, isa, True)

    def causal_bf16():                # the same with the decode op's bf16 products (csrc/decode_attention_bf16.inc)
        return torch.ops.tandem.causal_attention(q, cache, 3, kv_index, tok_row, pos, 0.125, 0, isa, True)

    def sdpa():
        kv = cache[kv_index.reshape(-1), 3].float().view(rows, lk, 2, KVH, D)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        return F.scaled_dot_product_attention(q.view(rows, new, H, D).transpose(1, 2), k, v, attn_mask=mask,
                                              scale=0.125, enable_gqa=True)
    flops = 4 * H * D * rows * new * (cached + new / 2)                       # the causal part only
    return native, native_bf16, sdpa, causal, causal_bf16, flops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads of both")
    ap.add_argument("--reps", type=int, default=15, help="interleaved timed rounds; the best counts")
    ap.add_argument("--json", default=None, help="write the figures here (and the table beside it, .md)")
    args = ap.parse_args()
    if not kernels.available():
        raise SystemExit("native kernels unavailable")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    isas = [i for i in (1, 2) if i <= torch.ops.tandem.isa(2)]
    bf16 = torch.cpu._is_avx512_bf16_supported()
    rows, lines = [], ["| body | chunk | extend op, ms | GFLOP/s | gather + SDPA, ms | SDPA / op | causal op, ms | causal / op |",
                       "|---|---|---|---|---|---|---|---|"]
    for isa in isas:
        bodies = [kernels.ISA_NAMES[isa]] + (["avx512, bf16 products"] if isa == 2 and bf16 else [])
        for name, shape in CASES.items():
            native, native_bf16, sdpa, causal, causal_bf16, flops = case(*shape, isa, g)
            best = interleaved_best([native, sdpa, causal] + ([native_bf16, causal_bf16] if len(bodies) > 1 else []),
                                    args.reps)
            for body, op, cop in zip(bodies, best[0::3], best[2::2]):    # (extend, causal) of each body
                rows.append({"body": body, "chunk": name, "op_ms": op * 1e3, "sdpa_ms": best[1] * 1e3,
                             "op_gflops": flops / op / 1e9, "causal_ms": cop * 1e3})
                lines.append(f"| {body} | {name} | {op * 1e3:.2f} | {flops / op / 1e9:.0f} | "
                             f"{best[1] * 1e3:.2f} | {best[1] / op:.2f}x | {cop * 1e3:.2f} | {cop / op:.2f}x |")
                print(lines[-1], flush=True)
    info = machine_info(args.threads)
    md = ("# Extend attention: the native op against gather + SDPA\n\n"
          f"`benchmarks/extend_attention.py --threads {args.threads}`; CPU: {info['cpu_model']}"
          f"{', caps ' + str(info['isa_caps']) if info.get('isa_caps') else ''}; best of {args.reps} interleaved "
          "rounds; GFLOP/s counts the causal part's 4 H D flops a (query, key) pair.\n\n" + "\n".join(lines) + "\n")
    if args.json:
        write_json_md(args.json, {"machine": info, "rows": rows}, md)
    else:
        print(md)


if __name__ == "__main__":
    main()
