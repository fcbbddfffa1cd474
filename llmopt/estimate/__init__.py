"""Memory planning for LLM serving: KV bytes per token, weights, paged blocks, concurrency (`llmopt kv-estimate`)."""

from llmopt.estimate.estimator import KVEstimate, estimate
from llmopt.estimate.kv import bytes_per_token, layer_kv_specs
from llmopt.estimate.arch import ModelArch
from llmopt.estimate.sources import resolve_model_arch
from llmopt.estimate.plan import build_layout
from llmopt.estimate.weights import weight_memory

__all__ = ["KVEstimate", "ModelArch", "build_layout", "bytes_per_token", "estimate", "layer_kv_specs",
           "resolve_model_arch", "weight_memory"]
