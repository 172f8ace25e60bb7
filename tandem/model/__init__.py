"""Model loading: configs, GGUF / Hugging Face weights, tokenizers."""
