"""`tandem serve`: the OpenAI-compatible server (frontend process + engine process).

With --nnodes M, node 0 serves and nodes 1..M-1 (`--node-rank R`) only run their tensor-parallel ranks.

SIGTERM / SIGINT, at any moment from start-up to teardown: stop accepting, end in-flight requests (503 +
Retry-After), stop the engine processes, exit 0. If an engine process dies, its in-flight requests fail with
503 and the server exits 1 (unless --no-exit-on-engine-failure), so that a supervisor restarts it; with --dp
the other replicas' requests first get --engine-failure-grace seconds to finish. lifecycle.py has the rules.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass

from ..cli import add_engine_args, engine_config
from ..config import EngineConfig
from ..replicas.replica_set import DataParallel, add_dp_args, dp_options, replica_cores
from .harmony import NAMES as HARMONY_NAMES, special_ids, speaks_harmony

GRACEFUL_S = 5
ENGINE_FAILURE_GRACE_S = 30.0
# A CPU step takes well under a minute even for a full prefill chunk of an 8B model: five minutes without one,
# with requests waiting, is a hang (a stuck device, a deadlock), and a restart serves them sooner (SGLang: 300).
WATCHDOG_S = 300.0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="log level of the server and uvicorn")
    p.add_argument("--max-request-bytes", type=int, default=None,
                   help="refuse request bodies above this size with 413 (default: 1 MiB + 32 bytes per context "
                        "token)")
    p.add_argument("--generation-config", default="auto", choices=["auto", "none"],
                   help="'auto': fields a request omits (temperature, top_p, top_k, min_p, repetition_penalty) take "
                        "the model's defaults (generation_config.json, a GGUF's general.sampling.*; shown in "
                        "/v1/models); 'none': tandem's own defaults")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", *HARMONY_NAMES],
                   help="split a thinking model's <think>...</think> text into the chat message's reasoning_content "
                        "(streamed as delta.reasoning_content); tool calls are parsed from the rest; gpt-oss: the "
                        "harmony format's channels into reasoning, tool calls and content (default: gpt-oss for a "
                        "model whose tokenizer and chat template speak harmony, else off)")
    p.add_argument("--max-messages", type=int, default=2048,
                   help="refuse chat requests with more messages with 400")
    p.add_argument("--health-timeout", type=float, default=30.0,
                   help="/health turns 503 when the engine has made no progress for this many seconds (raise it "
                        "for models whose single step takes longer)")
    p.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="exit 1 when the engine process dies, so that a supervisor restarts the server "
                        "(--no-exit-on-engine-failure: keep answering 503; with --dp the live replicas keep serving)")
    p.add_argument("--engine-failure-grace", type=float, default=ENGINE_FAILURE_GRACE_S,
                   help="with --exit-on-engine-failure: seconds the other replicas' in-flight requests get to "
                        f"finish (new ones get 503) before the rest are ended with 503 and the server exits 1 "
                        f"(default {ENGINE_FAILURE_GRACE_S:g})")
    p.add_argument("--watchdog-timeout", type=float, default=WATCHDOG_S,
                   help="with requests in flight and no engine step completed for this many seconds, end them with "
                        "503 (an error event in a stream), kill the engine and exit 1 (as an engine failure), so "
                        f"that a supervisor restarts a hung server; 0: off (default {WATCHDOG_S:g}: generous, "
                        "a CPU step takes seconds; raise it for models whose single step takes minutes)")
    add_dp_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    for name in ("max_request_bytes", "max_messages"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.health_timeout > 0:
        raise ValueError("--health-timeout must be > 0")
    if not args.engine_failure_grace >= 0:
        raise ValueError("--engine-failure-grace must be >= 0")
    if not 0 <= args.watchdog_timeout < float("inf"):
        raise ValueError("--watchdog-timeout must be a number of seconds >= 0 (0: off)")
    options = ServeOptions(args.host, args.port, args.served_model_name, args.log_level, args.max_request_bytes,
                           args.max_messages, args.health_timeout, args.exit_on_engine_failure, dp_options(args),
                           args.engine_failure_grace, args.generation_config, args.reasoning_parser,
                           args.watchdog_timeout)
    replica_cores(config, options.dp)              # a --dp the cores cannot take is a clear error, here
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if config.node_rank > 0:                       # another machine's tp ranks: no scheduler, no HTTP server
        from ..device.parallel.tp_worker import run_node
        return run_node(config)
    try:
        return asyncio.run(run_server(config, options))
    except RuntimeError as e:                      # the engine could not start: say why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


@dataclass(frozen=True)
class ServeOptions:
    """The server's own options (the engine's are EngineConfig); see add_parser for each one's help."""
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    log_level: str = "info"
    max_request_bytes: int | None = None
    max_messages: int = 2048
    health_timeout_s: float = 30.0
    exit_on_engine_failure: bool = True
    dp: DataParallel = DataParallel()
    engine_failure_grace_s: float = ENGINE_FAILURE_GRACE_S
    generation_config: str = "auto"     # "auto": the model's sampling defaults for omitted fields; "none"
    reasoning_parser: str | None = None  # "qwen3" / "deepseek_r1" (reasoning.py), "gpt-oss" (harmony.py)
    watchdog_timeout_s: float = WATCHDOG_S  # hung this long with requests open: fail them, exit 1 (0: off)


async def run_server(config: EngineConfig, options: ServeOptions = ServeOptions()) -> int:
    """Serve until a signal (exit 0) or, with exit_on_engine_failure, until an engine dies (exit 1)."""
    import uvicorn

    from ..fingerprint import system_fingerprint
    from ..model.loader import load_tokenizer, resolve_model
    from ..model.sampling_defaults import sampling_defaults
    from .frontend import Frontend
    from .lifecycle import Lifecycle
    from .limits import ServerLimits
    from .metrics import ServerMetrics
    from .openai_api import build_app
    from ..replicas.replica_set import ReplicaSet, replica_clients
    from ..replicas.router import Router

    client = ReplicaSet(replica_clients(config, options.dp), Router(options.dp.size, options.dp.router),
                        options.health_timeout_s, options.watchdog_timeout_s or None)
    life = Lifecycle(client, options.exit_on_engine_failure, options.engine_failure_grace_s)
    life.install()                                 # before any engine process or runtime folder exists
    client.on_dead = life.on_dead
    frontend = None
    try:
        info = await life.start(client.start())
        # The engine has converted/cached the model by now; the frontend only reads its tokenizer.
        source = resolve_model(config.model, config.cache_dir)
        tokenizer = load_tokenizer(source)
        defaults = sampling_defaults(source) if options.generation_config == "auto" else {}
        name = options.served_model_name or info.model_name
        limits = ServerLimits(options.max_request_bytes or ServerLimits.default_request_bytes(info.max_context),
                              options.max_messages, options.health_timeout_s)
        metrics = ServerMetrics(name, client.replica_stats)
        client.on_output = metrics.on_output
        frontend = Frontend(tokenizer, info.max_context, info.vocab_size, limits.max_messages, defaults)
        fingerprint = await asyncio.to_thread(system_fingerprint, config, source.weight_files)
        app = build_app(client, frontend, name, metrics, limits, fingerprint,
                        reasoning_parser(options.reasoning_parser, tokenizer))
        life.server = _make_server(uvicorn.Config(app, host=options.host, port=options.port,
                                                  log_level=options.log_level, lifespan="off",
                                                  timeout_graceful_shutdown=GRACEFUL_S))
        if life.signalled:                         # a signal while the frontend was being built
            return 0
        if client.engine_failed:                   # a replica died while the frontend was being built
            life.on_dead()
        await life.server.serve()
    except asyncio.CancelledError:                 # a signal during start-up
        if not life.signalled:
            raise
    finally:
        await client.close()
        if frontend is not None:
            frontend.close()
        life.remove()                              # the last folder is gone: default handlers from here
    return 1 if client.engine_failed and options.exit_on_engine_failure else 0


def reasoning_parser(asked: str | None, tokenizer) -> str | None:
    """--reasoning-parser, or gpt-oss for a model that speaks harmony (its output is unreadable without it);
    SystemExit naming what is missing where gpt-oss is asked of a tokenizer without harmony's tokens."""
    if asked is None and speaks_harmony(tokenizer):
        logging.getLogger(__name__).info("the model's tokenizer and chat template speak harmony: "
                                            "--reasoning-parser gpt-oss")
        return "gpt-oss"
    if asked in HARMONY_NAMES:
        try:
            special_ids(tokenizer)
        except ValueError as e:
            raise SystemExit(f"--reasoning-parser {asked}: {e}") from None
    return asked


def _make_server(config):
    """A uvicorn.Server without signal handlers of its own: Lifecycle's span the whole run, where uvicorn's
    live only while it serves (and re-raise the signal once it has shut down; here a signal means exit 0)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)


def main(argv: list[str] | None = None) -> int:
    """`python -m tandem.server.cli [serve options]`: the serve subcommand alone."""
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
