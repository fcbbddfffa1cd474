"""llmopt: a command-line toolkit for LLM inference optimization."""

__version__ = "0.1.0"
