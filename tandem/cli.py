"""`tandem` command line: a thin layer over EngineConfig. Subcommands live beside what they drive."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
from typing import Any

from .config import EngineConfig

# Modules that add a subcommand through add_parser(subparsers); missing ones are skipped.
SUBCOMMANDS = ("tandem.server.cli", "tandem.trace.cli", "tandem.bench.cli")
# Short flags beside the field's own (--trace-dir, --tp-size).
ALIASES = {"trace_dir": ("--trace",), "tp_size": ("--tp",), "pp_size": ("--pp",)}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-running-requests ...), its help from the field's comment."""
    helps = EngineConfig.help()
    for f in dataclasses.fields(EngineConfig):
        # EngineConfig.seed (for requests that give none) is --engine-seed: --seed is a request's own seed.
        flag = "--engine-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        flags = (flag, *ALIASES[f.name]) if f.name in ALIASES else (flag,)
        default = f.default
        doc = helps.get(f.name, "")
        if isinstance(default, bool):
            p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default, help=doc)
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("device_threads", "max_model_len", "kv_cache_tokens"):
                kind = int
            if f.name == "max_queue_time":
                kind = float
            p.add_argument(*flags, dest=f.name, type=kind, default=default,
                           help=f"{doc} (default: {default})" if default is not None else doc)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    kw: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)
                          if hasattr(args, f.name)}
    return EngineConfig(**kw)


def _generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams
    config = engine_config(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_sampling, stop=args.stop or None)
    llm = LLM(**dataclasses.asdict(config))
    try:
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    finally:
        llm.shutdown()
    print(out.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="complete one prompt and print the text")
    g.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (-1: off)")
    g.add_argument("--seed", dest="seed_sampling", type=int, default=None, help="sampling seed of the request")
    g.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(g)
    g.set_defaults(func=_generate)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            if e.name != name:
                raise
            continue
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
