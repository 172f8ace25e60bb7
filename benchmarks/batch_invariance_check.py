"""The batch-invariance check on the real model at scale: target requests (greedy and seeded, top logprobs,
prompts of 5-1,500 tokens) alone, then inside traffic (background prompts of 1-2,000 tokens, all submitted at
once in a shuffled order, so the targets' prompts are chunked and mixed with others' decode rows); prints how
many targets kept their tokens and logprobs bit for bit, per round. With --no-batch-invariant it shows what
the old paths did.

    .venv/bin/python benchmarks/batch_invariance_check.py [--targets 12 --background 24 --rounds 3]
"""
from __future__ import annotations

import argparse
import json
import random

from tandem import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file, HF folder or Hub id (default: the default model)")
    ap.add_argument("--targets", type=int, default=12, help="requests compared alone and under traffic")
    ap.add_argument("--background", type=int, default=24, help="other requests around them each round")
    ap.add_argument("--rounds", type=int, default=3, help="traffic rounds (fresh background each)")
    ap.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine option under test (default: on, as tandem's default)")
    ap.add_argument("--scheduler", default="overlap", help="the loop: overlap or serial")
    args = ap.parse_args()
    llm = LLM(args.model, batch_invariant=args.batch_invariant, scheduler=args.scheduler)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]
    targets = [prompt(rng.choice([5, 37, 97, 150, 300, 600, 1500])) for _ in range(args.targets)]
    params = [SamplingParams(temperature=0, max_tokens=16, logprobs=2) if i % 2 == 0 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=16, logprobs=2) for i in range(args.targets)]
    alone = [llm.generate([t], p, use_tqdm=False)[0] for t, p in zip(targets, params)]
    for r in range(args.rounds):
        bg = [prompt(rng.randint(1, 2000)) for _ in range(args.background)]
        bg_params = [SamplingParams(temperature=0.7, seed=j, max_tokens=rng.randint(4, 40), ignore_eos=True)
                     for j in range(args.background)]
        order = list(range(args.background + args.targets))
        rng.shuffle(order)
        everyone, ps = bg + targets, bg_params + params
        outs = llm.generate([everyone[o] for o in order], [ps[o] for o in order], use_tqdm=False)
        got = {o: out for o, out in zip(order, outs)}
        loaded = [got[args.background + i] for i in range(args.targets)]
        same_tokens = sum(a.token_ids == b.token_ids for a, b in zip(alone, loaded))
        same_bits = sum(a.token_ids == b.token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs
                        for a, b in zip(alone, loaded))
        print(json.dumps({"round": r, "batch_invariant": args.batch_invariant, "targets": args.targets,
                          "same_tokens": same_tokens, "same_tokens_and_logprobs": same_bits}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
