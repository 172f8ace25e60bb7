"""The CUDA path in a few minutes, wherever a GPU is available (issue 11): one prepared script.

    python benchmarks/gpu_check.py OUT_DIR [--model PATH] [--requests 64] [--max-tokens 64] [--rounds 2]

1. Greedy parity on CUDA: tandem (fp32, both loops) against transformers' `generate` on the same weights and
   device, token for token; a divergence counts as agreement only at a near-tie of the reference's scores.
2. Serial vs overlap on CUDA: tokens/s (alternating rounds, medians) and device idle fraction per loop.
3. The trace files of the last round of each loop: OUT_DIR/trace/{summary,trace}.json, timeline.png, report.html.
Everything lands in OUT_DIR/gpu_check.json as well. Without a CUDA device it prints "no CUDA device; skipped",
writes that into OUT_DIR/gpu_check.json and exits 0. `--device cpu` runs the same checks on the CPU (the
tests do, on a tiny model).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

NEAR_TIE = 1e-3          # top-2 logit margin under which a greedy divergence is a tie, not a bug (as the tests)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "Once upon a time")


def compare_greedy(ours: list[int], ref: list[int], scores: list) -> dict:
    """Token-for-token agreement; the first divergence is accepted only at a near-tie of the reference."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            top2 = scores[i].topk(2).values
            margin = float(top2[0] - top2[1])
            tie = margin < NEAR_TIE and float(scores[i][a]) >= float(top2[1]) - NEAR_TIE
            return {"agree": tie, "first_divergence": i, "top2_margin": margin}
    return {"agree": len(ours) == len(ref), "first_divergence": None, "top2_margin": None}


def hf_model(model_path: str, device: str):
    """transformers' model on the same weights (a .gguf file dequantized to fp32, or a HF folder)."""
    import torch
    from transformers import AutoModelForCausalLM
    if model_path.endswith(".gguf"):
        m = AutoModelForCausalLM.from_pretrained(os.path.dirname(model_path) or ".",
                                                 gguf_file=os.path.basename(model_path), dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return m.to(device).eval()


def hf_greedy(model, prompt: list[int], max_new: int) -> tuple[list[int], list]:
    import torch
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), [s[0].float().cpu() for s in out.scores]


def check_parity(llm, hf, max_tokens: int) -> dict:
    """Each prompt through both loops against transformers' greedy tokens."""
    from tandem import SamplingParams
    prompts = [llm.tokenizer.encode(t) for t in PROMPTS]
    refs = [hf_greedy(hf, p, max_tokens) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out: dict = {"prompts": list(PROMPTS), "max_tokens": max_tokens}
    for loop in ("serial", "overlap"):
        llm.engine.config = llm.engine.config.replace(scheduler=loop)
        got = llm.generate(prompts, params, use_tqdm=False)
        out[loop] = [compare_greedy(g.token_ids, r, s) for g, (r, s) in zip(got, refs)]
    out["all_agree"] = all(c["agree"] for loop in ("serial", "overlap") for c in out[loop])
    return out


def check_loops(llm, out_dir: str, requests: int, max_tokens: int, input_len: int, rounds: int) -> dict:
    """Serial vs overlap tokens/s and device idle, and the trace folder of each loop's last round."""
    from tandem.trace.export import write_trace_dir
    from tandem.trace.summary import summarize
    from tandem.trace.run import Workload, trace_loops
    workload = Workload(requests, max_tokens, input_len)
    recs, tps = trace_loops(llm, workload, rounds)
    summary = summarize(recs, tps, model=llm.engine.model_name, workload=workload.__dict__, rounds=rounds)
    paths = write_trace_dir(os.path.join(out_dir, "trace"), recs, summary,
                            f"tandem gpu_check: {llm.engine.model_name}, serial vs overlap")
    loops = {loop: {k: s[k] for k in ("tokens_per_s", "device_idle_fraction", "host_ms_per_step",
                                      "device_ms_per_step", "steps")}
             for loop, s in summary["loops"].items()}
    for loop, values in tps.items():
        loops[loop]["tokens_per_s_rounds"] = values
    return {"loops": loops, "overlap_speedup": summary.get("overlap_speedup"),
            "overlap_speedup_bound": summary.get("overlap_speedup_bound"),
            "trace_files": {k: os.path.relpath(v, out_dir) for k, v in paths.items()}}


def device_info(device: str) -> dict:
    import torch
    info = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        info.update(name=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", help="folder for gpu_check.json and trace/ (e.g. $OUT)")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the same checks on the CPU")
    ap.add_argument("--requests", type=int, default=64, help="prompts of the serial vs overlap workload")
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request of that workload")
    ap.add_argument("--input-len", type=int, default=32, help="prompt tokens of that workload")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per loop (medians)")
    ap.add_argument("--parity-tokens", type=int, default=16, help="greedy tokens per parity prompt")
    args = ap.parse_args(argv)
    import torch
    os.makedirs(args.out_dir, exist_ok=True)
    report_path = os.path.join(args.out_dir, "gpu_check.json")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; skipped")
        with open(report_path, "w") as f:
            json.dump({"skipped": "no CUDA device", **device_info("cpu")}, f, indent=1)
        return 0
    from tandem import LLM
    from tandem.model.loader import default_model_path
    model = args.model or default_model_path()
    t0 = time.perf_counter()
    llm = LLM(model, device=args.device, dtype="float32", max_running_requests=max(64, args.requests),
              kv_cache_tokens=max(8192, args.requests * (args.input_len + args.max_tokens + 16)))
    try:
        hf = hf_model(model, args.device)
        report = {**device_info(args.device), "model": llm.engine.model_name,
                  "parity": check_parity(llm, hf, args.parity_tokens)}
        del hf
        report.update(check_loops(llm, args.out_dir, args.requests, args.max_tokens, args.input_len, args.rounds))
    finally:
        llm.shutdown()
    report["wall_s"] = time.perf_counter() - t0
    with open(report_path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['device']} {report.get('name', '')}: greedy parity with transformers "
          f"{'OK' if report['parity']['all_agree'] else 'FAILED'}")
    for loop, s in report["loops"].items():
        print(f"{loop:8s} {s['tokens_per_s']:8.1f} tok/s  device idle {100 * s['device_idle_fraction']:5.1f} %  "
              f"host {s['host_ms_per_step']:.2f} ms  device {s['device_ms_per_step']:.2f} ms per step")
    print(f"overlap/serial {report['overlap_speedup']:.2f} (bound {report['overlap_speedup_bound']:.2f}); "
          f"wrote {report_path} and {os.path.join(args.out_dir, 'trace')}/")
    return 0 if report["parity"]["all_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
