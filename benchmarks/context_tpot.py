"""Single-stream TPOT at 128 and 2,000 tokens of context, tandem overlap vs llama.cpp single: the context_tpot
part of `tandem bench peers` alone (with its warm-up), 128 output tokens, 3 rounds.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/context_tpot.py   # -> benchmarks/results/context_tpot.json
"""
import argparse
import json
import os

from tandem import LLM
from tandem.bench.engines import LlamaCppPeer, TandemPeer
from tandem.bench.peers import context_tpot
from tandem.model.loader import default_model_path
llm = LLM(device_threads=2)
path = default_model_path()
peers = {"tandem overlap": TandemPeer(llm, "overlap", 128), "llama.cpp single": LlamaCppPeer(path, 2, 1, 2200)}
args = argparse.Namespace(tpot_contexts=[128, 2000], tpot_output_len=128, rounds=3, seed=0)
out = context_tpot(peers, {}, llm.engine.model_config.vocab_size, args)
print(json.dumps(out, indent=1))
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "context_tpot.json"), "w") as f:
    json.dump(out, f, indent=2)
llm.shutdown()
