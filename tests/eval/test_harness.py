"""lm-evaluation-harness's own tasks on the llmopt engine (`llmopt.eval.harness`, lm-eval model
`llmopt`) against lm-eval's `hf` model on the same tiny checkpoint, sample by sample: a rolling-
perplexity task on WikiText-2 passages, a multiple-choice task and a generate-until task with a stop
string, all from local task files. The engine's batching and prefix caching do not change a number."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

pytest.importorskip("lm_eval")   # the `eval` extra; `make test` installs it

MAX_LENGTH = 96
TASKS = ["llmopt_rolling", "llmopt_mc", "llmopt_gen"]


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(tokenizer=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tasks(lm_eval_tasks):
    return lm_eval_tasks


def _evaluate(model, model_args, tasks_folder, names=TASKS):
    import lm_eval
    from lm_eval.tasks import TaskManager
    import llmopt.eval.harness  # noqa: F401  registers the `llmopt` model
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names,
                                   task_manager=TaskManager(include_path=str(tasks_folder)), log_samples=True,
                                   batch_size=2, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _responses(result, task):
    return [s["resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def _flat(resps):
    out = []
    for doc in resps:
        for r in doc:
            r = r[0] if isinstance(r, (list, tuple)) and len(r) == 1 else r
            out.append(r)
    return out


@pytest.fixture(scope="module")
def hf_result(tiny, tasks):
    return _evaluate("hf", {"pretrained": str(tiny), "dtype": "float32", "max_length": MAX_LENGTH,
                            "device": "cpu"}, tasks)


@pytest.mark.parametrize("engine", [{}, {"enable_prefix_caching": False, "max_num_seqs": 1}],
                         ids=["batched-prefix-cache", "one-at-a-time-no-cache"])
def test_llmopt_model_matches_lm_evals_hf_model(tiny, tasks, hf_result, engine):
    ours = _evaluate("llmopt", {"model": str(tiny), "dtype": "float32", "max_length": MAX_LENGTH, **engine}, tasks)
    for task in ("llmopt_rolling", "llmopt_mc"):
        got, want = _flat(_responses(ours, task)), _flat(_responses(hf_result, task))
        assert len(got) == len(want) == {"llmopt_rolling": 4, "llmopt_mc": 24}[task]
        lp = [float(g[0]) if isinstance(g, (list, tuple)) else float(g) for g in got]
        lp_want = [float(w[0]) if isinstance(w, (list, tuple)) else float(w) for w in want]
        assert lp == pytest.approx(lp_want, rel=1e-4, abs=1e-4), task
        if task == "llmopt_mc":
            assert [bool(g[1]) for g in got] == [bool(w[1]) for w in want]
    gen, gen_want = _flat(_responses(ours, "llmopt_gen")), _flat(_responses(hf_result, "llmopt_gen"))
    assert len(gen) == 4 and gen == gen_want
    assert any(g.strip() for g in gen)
    r, w = ours["results"], hf_result["results"]
    assert r["llmopt_rolling"]["word_perplexity,none"] == pytest.approx(w["llmopt_rolling"]["word_perplexity,none"],
                                                                        rel=1e-4)
    assert r["llmopt_mc"]["acc,none"] == w["llmopt_mc"]["acc,none"]
    assert r["llmopt_mc"]["acc_norm,none"] == w["llmopt_mc"]["acc_norm,none"]


def test_generation_kwarg_the_engine_does_not_honour_is_refused(tiny):
    from llmopt.errors import UserInputError
    from llmopt.eval.harness import LLMoptLM
    lm = LLMoptLM(model=str(tiny), dtype="float32", max_length=MAX_LENGTH)

    class Req:
        args = ("Hello", {"until": ["."], "do_sample": False, "num_beams": 4})

    with pytest.raises(UserInputError, match="num_beams"):
        lm.generate_until([Req()])
    with pytest.raises(UserInputError, match="max_length"):
        LLMoptLM(llm=lm.llm, max_length=10**6)


def _cli(args):
    from typer.testing import CliRunner
    from llmopt.cli.app import app
    return CliRunner().invoke(app, args)


def test_llmopt_eval_command_against_a_base_model(tiny, tiny_factory, tasks, hf_result, tmp_path):
    base = tiny_factory(tokenizer=True, max_position_embeddings=512, seed=1)
    out = tmp_path / "eval.json"
    res = _cli(["eval", "-m", str(tiny), "--base-model", str(base), "--tasks", "llmopt_mc,llmopt_rolling",
                "--include-path", str(tasks), "--dtype", "float32", "--max-length", str(MAX_LENGTH), "--json",
                "--output", str(out), "-q"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout)
    assert json.loads(out.read_text()) == got
    rows = {(r["task"], r["metric"]): r for r in got["rows"]}
    want = hf_result["results"]
    for task, metric in [("llmopt_mc", "acc"), ("llmopt_mc", "acc_norm"), ("llmopt_rolling", "word_perplexity")]:
        r = rows[(task, metric)]
        assert r["value"] == pytest.approx(want[task][f"{metric},none"], rel=1e-4)
        assert r["difference"] == pytest.approx(r["value"] - r["base_value"])
        if r["stderr"] is not None:
            band = 1.96 * (r["stderr"] ** 2 + r["base_stderr"] ** 2) ** 0.5
            assert r["within_noise"] == (abs(r["difference"]) <= band)
    assert rows[("llmopt_mc", "acc")]["stderr"] == pytest.approx(want["llmopt_mc"]["acc_stderr,none"])
    assert got["lm_eval"]["results"]["llmopt_mc"]["acc,none"] == rows[("llmopt_mc", "acc")]["value"]
    assert got["base_lm_eval"]["n-samples"]["llmopt_mc"]["effective"] == 6


def test_llmopt_eval_bad_input_is_one_line_and_exit_2(tiny, tasks, tmp_path, monkeypatch):
    res = _cli(["eval", "-m", str(tiny), "--tasks", "no_such_task_x", "--include-path", str(tasks)])
    assert res.exit_code == 2 and "no_such_task_x" in res.output and "--include-path" in res.output
    assert len(res.output.strip().splitlines()) == 1
    (tmp_path / "broken.yaml").write_text(textwrap.dedent(f"""\
        task: llmopt_broken
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {tmp_path / 'missing.jsonl'}}}}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{q}}}}"
        doc_to_choice: "{{{{c}}}}"
        doc_to_target: 0
        """))
    res = _cli(["eval", "-m", str(tiny), "--tasks", "llmopt_broken", "--include-path", str(tmp_path)])
    assert res.exit_code == 2 and "llmopt_broken" in res.output and "offline" in res.output, res.output
    res = _cli(["eval", "-m", str(tiny), "--tasks", "llmopt_mc", "--include-path", str(tasks), "--limit", "2.5"])
    assert res.exit_code == 2 and "--limit" in res.output
    import sys
    from llmopt.eval import tasks as eval_tasks
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(Exception, match=r"pip install 'llmopt\[eval\]'"):
        eval_tasks.run_tasks(str(tiny), ["llmopt_mc"])


def test_quantize_eval_tasks_compares_the_output_with_its_source(tiny, tasks, hf_result, tmp_path):
    """`quantize --eval-tasks`: the source's row is lm-eval's hf model on the source, the output's row
    lm-eval's hf model on the written (dequantized-format) checkpoint."""
    out = tmp_path / "rtn"
    res = _cli(["quantize", "-m", str(tiny), "--method", "rtn", "--group-size", "16", "--format", "dequantized",
                "--num-samples", "2", "--seq-len", "16", "-o", str(out), "--eval-tasks", "llmopt_mc",
                "--eval-include-path", str(tasks), "--json", "-q"])
    assert res.exit_code == 0, res.output
    got = {r["metric"]: r for r in json.loads(res.stdout)["task_eval"]["rows"] if r["task"] == "llmopt_mc"}
    want = _evaluate("hf", {"pretrained": str(out), "dtype": "float32", "max_length": MAX_LENGTH, "device": "cpu"},
                     tasks)["results"]
    for metric in ("acc", "acc_norm"):
        assert got[metric]["base_value"] == pytest.approx(hf_result["results"]["llmopt_mc"][f"{metric},none"])
        assert got[metric]["value"] == pytest.approx(want["llmopt_mc"][f"{metric},none"])
    for args, message in [(["--eval-tasks", "nope_task"], "nope_task"),
                          (["--eval-tasks", "llmopt_mc", "--eval-task-limit", "1.5"], "--eval-task-limit 1.5"),
                          (["--eval-task-limit", "3"], "go with --eval-tasks")]:
        include = ["--eval-include-path", str(tasks)] if "--eval-tasks" in args else []
        res = _cli(["quantize", "-m", str(tiny), "--method", "rtn", "-o", str(tmp_path / "x"), *args, *include])
        assert res.exit_code == 2 and message in res.output, res.output
        assert not (tmp_path / "x").exists()                 # refused before quantizing


def test_default_model_generates_what_lm_evals_hf_model_generates(tasks, smollm2_float):
    """generate_until on the real default model (its GGUF as stored; greedy, stop string "."): the
    same text per prompt as lm-eval's `hf` model on the file's float copy."""
    ours = _evaluate("llmopt", {"model": "smollm2-135m", "dtype": "float32"}, tasks, ["llmopt_gen"])
    hf = _evaluate("hf", {"pretrained": str(smollm2_float), "dtype": "float32", "device": "cpu"}, tasks,
                   ["llmopt_gen"])
    got, want = _responses(ours, "llmopt_gen"), _responses(hf, "llmopt_gen")
    assert len(got) == 4 and any(r[0][0].strip() for r in want)   # something was generated
    assert got == want
