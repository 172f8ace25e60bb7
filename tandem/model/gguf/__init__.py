"""GGUF: the file over its memory map (file.py), its metadata as ModelConfig (config.py), its weights and tokenizer
(weights.py) and the cached config + tokenizer folder (cache.py)."""
