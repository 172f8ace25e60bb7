"""The sweep: benchmarks/results/run_all.md and benchmarks/throughput_vs_concurrency.png from one run, then
benchmarks/RESULTS.md (the headline page, render_results.py) re-rendered.

    .venv/bin/python benchmarks/run_all.py             # the full run: about 30 minutes on 2 quiet cores
    .venv/bin/python benchmarks/run_all.py --render    # only rewrite both pages from <out>/results/*.json

Runs, in order: `tandem bench offline` (overlap, serial), `tandem bench peers` (with a concurrency sweep of
every engine through its offline API), `tandem bench roofline`, then starts `tandem serve`, waits for
/health and runs `tandem bench serve --max-concurrency c` for each c. Every command writes JSON under
<out>/results/; run_all.md is rendered from those files only. Workload options scale it down for a smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from tandem.bench import cpu_model  # noqa: E402
from tandem.bench.peers import sweep_prompts  # noqa: E402


def tandem(*argv: str) -> list[str]:
    return [sys.executable, "-m", "tandem.cli", *argv]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shown_paths(text: str) -> str:
    """Commands as recorded in results/run_all.md: paths relative to the repository (no machine's own folders)."""
    return text.replace(ROOT + os.sep, "")


def run(cmd: list[str], commands: list[str]) -> None:
    shown = shown_paths("tandem " + shlex.join(cmd[3:]))
    commands.append(shown)
    print(f"\n$ {shown}", flush=True)
    if subprocess.run(cmd, cwd=ROOT, check=False).returncode != 0:
        print(f"(failed: {shown}; its section of results/run_all.md stays empty)", flush=True)


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 300.0, path: str = "/health") -> None:
    import httpx
    deadline = time.monotonic() + timeout
    with httpx.Client(trust_env=False, timeout=2.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}")
            try:
                if http.get(url + path).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"tandem serve not healthy after {timeout} s")


def sweep_server(cmd: list[str], url: str, health: str, log_name: str, prefix: str, concurrency: list[int],
                 bench_args: list[str], res: str) -> list[str]:
    """Start a server, wait until `health` answers, time `bench serve` at each concurrency, stop it.
    Returns the commands run, for RESULTS.md."""
    done = []
    with open(os.path.join(res, log_name), "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_health(url, proc, path=health)
            for c in concurrency:
                run(tandem("bench", "serve", "--base-url", url, "--max-concurrency", str(c), "--num-prompts",
                           str(sweep_prompts(c)), *bench_args,
                           "--json", os.path.join(res, f"{prefix}serve_c{c}.json")), done)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return done


def serve_sweep(args, engine: list[str], res: str, commands: list[str]) -> None:
    port = free_port()
    cmd = tandem("serve", "--port", str(port), "--log-level", "warning", *engine)
    commands.append(shown_paths("tandem " + shlex.join(cmd[3:])) + "   # in the background, until /health answers")
    commands += sweep_server(cmd, f"http://127.0.0.1:{port}", "/health", "server.log", "", args.concurrency,
                             ["--input-len", str(args.input_len), "--output-len", str(args.output_len),
                              "--vocab-size", str(args.vocab_size)], res)


def llamacpp_serve_sweep(args, engine: list[str], res: str, commands: list[str]) -> None:
    """The same HTTP workload against llama-cpp-python's own OpenAI server on the same GGUF file (text prompts:
    its server takes no token-id prompts). Skipped when llama_cpp.server is not importable."""
    try:
        import llama_cpp.server  # noqa: F401
    except ImportError as e:
        print(f"(llama.cpp server skipped: {e})", flush=True)
        return
    from tandem.device.ranks import default_device_threads
    from tandem.model.loader import default_model_path
    threads = int(engine[engine.index("--device-threads") + 1]) if "--device-threads" in engine else \
        default_device_threads()
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", args.model or default_model_path(), "--host",
           "127.0.0.1", "--port", str(port), "--n_threads", str(threads), "--n_ctx", "4096",
           "--interrupt_requests", "False"]     # queue concurrent requests instead of cutting the running one
    commands.append(shown_paths(shlex.join(["python"] + cmd[1:])) + "   # in the background")
    commands += sweep_server(cmd, f"http://127.0.0.1:{port}", "/v1/models", "llamacpp_server.log", "llamacpp_",
                             args.llamacpp_concurrency, ["--input-len", str(args.input_len), "--output-len",
                                                         str(args.output_len), "--prompt-type", "text"], res)


def run_all(args, res: str) -> list[str]:
    commands: list[str] = []
    engine = (["--model", args.model] if args.model else []) + list(args.engine)
    work = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    for loop in ("overlap", "serial"):
        run(tandem("bench", "offline", "--num-prompts", str(args.num_prompts), *work, "--scheduler", loop,
                   *engine, "--json", os.path.join(res, f"offline_{loop}.json")), commands)
    run(tandem("bench", "peers", "--num-prompts", str(args.num_prompts), *work, "--rounds", str(args.rounds),
               "--concurrency", ",".join(map(str, args.concurrency)), *args.peers_args, *engine,
               "--json", os.path.join(res, "peers.json")), commands)
    run(tandem("bench", "roofline", "--batch-sizes", ",".join(map(str, args.roofline_batch_sizes)),
               "--input-len", str(args.input_len), *args.roofline_args, *engine,
               "--json", os.path.join(res, "roofline.json")), commands)
    serve_sweep(args, engine, res, commands)
    llamacpp_serve_sweep(args, engine, res, commands)
    run(tandem("bench", "soak", "--requests", str(args.soak_requests), *(["--model", args.model] if args.model else []),
               "--json", os.path.join(res, "soak.json")), commands)
    return commands


def machine(engine: list[str]) -> dict:
    import torch
    import transformers
    try:
        import llama_cpp
        llama = getattr(llama_cpp, "__version__", "installed")
    except ImportError:
        llama = "not installed"
    from tandem.device.ranks import default_device_threads
    threads = int(engine[engine.index("--device-threads") + 1]) if "--device-threads" in engine else None
    return {"nproc": os.cpu_count(), "CPU model": cpu_model(), "torch": torch.__version__,
            "threads (tandem device, transformers, llama.cpp)": threads or default_device_threads(),
            "transformers": transformers.__version__, "llama-cpp-python": llama}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", action="store_true", help="only rewrite run_all.md and RESULTS.md from the JSON files")
    ap.add_argument("--out", default=HERE, help="folder of RESULTS.md, the plot and results/ (run_all.md)")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct Q4_1 GGUF")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--llamacpp-concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 64],
                    help="concurrencies timed against llama-cpp-python's server (it serves one at a time)")
    ap.add_argument("--roofline-batch-sizes", type=lambda s: [int(v) for v in s.split(",")], default=[1, 32, 64])
    ap.add_argument("--vocab-size", type=int, default=49152, help="bench serve draws prompt ids below this")
    ap.add_argument("--soak-requests", type=int, default=1500, help="requests of the chaos soak (tandem bench soak)")
    ap.add_argument("--engine", nargs=argparse.REMAINDER, default=[],
                    help="engine options passed to every tandem command (last on the line)")
    ap.add_argument("--peers-args", type=shlex.split, default=[], help="extra `bench peers` options, quoted")
    ap.add_argument("--roofline-args", type=shlex.split, default=[], help="extra `bench roofline` options, quoted")
    args = ap.parse_args()
    res = os.path.join(args.out, "results")
    os.makedirs(res, exist_ok=True)
    meta_path = os.path.join(res, "run.json")
    if not args.render:
        start = time.time()
        commands = run_all(args, res)
        with open(meta_path, "w") as f:
            json.dump({"commands": commands, "machine": machine(args.engine), "minutes": (time.time() - start) / 60,
                       "date": time.strftime("%Y-%m-%d %H:%M"), "invocation": shlex.join(sys.argv)}, f, indent=2)
    from render_results import render
    render(args.out, res)


if __name__ == "__main__":
    main()
