"""tandem: an LLM serving engine whose scheduler runs one step ahead of the device."""
from .sampling_params import SamplingParams
from .llm import LLM
from .request import EmbeddingRequestOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EmbeddingRequestOutput"]
__version__ = "0.1.0"
