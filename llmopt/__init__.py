"""llmopt: a command-line toolkit for LLM inference optimization."""

__version__ = "0.1.0"

_LAZY = {
    "LLM": "llmopt.engine.llm",
    "SamplingParams": "llmopt.core.sampling_params",
    "EngineArgs": "llmopt.engine.args",
    "LLMEngine": "llmopt.engine.engine",
    "AsyncLLMEngine": "llmopt.engine.async_engine",
}


def __getattr__(name: str):
    """`from llmopt import LLM, SamplingParams` without importing torch on `import llmopt`."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llmopt' has no attribute {name!r}")
