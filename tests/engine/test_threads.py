"""The compute thread (engine/threads.py): engine steps run from a ComputeThread and from the main
thread, alternating, give exactly the outputs of the main thread alone (tokens and logprobs, float32
and int8 weights through the C++ decode step); a ComputeThread runs with the thread count it was
given; handing the compute over gives the caller's OpenMP team back (the process never holds two
teams), and so does closing the thread. The speed itself is in scripts/bench_serve_peers.py."""

import os
import threading
import time

import pytest
import torch

from engine_helpers import mixed_prompts, run_outputs
from llmopt.engine.args import EngineArgs
from llmopt.engine.engine import LLMEngine
from llmopt.core.sampling_params import SamplingParams
from llmopt.engine.threads import ComputeThread, openmp_runtime, release_openmp_pool
from llmopt.models.loader import load_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def _os_threads(expect: int | None = None) -> int:
    """The process's OS threads (waiting up to 2 s for `expect`: an exiting thread leaves late)."""
    for _ in range(200):
        n = len(os.listdir("/proc/self/task"))
        if expect is None or n == expect:
            return n
        time.sleep(0.01)
    return n


def _parallel_work() -> None:
    """Enough work that torch opens an OpenMP parallel region (a matmul past its grain size)."""
    a = torch.randn(256, 256)
    for _ in range(3):
        a = torch.tanh(a @ a / 16)


def _summary(outs):
    return [(o.outputs[0].token_ids, [(t.token_id, t.logprob, t.top) for t in o.outputs[0].logprobs])
            for o in outs]


@pytest.fixture(scope="module", params=["float32", "int8"])
def engine(request, tiny_llama):
    quant = None if request.param == "float32" else request.param
    loaded = load_model(str(tiny_llama), "float32", "cpu", tokenizer=False, quantization=quant)
    return LLMEngine(EngineArgs(model=str(tiny_llama), kv_cache_memory=1 << 22, detokenize=False,
                                quantization=quant), loaded=loaded)


def test_steps_alternating_between_threads_match_the_main_thread(engine):
    prompts = mixed_prompts(6, 96, lo=3, hi=40, seed=1)
    reference = _summary(run_outputs(engine, prompts, PARAMS))
    compute = ComputeThread(name="test-compute")
    try:
        for _ in range(2):   # compute thread, main thread, compute thread, main thread
            assert _summary(compute.run(run_outputs, engine, prompts, PARAMS)) == reference
            release_openmp_pool()   # (ComputeThread hands over once; later hand-overs are explicit)
            assert _summary(run_outputs(engine, prompts, PARAMS)) == reference
            compute.run(release_openmp_pool)
        # the steps of one batch split between the two threads, one step at a time
        ids = [engine.add_request(f"x{i}", p, PARAMS) for i, p in enumerate(prompts)]
        done, k = {}, 0
        while engine.has_unfinished_requests():
            outs = compute.run(engine.step) if k % 2 == 0 else engine.step()
            done.update({o.request_id: o for o in outs if o.finished})
            k += 1
        assert _summary([done[i] for i in ids]) == reference
    finally:
        compute.close()


def test_compute_thread_applies_its_thread_count():
    main = torch.get_num_threads()
    for n in (1, 2):
        compute = ComputeThread(name=f"test-threads-{n}", num_threads=n, release_caller=False)
        try:
            assert compute.settings.num_threads == n and compute.settings.thread_name == f"test-threads-{n}"
            assert compute.run(torch.get_num_threads) == n            # what its ops run with
            assert compute.run(lambda: threading.current_thread().name) == f"test-threads-{n}"
            assert compute.run(lambda: threading.current_thread().name) == f"test-threads-{n}"   # the same thread
        finally:
            compute.close()
        assert not compute.alive
    assert torch.get_num_threads() == main   # the caller's own count is left alone
    compute = ComputeThread(name="test-default", release_caller=False)
    try:
        assert compute.settings.num_threads == main   # by default: the caller's count
        with pytest.raises(ZeroDivisionError):        # an exception reaches the caller
            compute.run(lambda: 1 / 0)
        assert compute.run(lambda: 5) == 5            # and the thread goes on
    finally:
        compute.close()
    with pytest.raises(RuntimeError, match="stopped"):
        compute.run(lambda: 1)


def test_handing_over_keeps_one_openmp_team():
    """Two threads each with a team of 3 extra OpenMP threads would show as 3 more OS threads."""
    assert openmp_runtime() is not None and openmp_runtime().startswith("libgomp"), openmp_runtime()
    main = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        _parallel_work()
        with_team = _os_threads()
        assert release_openmp_pool()
        without = _os_threads()
        assert with_team - without == 3            # the main thread's team of 3 workers is gone
        _parallel_work()                           # ... and comes back when needed
        assert _os_threads() == with_team
        compute = ComputeThread(name="test-handover", num_threads=4)   # releases the main thread's team
        try:
            compute.run(_parallel_work)
            assert _os_threads() == with_team + 1  # its own thread and its team of 3: one team in all
        finally:
            compute.close()
        assert _os_threads(without) == without     # closing gives its team back too
    finally:
        torch.set_num_threads(main)
