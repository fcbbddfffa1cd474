"""Evaluation: perplexity by the peers' protocols (sliding, chunks, rolling, llamacpp) and KL
divergence against a base model."""

from llmopt.eval.data import TextDataset, load_text_dataset
from llmopt.eval.ppl import METHODS, KLResult, PplPlan, PplResult, plan_ppl, run_ppl

__all__ = ["TextDataset", "load_text_dataset", "METHODS", "KLResult", "PplPlan", "PplResult", "plan_ppl", "run_ppl"]
