"""`llmopt serve`: an OpenAI-compatible HTTP server over the async engine, split as vLLM's
vllm/entrypoints/openai: the app and its routes (api_server.py), one serving class per endpoint
family (serving_engine.py, serving_completion.py, serving_chat.py, serving_tokenization.py), the
server's shared state (server.py), streaming (streaming.py), middlewares (middleware.py), the wire
format (protocol.py), Prometheus metrics (metrics.py), uvicorn with our shutdown (run.py) and the
subprocess launcher (launch.py). Nothing is re-exported here: `llmopt.serve.launch` is imported by
callers that must not pay for FastAPI and the engine."""
