"""The OpenAI-compatible server: an HTTP frontend process and an engine process, joined by ZMQ.

cli.py (`tandem serve`) -> replicas.py (--dp: D engines and router.py) -> client.py (spawns engine_proc.py,
routes its outputs) -> openai_api.py (FastAPI), with protocol.py (request/response shapes), frontend.py
(tokens <-> text), ipc.py (messages), metrics.py.
"""
