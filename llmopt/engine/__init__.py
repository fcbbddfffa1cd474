"""The inference engine: requests, a continuous-batching scheduler over the paged KV cache
(llmopt.cache), a model runner, a batched sampler, and the LLM / async front ends."""

from llmopt.engine.args import EngineArgs
from llmopt.core.sampling_params import SamplingParams

__all__ = ["EngineArgs", "SamplingParams"]
