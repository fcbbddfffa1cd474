"""The engine core the runner and the proposers share: requests, sampling parameters, outputs, the
continuous-batching scheduler over the paged KV cache (llmopt.cache), stop checks and the sampler."""
