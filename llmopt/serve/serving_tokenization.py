"""`OpenAIServingTokenization`: vLLM's /tokenize and /detokenize (serving_tokenization.py)."""

from __future__ import annotations

from llmopt.serve.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from llmopt.serve.serving_chat import render_chat
from llmopt.serve.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, body: TokenizeRequest) -> dict:
        """The token ids of a prompt, or of messages through the chat template."""
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", 400, "prompt")
        if body.messages is not None:
            text = render_chat(self.tokenizer, body.messages, body.add_generation_prompt,
                               chat_template=self.config.chat_template)
            ids = self.tokenize_text(text, add_special_tokens=False, what="messages")
        else:
            ids = self.tokenize_text(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        self.check_model(body.model)
        vocab = self.server.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise OpenAIError(f"token ids must be in [0, {vocab})", 400, "tokens")
        if self.tokenizer is None:
            raise OpenAIError("this model has no tokenizer", 400)
        return {"prompt": self.tokenizer.decode(body.tokens)}
