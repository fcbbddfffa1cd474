"""`llmopt serve`: an OpenAI-compatible HTTP server over the async engine (app.py), its wire format
(protocol.py) and its Prometheus metrics (metrics.py)."""
