"""lm-evaluation-harness's own tasks on the llmopt engine (`llmopt.eval.harness`, lm-eval model
`llmopt`) against lm-eval's `hf` model on the same tiny checkpoint, sample by sample: a rolling-
perplexity task on WikiText-2 passages, a multiple-choice task and a generate-until task with a stop
string, all from local task files. The engine's batching and prefix caching do not change a number."""

from __future__ import annotations

import json
import os
import random
import textwrap

import pytest

pytest.importorskip("lm_eval")   # the `eval` extra; `make test` installs it

MAX_LENGTH = 96
TASKS = ["llmopt_rolling", "llmopt_mc", "llmopt_gen"]


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory(tokenizer=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory, shared_data):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    text = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    passages = [line.strip() for line in text.splitlines() if len(line.strip()) > 400][:4]
    with open(folder / "rolling.jsonl", "w") as f:
        for p in passages:
            f.write(json.dumps({"text": p[:1200]}) + "\n")
    rng = random.Random(0)
    words = "river hill city bridge music sound light water stone field cloud paper".split()
    with open(folder / "mc.jsonl", "w") as f:
        for _ in range(6):
            f.write(json.dumps({"question": " ".join(rng.sample(words, 5)),
                                "choices": [" ".join(rng.sample(words, rng.randint(1, 3))) for _ in range(4)],
                                "answer": rng.randrange(4)}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for p in passages:
            f.write(json.dumps({"prompt": p[:160], "answer": "x"}) + "\n")
    data = {name: folder / f"{name}.jsonl" for name in ("rolling", "mc", "gen")}
    (folder / "llmopt_rolling.yaml").write_text(textwrap.dedent(f"""\
        task: llmopt_rolling
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {data['rolling']}}}}}
        test_split: test
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
        """))
    (folder / "llmopt_mc.yaml").write_text(textwrap.dedent(f"""\
        task: llmopt_mc
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {data['mc']}}}}}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
        """))
    (folder / "llmopt_gen.yaml").write_text(textwrap.dedent(f"""\
        task: llmopt_gen
        dataset_path: json
        dataset_kwargs: {{data_files: {{test: {data['gen']}}}}}
        test_split: test
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{answer}}}}"
        generation_kwargs: {{until: ["."], max_gen_toks: 12, do_sample: false}}
        metric_list: [{{metric: exact_match}}]
        """))
    return folder


def _evaluate(model, model_args, tasks_folder):
    import lm_eval
    from lm_eval.tasks import TaskManager
    import llmopt.eval.harness  # noqa: F401  registers the `llmopt` model
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS,
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
