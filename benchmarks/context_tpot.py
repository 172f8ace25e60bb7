"""Single-stream TPOT at 128 and 2,000 tokens of context, tandem overlap vs llama.cpp single: the context_tpot
part of `tandem bench peers` alone (with its warm-up), 128 output tokens, 3 rounds. Without llama-cpp-python,
tandem alone (llama.cpp is listed under "skipped").

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/context_tpot.py   # -> benchmarks/results/context_tpot.json

--model runs another GGUF (both engines load the same file; --out then names where the JSON goes), and
--kernels-act fp32 measures tandem's exact mode instead of the int8 default.
"""
import argparse
import json
import os

from tandem import LLM
from tandem.bench.engines import LlamaCppPeer, TandemPeer
from tandem.bench.peers import context_tpot
from tandem.model.loader import default_model_path

p = argparse.ArgumentParser()
p.add_argument("--threads", type=int, default=2, help="threads of each engine")
p.add_argument("--rounds", type=int, default=3, help="rounds per context length (median taken)")
p.add_argument("--model", default=None, help="a GGUF file (default: the default SmolLM2 Q4_1)")
p.add_argument("--kernels-act", default="int8", help="tandem's kernels_act: int8 (default) or fp32 (exact)")
p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                             "context_tpot.json"), help="JSON file the figures are written to")
cli = p.parse_args()
path = cli.model or default_model_path()
llm = LLM(path, device_threads=cli.threads, kernels_act=cli.kernels_act)
peers, skipped = {"tandem overlap": TandemPeer(llm, "overlap", 128)}, {}
try:
    peers["llama.cpp single"] = LlamaCppPeer(path, cli.threads, 1, 2200)
except ImportError as e:
    skipped["llama.cpp single"] = f"{type(e).__name__}: {e}"
args = argparse.Namespace(tpot_contexts=[128, 2000], tpot_output_len=128, rounds=cli.rounds, seed=0)
out = context_tpot(peers, skipped, llm.engine.model_config.vocab_size, args)
out = {"model": os.path.basename(path), "kernels_act": cli.kernels_act, **out}
print(json.dumps(out, indent=1))
with open(cli.out, "w") as f:
    json.dump(out, f, indent=2)
llm.shutdown()
