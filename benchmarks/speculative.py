"""Speculative decoding (n-gram) single-stream TPOT against tandem without it, llama.cpp plain and llama.cpp's
prompt lookup, plus 64 x 32 -> 128 throughput on vs off (tandem/bench/speculative.py; `tandem bench speculative`).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/speculative.py   # -> benchmarks/results/speculative.{json,md}
"""
import argparse
import json
import os

from tandem.bench.speculative import add_args, bench_speculative, render

here = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_args(p)
p.add_argument("--out", default=os.path.join(here, "results", "speculative.json"), help="JSON result file (.md beside)")
args = p.parse_args()
out = bench_speculative(args)
with open(args.out, "w") as f:
    json.dump(out, f, indent=2)
md = render(out)
with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
    f.write(md)
print(md)
