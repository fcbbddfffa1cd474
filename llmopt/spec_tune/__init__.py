"""`llmopt spec-tune`: trains EAGLE heads on the target's own outputs (train.py, train_data.py,
train_loss.py, self_instruct.py) and tunes the speculative config per batch size (tune.py). A client
of the engine; the proposers it trains plug into the engine from llmopt.speculative."""
