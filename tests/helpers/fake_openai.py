"""A fake OpenAI-compatible completions server for `tandem bench serve` tests, and the bench CLI's JSON result."""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading

from tandem.cli import main


def run_json(tmp_path, *argv) -> dict:
    """`tandem bench ARGV --json FILE`, its result read back."""
    out = tmp_path / "result.json"
    assert main(["bench", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


class FakeOpenAI:
    """Streams one chunk per token. Request number n (0-based, in arrival order) in `fail_http` gets a 500;
    one in `drop` has its connection closed after two chunks. `usage=False`: no usage chunk."""

    def __init__(self, fail_http=(), drop=(), usage=True) -> None:
        self.fail_http, self.drop, self.usage = set(fail_http), set(drop), usage
        self.bodies: list[dict] = []

    def app(self):
        from aiohttp import web
        app = web.Application()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        return app

    async def models(self, request):
        from aiohttp import web
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def completions(self, request):
        from aiohttp import web
        body = await request.json()
        n = len(self.bodies)
        self.bodies.append(body)
        if n in self.fail_http:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}], "usage": None}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
            if n in self.drop and i == 1:
                request.transport.close()
                return resp
        if self.usage:
            plen = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
            use = {"prompt_tokens": plen, "completion_tokens": body["max_tokens"],
                   "total_tokens": plen + body["max_tokens"]}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': use})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@contextlib.contextmanager
def fake_server(fake: FakeOpenAI):
    from aiohttp import web
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(fake.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
