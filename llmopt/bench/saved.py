"""`vllm bench serve`'s result file (--save-result / --append-result): its name, its content and
--metadata, as vllm/benchmarks/serve.py has them.

The file is one run's result object (report.BenchResult.to_dict(): vLLM's keys and llmopt's own),
without the per-request lists vLLM leaves out unless --save-detailed. Its name is
`{label or backend}-{request_rate}qps[-concurrency{N}]-{model's last path part}-{date}.json`
(e.g. `openai-chat-infqps-tiny-20250101-120000.json`) in --result-dir, or --result-filename.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmopt.bench.report import BenchResult
from llmopt.errors import UserInputError

# what vLLM drops from the file without --save-detailed (latencies and queue_times stay, as there)
DETAIL_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")


def parse_metadata(items: list[str] | None) -> dict[str, str]:
    """--metadata KEY=VALUE ...: split at the first '=', both sides stripped (vLLM's reading)."""
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise UserInputError(f"--metadata {item!r}: use KEY=VALUE pairs, e.g. --metadata version=0.3.3 tp=1")
        out[key.strip()] = value.strip()
    return out


@dataclass
class SaveSpec:
    """Where and what --save-result writes."""
    result_dir: str | None = None
    result_filename: str | None = None
    detailed: bool = False          # --save-detailed: keep the per-request lists
    append: bool = False            # --append-result: add a line to the file instead of replacing it

    def path(self, res: BenchResult) -> Path:
        """vLLM's compute_result_filename: --result-filename, else its pattern; under --result-dir."""
        name = self.result_filename or default_filename(res)
        return Path(self.result_dir) / name if self.result_dir else Path(name)

    def content(self, result: dict[str, Any]) -> dict[str, Any]:
        if self.detailed:
            return dict(result)
        return {k: v for k, v in result.items() if k not in DETAIL_KEYS}


def default_filename(res: BenchResult) -> str:
    concurrency = f"-concurrency{res.max_concurrency}" if res.max_concurrency is not None else ""
    model = str(res.model_id or "model").split("/")[-1]
    return f"{res.label or res.backend}-{float(res.request_rate)}qps{concurrency}-{model}-{res.date}.json"
