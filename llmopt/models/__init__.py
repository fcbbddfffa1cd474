"""The model package. `ModelConfig` (models/config.py) is torch-free; `LlamaForCausalLM` imports torch
only when first asked for, so `from llmopt.models.config import ...` stays light (kv-estimate)."""

__all__ = ["ModelConfig", "LlamaForCausalLM"]


def __getattr__(name: str):
    if name == "ModelConfig":
        from llmopt.models.config import ModelConfig
        return ModelConfig
    if name == "LlamaForCausalLM":
        from llmopt.models.llama import LlamaForCausalLM
        return LlamaForCausalLM
    raise AttributeError(f"module 'llmopt.models' has no attribute {name!r}")
