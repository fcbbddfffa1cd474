"""`llmopt eval`: lm-evaluation-harness's tasks on the engine, optionally against a base model."""

from __future__ import annotations

import typer

from llmopt.cli import common, output
from llmopt.cli.ranges import in_range

# Shown under Examples in --help (app.py registers the command); one short line each.
EXAMPLES = [
    "llmopt eval --tasks hellaswag,arc_easy --limit 200",
    "llmopt eval -m out/smollm2-awq --base-model smollm2-135m --tasks arc_easy",
    "llmopt eval --tasks my_task --include-path tasks/ --json",
]


def _fmt(v) -> str:
    return "-" if v is None else output.fmt(v)


def task_table(r):
    """The table of a TaskEvalResult (also in quantize's summary with --eval-tasks)."""
    from rich.table import Table
    title = f"lm-eval: {r.model}" + (f" vs base {r.base_model}" if r.base_model else "")
    t = Table(title=title, title_justify="left")
    cols = ["task", "metric"] + (["base", "model", "difference", "stderr (base, model)", "verdict"]
                                 if r.base_model else ["value", "stderr"])
    for c in cols:
        t.add_column(c, justify="left" if c in ("task", "metric", "verdict") else "right")
    for row in r.rows:
        name = row.metric + ("" if row.filter == "none" else f" ({row.filter})")
        if r.base_model:
            verdict = {True: "inside the noise", False: "outside the noise", None: "-"}[row.within_noise]
            t.add_row(row.task, name, _fmt(row.base_value), _fmt(row.value), _fmt(row.difference),
                      f"{_fmt(row.base_stderr)}, {_fmt(row.stderr)}", verdict)
        else:
            t.add_row(row.task, name, _fmt(row.value), _fmt(row.stderr))
    return t


@common.engine_options(before="json_out")
def eval_tasks(
    model: str = common.ModelOpt,
    tasks: str = typer.Option(..., "--tasks", "-t", help="Comma-separated lm-eval tasks, groups or tags "
                              "(their data from the local Hugging Face cache or --include-path)."),
    base_model: str = typer.Option(None, "--base-model", help="Also evaluate this model and report the "
                                   "difference per metric, with a verdict on whether it is inside the noise."),
    limit: float = typer.Option(None, "--limit", "-l", help="Documents per task: a count "
                                "(>= 1) or a fraction of the task (< 1), as lm-eval's --limit."),
    num_fewshot: int = typer.Option(None, "--num-fewshot", "-f", callback=in_range(0),
                                    help="Few-shot examples per prompt (default: each task's own)."),
    include_path: str = typer.Option(None, "--include-path", help="A folder (or file) of lm-eval task YAML "
                                     "files, as lm-eval's --include_path."),
    max_length: int = typer.Option(None, "--max-length", callback=in_range(1), help="Tokens of a scored "
                                   "window or a generation prompt (default: --max-model-len - 2)."),
    seed: int = typer.Option(0, "--seed", callback=in_range(0, 2**32 - 1), help="lm-eval's random, numpy, "
                             "torch and few-shot seeds."),
    json_out: bool = common.JsonOpt,
    out_file: str = typer.Option(None, "--output", "-o", help="Also write the JSON result to this file."),
    quiet: bool = common.QuietOpt,
    **engine,
) -> None:
    """Downstream accuracy with lm-evaluation-harness's own tasks, on the engine, against a base model."""
    # deferred: keep CLI start-up fast (and lm-eval is an optional extra)
    from llmopt.eval.tasks import check_tasks, parse_limit, parse_task_names, run_tasks, task_manager
    from llmopt.fsutil import check_output_file

    if out_file:   # refused before any evaluation
        check_output_file(out_file, [model, base_model, include_path])
    names, limit = parse_task_names(tasks), parse_limit(limit)
    manager = task_manager(include_path)   # bad tasks and missing data are refused before any model loads
    check_tasks(names, manager)
    stages = 2 if base_model else 1
    with output.progress("lm-eval", stages, enabled=not quiet) as advance:
        result = run_tasks(model, names, base_model=base_model, limit=limit, num_fewshot=num_fewshot,
                           include_path=include_path, max_length=max_length, seed=seed,
                           progress=advance, manager=manager, **common.engine_args_from_flags(engine))
    output.emit(result, as_json=json_out, table=lambda r: [task_table(r)], output=out_file)
