"""`tandem serve`: the OpenAI-compatible server (frontend process + engine process).

SIGTERM / SIGINT: stop accepting, end in-flight requests (finish_reason "abort"), stop the engine process,
exit 0. A second SIGINT skips the graceful wait.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

from ..cli import add_engine_args, engine_config
from ..config import EngineConfig

GRACEFUL_S = 5


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                              description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, "
                                          "/v1/models, /health, /metrics")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the model's name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    config = engine_config(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(run_server(config, args.host, args.port, args.served_model_name, args.log_level))
    except RuntimeError as e:                      # the engine could not start: say why, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 1


async def run_server(config: EngineConfig, host: str, port: int, served_model_name: str | None = None,
                     log_level: str = "info") -> int:
    import uvicorn

    from ..model.loader import load_tokenizer, resolve_model
    from .client import EngineClient
    from .frontend import Frontend
    from .metrics import ServerMetrics
    from .openai_api import build_app

    client = EngineClient(config)
    try:
        info = await client.start()
        # The engine has converted/cached the model by now; the frontend only reads its tokenizer.
        tokenizer = load_tokenizer(resolve_model(config.model, config.cache_dir))
        name = served_model_name or info.model_name
        metrics = ServerMetrics(name, lambda: client.stats)
        client.on_output = metrics.on_output
        app = build_app(client, Frontend(tokenizer, info.max_context, info.vocab_size), name, metrics)
        server = _make_server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="off",
                                             timeout_graceful_shutdown=GRACEFUL_S), client.begin_shutdown)
        await server.serve()
    finally:
        await client.close()
    return 0


def _make_server(config, on_exit):
    """A uvicorn.Server whose signal handler also ends in-flight requests, and which exits 0 after a signal
    (uvicorn's own re-raises the signal once it has shut down)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._on_signal)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def _on_signal(self) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True
            on_exit()

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
