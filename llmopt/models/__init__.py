from llmopt.models.config import ModelConfig
from llmopt.models.llama import LlamaForCausalLM

__all__ = ["ModelConfig", "LlamaForCausalLM"]
