"""Speculative decoding (n-gram) single-stream TPOT against tandem without it, llama.cpp plain and llama.cpp's
prompt lookup, plus 64 x 32 -> 128 throughput on vs off (tandem/bench/speculative.py; `tandem bench speculative`).

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/speculative.py   # -> benchmarks/results/speculative.{json,md}
"""
import argparse
import os

from tandem.bench import write_json_md
from tandem.bench.speculative import add_args, bench_speculative, render

here = os.path.dirname(os.path.abspath(__file__))
p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
add_args(p)
p.add_argument("--out", default=os.path.join(here, "results", "speculative.json"), help="JSON result file (.md beside)")
args = p.parse_args()
out = bench_speculative(args)
write_json_md(args.out, out, render(out))
