"""Where the n-gram proposer runs under the overlap loop's one-step lag: optimistically on the host (built) or on
the device side (measured here as a prototype op, not built into the engine). Issue 18 asks to measure both.

The lag: batch k+1 is picked before the host knows what batch k accepted. The two ways out:
  - host, optimistic (tandem/scheduler/speculative.py): assume k's run is accepted whole plus the n-gram's
    continuation, pick k+1 from that text, drop k+1's rows of a request whose assumption failed; a request with
    nothing to assume waits for host truth (a sync). Its cost: the dropped rows and the syncs' device idle.
  - device side (SGLang's spec v2): the device, which holds k's accepted tokens first, appends them to a
    per-request token table and matches the n-gram there, writing k+1's drafts into its input ids; positions,
    seed positions and KV slots of k+1 then depend on k's accepted count, so they too are computed on the device,
    with KV slots allocated for the longest run. Its cost: the table write and the match op on the device in every
    step (on a CPU the device shares the cores), a fixed row count per drafting request (a row whose match found
    nothing still runs), and the over-allocated KV.

Measured here, on the machine it runs on:
  1. the per-step cost of each proposer: on the host the scheduler's NgramIndex (and the whole-text scan,
     propose_ngram, it replaced), and the device op (the table write + a batched torch match over [B, L] token
     tables, on the device's thread count), checked to propose what propose_ngram does;
  2. the optimistic path's losses in the engine per workload (tandem/bench/speculative.py's prompts, overlap
     loop, answers to EOS): decode steps, picks ahead and dropped, syncs, device idle against the same loop with
     speculation off;
  3. the device-side estimate from them: the optimistic TPOT less its measured losses plus the device op each step.

    flock /tmp/tandem-bench.lock .venv/bin/python benchmarks/ngram_placement.py   # -> results/ngram_placement.{json,md}
"""
import argparse
import os
import random
import statistics
import time

import torch

from tandem.bench import write_json_md
from tandem.speculative.ngram import NgramIndex, propose_ngram


def device_match(table: torch.Tensor, lens: torch.Tensor, k: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prototype device-side proposer: for each row of `table` ([B, L] token ids, valid up to lens), the k
    tokens after the most recent earlier occurrence of its longest repeating suffix of hi..lo tokens (as
    propose_ngram). Returns drafts [B, k] (-1 past the proposal) and their counts [B]."""
    b, width = table.shape
    best = torch.full((b,), -1, dtype=torch.long)          # start of the continuation in the table
    for n in range(hi, lo - 1, -1):
        idx = (lens - n).clamp(min=0)[:, None] + torch.arange(n)
        suffix = table.gather(1, idx)                                         # [B, n]
        win = table.unfold(1, n, 1)                                           # [B, width - n + 1, n]
        starts = torch.arange(win.shape[1])
        hit = (win == suffix[:, None, :]).all(-1) & (starts[None, :] + n < lens[:, None]) & (lens[:, None] > n)
        last = torch.where(hit, starts[None, :], -1).amax(1)
        take = (best < 0) & (last >= 0)
        best = torch.where(take, last + n, best)
    pos = best[:, None] + torch.arange(k)
    ok = (best[:, None] >= 0) & (pos < lens[:, None])
    drafts = torch.where(ok, table.gather(1, pos.clamp(0, width - 1)), -1)
    return drafts, ok.sum(1)


def best_of(fn, reps: int, blocks: int = 5) -> float:
    """Seconds per call: the best of `blocks` blocks of reps calls (a shared machine's pauses excluded)."""
    best = float("inf")
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def op_costs(threads: int, k: int, lo: int, hi: int, reps: int) -> list[dict]:
    """Seconds per step of each proposer at batch B and text length L (random text with repeats: a prompt
    quoted back), and a check that both propose the same drafts."""
    torch.set_num_threads(threads)
    rng = random.Random(0)
    out = []
    for b in (1, 8, 32):
        for length in (256, 1024, 4096):
            texts = []
            for _ in range(b):
                base = [rng.randrange(3, 49152) for _ in range(length // 2)]
                cut = rng.randrange(length // 4, length // 2)
                texts.append((base + base[:cut] + [rng.randrange(3, 49152) for _ in range(length)])[:length])
            width = length + 64
            table = torch.full((b, width), -1, dtype=torch.long)
            for i, t in enumerate(texts):
                table[i, :len(t)] = torch.tensor(t)
            lens = torch.tensor([len(t) for t in texts])
            drafts, counts = device_match(table, lens, k, lo, hi)
            for i, t in enumerate(texts):
                want = propose_ngram(t, k, lo, hi)
                assert drafts[i, :counts[i]].tolist() == want, (b, length, i)
            accepted = torch.randint(3, 49152, (b, k + 1))
            cols = lens[:, None] + torch.arange(k + 1)

            def device_step():
                table.scatter_(1, cols, accepted)          # the step's accepted tokens into the table
                device_match(table, lens, k, lo, hi)

            def host_step():
                for t in texts:
                    propose_ngram(t, k + 1, lo, hi)
            indexes = [NgramIndex(lo, hi) for _ in texts]
            grown: list[list[int]] = [[] for _ in texts]

            def index_step():                      # the scheduler's path: one more token, then a proposal
                for t, g, ix in zip(texts, grown, indexes):
                    g.append(t[len(g) % len(t)])
                    ix.propose((t, g), [], k + 1)
            index_step()                           # the index built over the prompt (once a request)
            dev, host, index = best_of(device_step, reps), best_of(host_step, reps), best_of(index_step, reps)
            out.append({"batch": b, "text_len": length, "device_op_ms": 1e3 * dev, "host_ms": 1e3 * host,
                        "host_index_ms": 1e3 * index})
            print(out[-1], flush=True)
    return out


def engine_losses(threads: int, rounds: int, n: int) -> dict:
    """Per workload: the optimistic overlap loop with speculation (TPOT, decode steps, picks ahead / dropped,
    syncs, idle) beside the same loop with it off, medians over interleaved rounds."""
    from tandem import LLM
    from tandem.bench.speculative import SPEC, WORKLOADS, device_idle, tandem_tpot
    llm = LLM(device_threads=threads, speculative_config=SPEC)
    tok = llm.tokenizer
    res = {}
    try:
        for name, msgs in WORKLOADS.items():
            ids = tok.encode(llm.apply_chat_template(msgs), add_special_tokens=False)
            tandem_tpot(llm, ids, 4)
            runs: dict[str, list[dict]] = {"off": [], "spec": []}
            for _ in range(rounds):
                for key, on in (("off", False), ("spec", True)):
                    llm.engine.config = llm.engine.config.replace(scheduler="overlap",
                                                                  speculative_config=SPEC if on else None)
                    llm.engine.recorder.clear()
                    t, d = tandem_tpot(llm, ids, n, True)
                    dev = [x for x in llm.engine.recorder.devices if not x.is_prefill]
                    runs[key].append({"tpot_ms": 1e3 * t, "idle": device_idle(llm), "steps": len(dev),
                                      "step_ms": 1e3 * statistics.median(x.end - x.start for x in dev),
                                      "tokens": d["tokens"], "ahead": d.get("spec_ahead_drafts", 0),
                                      "dropped": d.get("spec_ahead_dropped", 0), "syncs": d.get("spec_syncs", 0)})
            med = {key: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for key, rs in runs.items()}
            res[name] = med
            print(name, med, flush=True)
    finally:
        llm.shutdown()
    return res


def estimate(losses: dict, ops: list[dict]) -> dict:
    """The device-side TPOT estimate per workload: the optimistic run's busy device time less its dropped steps,
    its idle brought down to the spec-off loop's (no syncs), plus the device op in every step: the torch prototype's
    time (batch 1, 256 tokens), and none (what a native op would come near; the most device-side could gain).
    Drafts the device finds no match for would still be rows there: not counted (a lower bound on its cost)."""
    op = next(o["device_op_ms"] for o in ops if o["batch"] == 1 and o["text_len"] == 256)
    out = {}
    for name, m in losses.items():
        s, off = m["spec"], m["off"]
        gaps = s["tokens"] - 1
        per_step = s["tpot_ms"] * gaps * (1 - s["idle"]) / max(s["steps"], 1)
        steps = s["steps"] - s["dropped"]
        out[name] = {f"device_side_tpot_ms_{kind}": steps * (per_step + c) / (1 - off["idle"]) / gaps
                     for kind, c in (("torch_op", op), ("free_op", 0.0))}
    return out


def render(out: dict) -> str:
    lines = ["# Where the n-gram proposer runs: optimistic on the host vs the device side", "",
             f"SmolLM2-135M Q4_1, {out['threads']} threads, overlap loop, answers to EOS (at most {out['output_len']} "
             f"tokens), median of {out['rounds']} interleaved rounds; k = {out['k']}. The device-side proposer is a "
             "prototype op (benchmarks/ngram_placement.py: the step's accepted tokens scattered into a [B, L] token "
             "table, then a batched match), checked to propose what propose_ngram does; it is not in the engine.", "",
             "## 1. Cost of one proposal step", "",
             "| batch | text length | device op (table write + match) ms | host scan (propose_ngram) ms | "
             "host index (NgramIndex, the scheduler's) ms |", "|---|---|---|---|---|"]
    for o in out["ops"]:
        lines.append(f"| {o['batch']} | {o['text_len']} | {o['device_op_ms']:.3f} | {o['host_ms']:.3f} | "
                     f"{o['host_index_ms']:.3f} |")
    lines += ["", "## 2. The optimistic path's losses in the engine", "",
              "| workload | TPOT off ms | TPOT spec ms | decode steps | picks ahead / dropped | syncs | device idle off | "
              "device idle spec | device-side TPOT estimate ms (torch op / no op cost) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, m in out["losses"].items():
        s, off, e = m["spec"], m["off"], out["estimate"][name]
        lines.append(f"| {name} | {off['tpot_ms']:.2f} | {s['tpot_ms']:.2f} | {s['steps']:.0f} | {s['ahead']:.0f} / "
                     f"{s['dropped']:.0f} | {s['syncs']:.0f} | {100 * off['idle']:.1f} % | {100 * s['idle']:.1f} % | "
                     f"{e['device_side_tpot_ms_torch_op']:.2f} / {e['device_side_tpot_ms_free_op']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="device threads (and the op's torch threads)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the engine runs (medians)")
    p.add_argument("--output-len", type=int, default=256, help="most output tokens an answer runs to (ends at EOS)")
    p.add_argument("--reps", type=int, default=200, help="repetitions of each op timing")
    p.add_argument("--out", default=os.path.join(here, "results", "ngram_placement.json"),
                   help="JSON result file (.md beside)")
    args = p.parse_args()
    k, lo, hi = 4, 1, 4
    ops = op_costs(args.threads, k, lo, hi, args.reps)
    losses = engine_losses(args.threads, args.rounds, args.output_len)
    out = {"threads": args.threads, "rounds": args.rounds, "output_len": args.output_len, "k": k, "ops": ops,
           "losses": losses, "estimate": estimate(losses, ops)}
    write_json_md(args.out, out, render(out))


if __name__ == "__main__":
    main()
