"""The engine on SmolLM2-135M (the default model) against transformers' greedy generate, one prompt
at a time, with EOS stops; detokenized text, stop strings and the chat template; and
`llmopt generate` end to end on a tiny random model that borrows SmolLM2's tokenizer."""

import json

import pytest
import torch
from typer.testing import CliRunner

from engine_helpers import hf_greedy
from llmopt.cli.app import app
from llmopt.engine.llm import LLM
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a land far away, there lived a young girl who loved to read books about "
           "dragons, knights and faraway kingdoms. One day she found",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def smol():
    loaded = load_model(None, "float32", "cpu")
    llm = LLM(loaded=loaded, kv_cache_memory=64 << 20, max_model_len=1024, block_size=16)
    # float activations: transformers and the Python layers multiply float x (the int8 default's
    # cost is measured in tests/models/test_gguf_weights.py's perplexity test; with it the chat
    # question below is answered "L'Étoile, la Marseillaise...", as llama.cpp answers on this file)
    llm.engine.runner.cpu_decode.set_int8_activations(False)
    return loaded, llm


def test_greedy_matches_transformers_on_smollm2(smol, smollm2_float):
    loaded, llm = smol
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(smollm2_float, dtype=torch.float32).eval()
    ids = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    ref = hf_greedy(hf, ids, 8, stop_at_eos=True)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8))
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o in outs:
        c = o.outputs[0]
        assert c.text == loaded.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.pool.num_blocks


def test_compiled_cpp_and_python_decode_steps_agree_on_smollm2(smol, tmp_path, monkeypatch):
    """Issue #14: the compiled step (--no-enforce-eager), the C++ decode layers (the CPU default) and
    the Python layers give the same greedy tokens on the default model (short outputs)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))   # a cold compile, not the user's cache
    loaded, llm = smol
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runner = llm.engine.runner
    assert runner.cpu_decode is not None and runner.compiled is None
    cpp = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    runner.cpu_decode, keep = None, runner.cpu_decode
    try:
        python = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], params)]
    finally:
        runner.cpu_decode = keep
    comp = LLM(loaded=loaded, kv_cache_memory=64 << 20, max_model_len=1024, block_size=16, enforce_eager=False)
    assert comp.engine.runner.compiled is not None
    compiled = [o.outputs[0].token_ids for o in comp.generate(PROMPTS[:2], params)]
    assert comp.engine.runner.compiled.compiled      # its decode steps ran the graphs
    assert cpp == python == compiled


def test_stop_string_and_chat(smol):
    loaded, llm = smol
    full = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    words = full.text.split()
    stop = words[len(words) // 2]
    cut = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    answer = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0.0, max_tokens=40))[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_factory):
    return tiny_factory(tokenizer=True)


def test_generate_cli_json_lines_and_stdin(tiny_with_tokenizer):
    runner = CliRunner()
    base = ["generate", "--model", str(tiny_with_tokenizer), "--max-tokens", "5", "--ignore-eos", "--quiet",
            "--kv-cache-memory", "4M", "--max-model-len", "256", "--block-size", "4"]
    r = runner.invoke(app, base + ["--json", "Hello there", "How are you?"])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["prompt"] for row in rows] == ["Hello there", "How are you?"]
    assert all(row["num_output_tokens"] == 5 and row["finish_reason"] == "length" for row in rows)
    llm = LLM(str(tiny_with_tokenizer), kv_cache_memory=4 << 20, max_model_len=256)
    want = llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert rows[0]["token_ids"] == want.outputs[0].token_ids
    r = runner.invoke(app, base + ["--no-enable-prefix-caching"], input="Hello there\n\nHow are you?\n")
    assert r.exit_code == 0, r.output
    from llmopt.cli.generate import SEPARATOR
    assert r.stdout == f"\n{SEPARATOR}\n".join(row["text"] for row in rows) + "\n"   # a separator between completions
    r = runner.invoke(app, base + ["--kv-cache-memory", "lots", "x"])
    assert r.exit_code == 2 and "--kv-cache-memory 'lots'" in r.output and len(r.output.strip().splitlines()) == 1


def test_generate_speed_line_arithmetic():
    """`llmopt generate`'s stderr line: output tokens over the wall time, and tokens after each
    request's first over the time since the earliest first token."""
    from types import SimpleNamespace as NS
    from llmopt.cli.generate import speed_line
    from llmopt.core.outputs import RequestMetrics
    a = RequestMetrics(arrival_time=10.0, first_token_time=11.0, finished_time=13.0, token_times=[11.0, 12.0, 13.0])
    b = RequestMetrics(arrival_time=10.0, first_token_time=11.5, finished_time=12.5, token_times=[11.5, 12.5])
    res = [NS(metrics=a, outputs=[NS(token_ids=[1, 2, 3])]), NS(metrics=b, outputs=[NS(token_ids=[4, 5])])]
    assert speed_line(res) == "5 output tokens in 3.00 s (1.7 tok/s); decode 1.5 tok/s after the first token at 1.00 s"
    assert speed_line([NS(metrics=None, outputs=[])]) is None


@pytest.mark.parametrize("kv", ["bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi2"])
def test_every_kv_cache_dtype_generates_on_smollm2(smol, kv):
    """The default model generates through each cache (a 300-token prompt, so kivi2 holds quantized
    groups): 16-bit caches give float32's greedy tokens; every cache scores float32's continuation,
    teacher-forced through its own cache, within 0.15 nats a token of float32's."""
    loaded, llm = smol
    text = " ".join(["The history of the city goes back to a small fishing village by the river."] * 18)
    ids = loaded.tokenizer(text).input_ids[:300]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = llm.generate([ids], greedy)[0].outputs[0].token_ids
    other = LLM(loaded=loaded, kv_cache_memory=64 << 20, max_model_len=1024, kv_cache_dtype=kv)
    got = other.generate([ids], greedy)[0].outputs[0].token_ids
    if kv in ("bfloat16", "float16"):
        assert got == want
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    full = ids + want

    def mean_lp(engine_llm):
        lps = engine_llm.generate([full], score)[0].prompt_logprobs
        return sum(t.logprob for t in lps[len(ids):]) / len(want)   # the prompt's own tokens' logprobs

    assert abs(mean_lp(other) - mean_lp(llm)) < 0.15     # measured: int4 0.04, kivi2 0.03
    assert other.engine.kv.num_free_blocks == other.engine.kv.pool.num_blocks
