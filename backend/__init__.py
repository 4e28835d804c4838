"""cachegw's built-in inference engine: a small paged-KV engine in the spirit of vLLM."""

from backend.llm import LLM
from backend.outputs import CompletionOutput, RequestOutput
from backend.sampling_params import InvalidParameter, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "InvalidParameter"]
