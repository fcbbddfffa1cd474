"""`llmopt bench`: serving benchmarks of any OpenAI-compatible endpoint (online) and of the engine
in-process (offline), with vLLM's metric definitions and result keys.

    datasets.py   workloads: random (exact token lengths), sharegpt, spec_bench, a prompts file
    schedule.py   arrivals: Poisson / gamma under --request-rate, --max-concurrency, sweeps
    metrics.py    per-request records -> throughput, TTFT, TPOT, ITL, E2EL, goodput; /metrics diffs
    online.py     the streaming HTTP client (aiohttp) over /v1/completions and /v1/chat/completions
    offline.py    the engine in-process on the same schedule; transformers `generate` for --compare hf
    report.py     BenchResult (vLLM's key names), CSV, plots, --compare-to deltas
    saved.py      vllm bench serve's result file (--save-result): name, content, --metadata
    runner.py     one run or a sweep, from a BenchConfig
"""
