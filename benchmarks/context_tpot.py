"""Single-stream TPOT at 128 and 2,000 tokens of context, tandem overlap vs llama.cpp single: the context_tpot
part of `tandem bench peers` alone (with its warm-up), 128 output tokens, 3 rounds. Without llama-cpp-python,
tandem alone (llama.cpp is listed under "skipped").

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/context_tpot.py   # -> benchmarks/results/context_tpot.json
"""
import argparse
import json
import os

from tandem import LLM
from tandem.bench.engines import LlamaCppPeer, TandemPeer
from tandem.bench.peers import context_tpot
from tandem.model.loader import default_model_path

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                             "context_tpot.json"))
cli = p.parse_args()
llm = LLM(device_threads=cli.threads)
path = default_model_path()
peers, skipped = {"tandem overlap": TandemPeer(llm, "overlap", 128)}, {}
try:
    peers["llama.cpp single"] = LlamaCppPeer(path, cli.threads, 1, 2200)
except ImportError as e:
    skipped["llama.cpp single"] = f"{type(e).__name__}: {e}"
args = argparse.Namespace(tpot_contexts=[128, 2000], tpot_output_len=128, rounds=cli.rounds, seed=0)
out = context_tpot(peers, skipped, llm.engine.model_config.vocab_size, args)
print(json.dumps(out, indent=1))
with open(cli.out, "w") as f:
    json.dump(out, f, indent=2)
llm.shutdown()
