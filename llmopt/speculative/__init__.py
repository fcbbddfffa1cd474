"""Speculative decoding: drafters (n-gram prompt lookup, a draft model, EAGLE and EAGLE-3 heads) that
propose tokens the engine verifies in one target forward, with exact rejection sampling
(core/sampler.py). `llmopt spec-tune`, which trains heads and tunes K per batch size, is llmopt.spec_tune.

    from llmopt.engine.llm import LLM
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
"""

from llmopt.speculative.config import SpeculativeConfig, parse_speculative_config  # noqa: F401
