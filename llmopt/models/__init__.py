"""The model package. `ModelConfig` (models/config.py) is torch-free; `LlamaForCausalLM` imports torch
only when first asked for, so `from llmopt.models.config import ...` stays light (kv-estimate)."""

from llmopt.models.config import ModelConfig

__all__ = ["ModelConfig", "LlamaForCausalLM"]


def __getattr__(name: str):
    if name == "LlamaForCausalLM":
        from llmopt.models.llama import LlamaForCausalLM  # deferred: torch only when first asked for (kv-estimate)
        return LlamaForCausalLM
    raise AttributeError(f"module 'llmopt.models' has no attribute {name!r}")
