"""The paged KV cache's bookkeeping: the block pool (ref counts, free queue, prefix cache) and the
per-request manager the scheduler uses. The K/V tensors themselves live in llmopt.worker.runner."""
