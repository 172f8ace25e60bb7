"""What the tests share: tiny models (tiny_models), a real `tandem serve` process (server_utils), engine checks
(engine_checks), and a stand-in vLLM (fake_vllm/, put on a server's PYTHONPATH, never imported here)."""
