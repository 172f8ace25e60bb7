"""The OpenAI-compatible server: the HTTP frontend process, over engine replicas joined by ZMQ.

cli.py (`tandem serve`) -> the replicas (tandem/replicas: D engine processes, their clients and the router)
-> openai_api.py (FastAPI), with protocol.py (request/response shapes), frontend.py (tokens <-> text),
errors.py, limits.py, metrics.py, lifecycle.py (signals, drain) and tools.py (tool calling).
"""
