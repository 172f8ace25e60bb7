"""A stand-in for `python -m vllm.entrypoints.openai.api_server` (tests of the vLLM peer without vLLM): it
checks the flags and environment the peer must pass, answers /health, and /v1/completions with token ids
(token i of the answer: last prompt id + i + 1), as vLLM does with return_token_ids; a prompt ending in id 0
gets one token whatever max_tokens says (a server that stops early)."""
import argparse
import os
import sys

from aiohttp import web


def main() -> None:
    ap = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host", "--port", "--dtype", "--max-num-seqs",
                 "--max-model-len", "--seed"):
        ap.add_argument(flag, required=True)
    ap.add_argument("--disable-log-stats", action="store_true")
    args = ap.parse_args()
    for var in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND"):
        if not os.environ.get(var):
            sys.exit(f"{var} is not set")
    with open(os.path.join(args.model, "config.json")) as f:
        if '"LlamaForCausalLM"' not in f.read():
            sys.exit("config.json names no LlamaForCausalLM")

    async def health(request):
        return web.Response(text="")

    async def completions(request):
        body = await request.json()
        if body.get("model") != args.served_model_name or not body.get("return_token_ids"):
            return web.json_response({"error": {"message": "bad request"}}, status=400)
        last = body["prompt"][-1]
        ids = [last + i + 1 for i in range(body["max_tokens"] if last else 1)]
        return web.json_response({"choices": [{"index": 0, "text": "", "token_ids": ids}]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host=args.host, port=int(args.port), print=None)


if __name__ == "__main__":
    main()
