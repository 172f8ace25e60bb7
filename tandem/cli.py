"""`tandem` command line: a thin layer over EngineConfig. Subcommands live beside what they drive."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from typing import Any

from .config import EngineConfig

# Modules that add a subcommand through add_parser(subparsers); missing ones are skipped.
SUBCOMMANDS = ("tandem.server.cli", "tandem.trace.cli", "tandem.bench.cli")


def field_help() -> dict[str, str]:
    """Each EngineConfig field's trailing comment: the one place a field is documented."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.+)$")
    return {m[1]: m[2] for m in map(pattern.match, inspect.getsource(EngineConfig).splitlines()) if m}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (--max-running-requests ...), its help the field's comment."""
    helps = field_help()
    for f in dataclasses.fields(EngineConfig):
        # EngineConfig.seed (for requests that give none) is --engine-seed: --seed is a request's own seed.
        flag = "--engine-seed" if f.name == "seed" else "--" + f.name.replace("_", "-")
        flags = (flag, "--trace") if f.name == "trace_dir" else (flag,)
        default = f.default
        if isinstance(default, bool):
            p.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                           help=helps.get(f.name))
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("device_threads", "max_model_len", "kv_cache_tokens"):
                kind = int
            p.add_argument(*flags, dest=f.name, type=kind, default=default, help=helps.get(f.name))


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
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", dest="seed_sampling", type=int, default=None, help="sampling seed of the request")
    g.add_argument("--stop", action="append")
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
