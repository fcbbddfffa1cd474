"""The compiled decode step (llmopt/worker/compiled.py) on a tiny model: the same greedy tokens and
logits as the eager step, no recompile once a bucket has compiled, and a second process that reuses
inductor's cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from engine_helpers import mixed_prompts, run_engine

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="inductor's C++ backend: g++ on Linux")


@pytest.fixture(scope="module")
def inductor_dir(tmp_path_factory):
    """A fresh inductor cache for this module (the process keeps it after the module: harmless)."""
    path = tmp_path_factory.mktemp("inductor")
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = old


def _engine(path, eager: bool, quantization=None, lm_head_dtype="auto", **kw):
    from llmopt.engine.args import EngineArgs
    from llmopt.engine.engine import LLMEngine
    from llmopt.models.loader import load_model
    args = EngineArgs(model=str(path), dtype="float32", device="cpu", detokenize=False, enforce_eager=eager,
                      kv_cache_memory=1 << 22, **kw)
    return LLMEngine(args, loaded=load_model(str(path), "float32", "cpu", tokenizer=False,
                                             quantization=quantization, lm_head_dtype=lm_head_dtype))


def _stats() -> dict:
    from torch._dynamo.utils import counters
    return {"graphs": counters["stats"]["unique_graphs"], "frames": sum(counters["frames"].values())}


def test_compiled_matches_eager_and_never_recompiles_inside_buckets(tiny_llama, inductor_dir):
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.core.scheduler import ScheduledRequest, SchedulerOutput
    eager = _engine(tiny_llama, True, max_num_seqs=6)
    comp = _engine(tiny_llama, False, max_num_seqs=6)
    assert eager.runner.compiled is None and comp.runner.compiled is not None
    # mixed lengths: the running batch shrinks 6 -> 1 through buckets 8, 4, 2, 1
    prompts = mixed_prompts(6, 96, lo=3, hi=20, seed=1)
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(6)]

    def run(engine):
        ids = [engine.add_request(f"r{i}", p, params[i]) for i, p in enumerate(prompts)]
        done = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        return [done[i] for i in ids]

    ref = run(eager)
    assert run(comp) == ref
    used = comp.runner.compiled.compiled
    assert used == {1, 2, 4, 8}
    before = _stats()
    assert run(comp) == ref                      # the same mix again: every bucket's graph reused
    assert _stats() == before
    assert run_engine(comp, prompts[:3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)) == \
        run_engine(eager, prompts[:3], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert _stats() == before                    # other batch sizes inside the buckets: no recompile

    # logits of one decode step of 3 sequences (bucket 4, one padding row), compiled vs eager
    r = comp.runner
    blocks = [[1, 2], [3], [4, 5]]
    lens = [20, 7, 17]
    torch.manual_seed(0)
    prefill = SchedulerOutput([ScheduledRequest(f"q{i}", torch.randint(0, 96, (n,)).tolist(), 0, b, 0)
                               for i, (b, n) in enumerate(zip(blocks, lens))])
    r.execute(prefill)
    step = SchedulerOutput([ScheduledRequest(f"q{i}", [7 + i], n, b, 1) for i, (b, n) in enumerate(zip(blocks, lens))])
    got = r.execute(step)
    r.compiled, keep = None, r.compiled
    try:
        want = r.execute(step)                   # writes the same K/V into the same slots
    finally:
        r.compiled = keep
    assert got.shape == want.shape == (3, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compiled_matches_eager_with_int8_weights(tiny_llama, inductor_dir):
    """--quantization int8: the graph calls the llmopt_cpu kernels (and the int8 head) as eager does."""
    from llmopt.core.sampling_params import SamplingParams
    prompts = mixed_prompts(3, 96, lo=3, hi=12, seed=2)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eager = _engine(tiny_llama, True, quantization="int8", lm_head_dtype="int8")
    comp = _engine(tiny_llama, False, quantization="int8", lm_head_dtype="int8")
    assert type(comp.loaded.model.lm_head).__name__ == "Int8Head"
    assert run_engine(comp, prompts, params) == run_engine(eager, prompts, params)
    assert comp.runner.compiled.compiled      # decode steps ran the graphs


_CHILD = r"""
import json, sys
from torch._dynamo.utils import counters
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.models.loader import load_model
args = EngineArgs(model=sys.argv[1], dtype="float32", device="cpu", detokenize=False, enforce_eager=False,
                  kv_cache_memory=1 << 22)
e = LLMEngine(args, loaded=load_model(sys.argv[1], "float32", "cpu", tokenizer=False))
e.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
tokens = []
while e.has_unfinished_requests():
    for o in e.step():
        tokens = o.outputs[0].token_ids
print(json.dumps({"tokens": tokens, "hit": counters["inductor"]["fxgraph_cache_hit"],
                  "miss": counters["inductor"]["fxgraph_cache_miss"], "buckets": sorted(e.runner.compiled.compiled)}))
"""


def test_second_process_reuses_the_inductor_cache(tiny_llama, inductor_dir):
    from llmopt.core.sampling_params import SamplingParams
    # this process compiles bucket 1 into inductor_dir (a no-op if the test above already did)
    comp = _engine(tiny_llama, False)
    want = run_engine(comp, [[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    files = {p for p in inductor_dir.rglob("*") if p.is_file()}
    assert any(p.parent.name != "locks" for p in files) and 1 in comp.runner.compiled.compiled
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tiny_llama)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    child = json.loads(out.stdout.strip().splitlines()[-1])
    assert child["tokens"] == want and child["buckets"] == [1]
    assert child["hit"] >= 2 and child["miss"] == 0    # the layer graph and the head graph, both from the cache


def test_inductor_cache_goes_to_llmopt_cache_unless_the_user_sets_one(monkeypatch, tmp_path):
    """Importing inductor writes its /tmp default into the environment; that is not a user's choice."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from llmopt import defaults
    from llmopt.worker.compiled import use_cache_dir
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    cache_dir()                                   # inductor's own lookup: sets its default
    assert use_cache_dir() == str(tmp_path / "inductor") == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_cache_dir() == str(tmp_path / "mine")
