"""quantize's library side: recipe + flags merged by llmopt.quant.config.merge_sources, --eval by
llmopt.quant.evaluate; and the command wired over them."""

import json

import pytest
from typer.testing import CliRunner

from conftest import SHARED_DATA, make_tiny
from llmopt import defaults
from llmopt.cli.app import app
from llmopt.errors import UserInputError
from llmopt.quant.config import QuantJob, QuantConfig, merge_sources

WIKI_TEST = SHARED_DATA / "wikitext-2-raw" / "wiki.test.raw"


def _recipe(tmp_path, text: str):
    p = tmp_path / "recipe.yaml"
    p.write_text(text)
    return p


def test_flags_override_recipe_which_overrides_defaults(tmp_path):
    r = _recipe(tmp_path, "quant_method: gptq\ngroup-size: 64\nseq_len: 256\nmodel: some/model\noutput: out/a\n"
                          "act-order: group\n")
    job = merge_sources(r, {"group_size": 32, "output": "out/b", "method": None, "bits": None, "sym": False})
    assert isinstance(job, QuantJob) and isinstance(job.qconfig, QuantConfig)
    assert (job.model, job.output) == ("some/model", "out/b")
    s = job.qconfig
    assert (s.method, s.group_size, s.seq_len, s.act_order, s.sym) == ("gptq", 32, 256, "group", False)
    assert (s.bits, s.num_samples, s.calib_data) == (None, defaults.QUANT_NUM_SAMPLES, defaults.CALIB_DATA)
    job = merge_sources(r, {"model": "other/model"})
    assert (job.model, job.output, job.qconfig.group_size) == ("other/model", "out/a", 64)
    job = merge_sources(None, {"output": "out/c", "method": "rtn"})
    assert (job.model, job.qconfig.method, job.qconfig.group_size) == (None, "rtn", None)   # auto: from the model


@pytest.mark.parametrize("text,flags,fragment", [
    ("method: rtn\ngrup-size: 64\noutput: o\n", {}, "unknown key 'grup-size'"),
    ("group-size: sixty-four\noutput: o\n", {}, "group-size must be int, got 'sixty-four'"),
    ("sym: 1\noutput: o\n", {}, "sym must be bool, got 1"),
    ("- method: rtn\n", {}, "must be a mapping"),
    ("method: rtn\n", {}, "--output is required"),
    ("method: rtn\noutput: o\n", {"groupsize": 64}, "unknown quantize setting 'groupsize'"),
])
def test_bad_recipes_are_refused_with_a_clear_message(tmp_path, text, flags, fragment):
    with pytest.raises(UserInputError) as e:
        merge_sources(_recipe(tmp_path, text), flags)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_missing_recipe_is_bad_input(tmp_path):
    with pytest.raises(UserInputError, match="not found"):
        merge_sources(tmp_path / "nope.yaml", {"output": "o"})


def test_cli_unknown_recipe_key_is_one_red_line(tmp_path):
    r = _recipe(tmp_path, "method: rtn\ngrup-size: 64\n")
    res = CliRunner().invoke(app, ["quantize", "--recipe", str(r), "--output", str(tmp_path / "o"), "--quiet"])
    assert res.exit_code == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown key 'grup-size'" in lines[0]
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory, shared_data):
    """A 2-layer random Llama with the default model's tokenizer, and a calibration text (the eval
    reads WIKI_TEST: `shared_data` fails, not skips, when ../shared/data is missing)."""
    folder = make_tiny(tmp_path_factory.mktemp("tiny") / "model", tokenizer=True, weight_std=0.05,
                       max_position_embeddings=2048)
    calib = folder.parent / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 60)
    return folder, calib


def test_evaluate_a_checkpoint_against_itself(tiny_tok):
    from llmopt.quant.evaluate import QuantEval, evaluate_quantized
    folder, _ = tiny_tok
    ticks = []
    ev = evaluate_quantized(str(folder), str(folder), limit=2048, progress=ticks.append)
    assert isinstance(ev, QuantEval) and sum(ticks) == 1
    assert ev.perplexity_before == pytest.approx(ev.perplexity_after, rel=1e-6) and ev.perplexity_before > 1
    assert abs(ev.kld_mean) < 1e-6 and ev.top1_agreement == 1.0 and ev.scored_tokens == 2047


def test_cli_quantize_eval_reports_snake_case_keys(tiny_tok, tmp_path):
    folder, calib = tiny_tok
    recipe = _recipe(tmp_path, f"method: rtn\ngroup-size: 64\ncalib-data: {calib}\nseq-len: 64\nnum-samples: 2\n")
    res = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--recipe", str(recipe), "--group-size", "32",
                                   "--output", str(tmp_path / "q"), "--eval", "--eval-limit", "2048",
                                   "--json", "--quiet"])
    assert res.exit_code == 0, res.output
    d = json.loads(res.stdout.strip().splitlines()[-1])
    assert (d["method"], d["group_size"]) == ("rtn", 32)
    ev = d["eval"]
    assert set(ev) >= {"perplexity_before", "perplexity_after", "kld_mean", "top1_agreement", "scored_tokens"}
    assert ev["scored_tokens"] == 2047 and ev["perplexity_before"] > 1 and ev["perplexity_after"] > 1
    assert ev["perplexity_after"] != ev["perplexity_before"] and ev["kld_mean"] > 0
    assert 0 <= ev["top1_agreement"] < 1
    res = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--recipe", str(recipe),
                                   "--output", str(tmp_path / "q2"), "--json"], env={"COLUMNS": "120"})
    assert res.exit_code == 0 and json.loads(res.stdout.strip().splitlines()[-1])["eval"] is None
    assert "quantize rtn" in res.stderr and "2/2" in res.stderr     # the bar, sized by the pipeline
