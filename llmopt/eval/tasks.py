"""Downstream accuracy through lm-evaluation-harness, in this process: `run_tasks` evaluates a model
(and optionally its base) on lm-eval's own tasks through the `llmopt` lm-eval model
(`llmopt.eval.harness`) and returns one row per task metric: the value, lm-eval's standard error, and
with a base model the difference and whether it lies inside the noise (|difference| <= 1.96 x the
two standard errors combined, the two runs taken as independent samples).

lm-eval is the optional `eval` extra: it is imported inside the functions (an optional dependency)."""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from llmopt import defaults
from llmopt.errors import UserInputError

NOISE_Z = 1.96            # the verdict's two-sided 95% band
INSTALL_HINT = "lm-evaluation-harness is not installed: pip install 'llmopt[eval]'"
LM_EVAL_KEYS = ("results", "versions", "n-shot", "higher_is_better", "n-samples")   # kept from its result dict


@dataclass
class MetricRow:
    task: str
    metric: str                      # lm-eval's metric name, e.g. acc, acc_norm, word_perplexity
    filter: str                      # lm-eval's filter, "none" for most tasks
    value: float
    stderr: float | None             # lm-eval's standard error (None where it gives "N/A")
    base_value: float | None = None
    base_stderr: float | None = None
    difference: float | None = None  # value - base_value
    within_noise: bool | None = None


@dataclass
class TaskEvalResult:
    model: str
    base_model: str | None
    tasks: list[str]
    limit: float | None
    num_fewshot: int | None
    rows: list[MetricRow]
    seconds: float
    base_seconds: float | None
    lm_eval: dict = field(default_factory=dict)       # lm-eval's own result dictionary (its JSON-safe keys)
    base_lm_eval: dict | None = None


def _lm_eval():
    # offline, as the rest of the toolkit: datasets reads its cache and never asks the Hub (read when
    # datasets is first imported, so set before lm-eval imports it)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval  # deferred: the optional `eval` extra
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise UserInputError(INSTALL_HINT) from e
    return lm_eval, TaskManager


def task_manager(include_path: str | None):
    """lm-eval's TaskManager over its own tasks and the user's task YAML folder."""
    _, TaskManager = _lm_eval()
    if include_path is not None and not os.path.exists(include_path):
        raise UserInputError(f"--include-path {include_path}: no such file or folder")
    return TaskManager(include_path=include_path)


def check_tasks(tasks: list[str], manager, flag: str = "--tasks") -> None:
    """Each name is a task, group or tag lm-eval knows, and its data loads offline; else one line."""
    if not tasks:
        raise UserInputError(f"{flag} is empty: name at least one lm-eval task")
    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            raise UserInputError(f"unknown lm-eval task {name!r}: see `lm_eval --tasks list`, or give its task "
                                 "YAML folder with --include-path")
        try:
            manager.load([name])
        except Exception as e:   # datasets raises many kinds (ConnectionError, DatasetNotFoundError, OSError, ...)
            raise UserInputError(f"task {name!r}: its data is not available offline ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:200] if str(e) else ''}); load it once online with "
                                 f"`lm_eval --tasks {name} --limit 1 ...` so it lands in the Hugging Face cache, or "
                                 "point --include-path at a task YAML with local data_files") from e


def parse_limit(limit: float | None, flag: str = "--limit") -> int | float | None:
    """lm-eval's --limit rule: a whole count of documents >= 1, or a fraction of each task below 1."""
    if limit is None:
        return None
    if not (0 < limit < 1 or (limit >= 1 and limit == int(limit))):
        raise UserInputError(f"{flag} {limit:g}: give a whole count >= 1 or a fraction in (0, 1)")
    return int(limit) if limit >= 1 else limit


def parse_task_names(tasks: str) -> list[str]:
    """Comma-separated task names (empty entries dropped; `check_tasks` refuses an empty list)."""
    return [t.strip() for t in tasks.split(",") if t.strip()]


def _jsonable(results: dict) -> dict:
    kept = {k: results[k] for k in LM_EVAL_KEYS if k in results}
    return json.loads(json.dumps(kept, default=str))


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def metric_rows(results: dict) -> list[MetricRow]:
    """One row per (task, metric, filter) of lm-eval's `results`, with its standard error."""
    rows = []
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or "_stderr," in key or _number(value) is None:
                continue
            metric, filt = key.split(",", 1)
            rows.append(MetricRow(task, metric, filt, float(value), _number(metrics.get(f"{metric}_stderr,{filt}"))))
    return rows


def compare(rows: list[MetricRow], base_rows: list[MetricRow]) -> list[MetricRow]:
    """Fill each row's base value, difference and noise verdict from the base model's rows."""
    base = {(r.task, r.metric, r.filter): r for r in base_rows}
    for r in rows:
        b = base.get((r.task, r.metric, r.filter))
        if b is None:
            continue
        r.base_value, r.base_stderr, r.difference = b.value, b.stderr, r.value - b.value
        if r.stderr is not None and b.stderr is not None:
            r.within_noise = abs(r.difference) <= NOISE_Z * math.hypot(r.stderr, b.stderr)
    return rows


def evaluate_model(model: str | None, tasks: list[str], manager, *, limit: float | None, num_fewshot: int | None,
                   max_length: int | None = None, seed: int = 0, **engine_args) -> tuple[dict, float]:
    """lm-eval's simple_evaluate on one model through the engine; (its result dictionary, seconds)."""
    lm_eval, _ = _lm_eval()
    from llmopt.eval.harness import LLMoptLM  # deferred: imports lm-eval (optional dependency)
    t0 = time.perf_counter()
    lm = LLMoptLM(model=model, max_length=max_length, **engine_args)
    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, random_seed=seed, numpy_random_seed=seed,
                                      torch_random_seed=seed, fewshot_random_seed=seed, log_samples=False)
    del lm
    return results, time.perf_counter() - t0


def run_tasks(model: str | None, tasks: list[str], *, base_model: str | None = None, limit: float | None = None,
              num_fewshot: int | None = None, include_path: str | None = None, max_length: int | None = None,
              seed: int = 0, progress: Callable[[int], None] | None = None, manager=None,
              **engine_args) -> TaskEvalResult:
    """Evaluate `model` (and `base_model`, when given) on lm-eval `tasks`; see the module docstring.
    `progress(1)` after each model's evaluation; `manager`: a TaskManager check_tasks has passed."""
    if manager is None:
        manager = task_manager(include_path)
        check_tasks(tasks, manager)
    kw = dict(limit=limit, num_fewshot=num_fewshot, max_length=max_length, seed=seed, **engine_args)
    base_results, base_seconds = None, None
    if base_model is not None:
        base_results, base_seconds = evaluate_model(base_model, tasks, manager, **kw)
        if progress:
            progress(1)
    results, seconds = evaluate_model(model, tasks, manager, **kw)
    if progress:
        progress(1)
    rows = metric_rows(results)
    if base_results is not None:
        rows = compare(rows, metric_rows(base_results))
    return TaskEvalResult(model=model or defaults.DEFAULT_MODEL, base_model=base_model, tasks=list(tasks), limit=limit,
                          num_fewshot=num_fewshot, rows=rows, seconds=seconds, base_seconds=base_seconds,
                          lm_eval=_jsonable(results), base_lm_eval=_jsonable(base_results) if base_results else None)
