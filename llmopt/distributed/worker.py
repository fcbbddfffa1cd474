"""What every tensor-parallel rank runs: load its shard, build its ModelRunner, then (ranks > 0) run
each step rank 0 broadcasts until told to stop.

Ranks > 0 are either processes the engine spawned (`worker_main`) or, under torchrun, the
command's own processes (`run_torchrun_worker`). Rank 0 is the engine (llmopt/distributed/executor.py);
the scheduler, sampling and detokenizing happen there only.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from llmopt import defaults
from llmopt.distributed.parallel import TPGroup, destroy, init_group, rank_device, torchrun_env
from llmopt.distributed.plan import TPPlan, plan_for_config
from llmopt.worker.runner import ModelRunner
from llmopt.errors import UserInputError
from llmopt.models.config import ModelConfig
from llmopt.models.loader import load_model, resolve_checkpoint, resolve_device

log = logging.getLogger("llmopt.distributed")

ERROR_KEY = "llmopt/error/{}"     # a worker's last words (TCPStore key), read by rank 0's watchdog
JOINED_KEY = "llmopt/joined/{}"


@dataclass
class StepMessage:
    """Rank 0 -> the others, once per step (broadcast on the step group)."""
    kind: str                     # step | copy | ping | stats | stop
    out: object = None            # kind step: the SchedulerOutput (self-contained, no Request objects)
    pairs: list = field(default_factory=list)   # kind copy: (src, dst) blocks


@dataclass
class RankStats:
    rank: int
    pid: int
    threads: int
    param_bytes: int              # the rank's parameters and buffers (its shard)
    kv_cache_bytes: int
    rss_start_bytes: int          # resident memory before the shard was loaded
    rss_peak_bytes: int           # the process's peak resident memory so far (VmHWM)


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS: resident now; VmHWM: its peak in this process image,
    which getrusage's maxrss is not: that one survives exec from the parent); 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _rss_now() -> int:
    return _status_bytes("VmRSS")


def warm_up_meta() -> None:
    """Run the first meta-device ops (the model is built on the meta device): they initialize
    torch's meta kernels, ~150 MB resident once per process, so a resident-memory reading taken
    after this counts the weights rather than that one-time cost."""
    with torch.device("meta"):
        1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.int64).float() / 8))


def rank_stats(runner, rank: int, rss_start: int) -> RankStats:
    m = runner.model
    tensors = {t.data_ptr(): t.nbytes for t in [*m.parameters(), *m.buffers()] if not t.is_meta}
    return RankStats(rank, os.getpid(), torch.get_num_threads(), sum(tensors.values()),
                     runner.kv_cache_info().bytes_allocated, rss_start, _status_bytes("VmHWM"))


def load_rank(args, tp: TPGroup, progress=None):
    """(LoadedModel, ModelRunner, resident bytes before the weights): this rank's shard and runner,
    built as every other rank builds its own."""
    # deferred: start-up time; imported here, before the resident memory is read, so it is not counted
    from llmopt.layers import runtime  # noqa: F401
    warm_up_meta()
    rss_start = _rss_now()
    loaded = load_model(args.model, args.dtype, args.device, progress, tokenizer=tp.rank == 0,
                        quantization=args.quantization, lm_head_dtype=args.lm_head_dtype, tp=tp)
    tp.barrier()    # every rank has loaded (the long start-up timeout covers the slowest one)
    runner = ModelRunner(loaded, args.block_size, args.kv_cache_dtype, args.kv_cache_memory,
                         args.gpu_memory_utilization, args.max_num_batched_tokens, args.attention_backend,
                         args.enforce_eager, hybrid=args.hybrid_kv_cache)
    return loaded, runner, rss_start


def serve_steps(runner, tp: TPGroup, rss_start: int) -> None:
    """Ranks > 0: receive each step from rank 0 and run it, until `stop`. Rank 0 pings while idle,
    so a receive that times out (TP_TIMEOUT_S) means rank 0 is gone or hung: an error."""
    box: list = [None]
    while True:
        dist.broadcast_object_list(box, src=0, group=tp.group)
        msg: StepMessage = box[0]
        if msg.kind == "step":
            runner.execute_model(msg.out)
        elif msg.kind == "copy":
            runner.copy_blocks(msg.pairs)
        elif msg.kind == "stats":
            dist.gather_object(rank_stats(runner, tp.rank, rss_start), None, dst=0, group=tp.group)
        elif msg.kind == "stop":
            return


def _exit_with_parent(interval: float = 1.0) -> None:
    """A spawned worker leaves when the engine's process is gone (even killed with SIGKILL)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(interval)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, name="llmopt-tp-parent", daemon=True).start()


def worker_main(args, plan: TPPlan, rank: int, addr: str, port: int, threads: int, timeout_s: float) -> None:
    """The body of a worker process the engine spawned (torch.multiprocessing, spawn); `timeout_s`:
    the step group's timeout, rank 0's (TP_TIMEOUT_S when it started the worker)."""
    _exit_with_parent()
    torch.set_num_threads(threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s")
    from datetime import timedelta
    store = dist.TCPStore(addr, port, plan.world_size, is_master=False,
                          timeout=timedelta(seconds=defaults.TP_START_TIMEOUT_S))
    code = 0
    try:
        store.set(JOINED_KEY.format(rank), str(os.getpid()))
        tp = init_group(plan, rank, rank_device(resolve_device(args.device), rank), store=store, timeout_s=timeout_s)
        _, runner, rss_start = load_rank(args, tp)
        serve_steps(runner, tp, rss_start)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, then the process ends
        code = 1
        message = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        log.error("%s", message)
        try:
            store.set(ERROR_KEY.format(rank), message)
        except Exception:  # noqa: BLE001 - rank 0 may be gone already
            pass
    sys.stderr.flush()
    os._exit(code)   # no interpreter teardown racing gloo's threads


def check_torchrun_world(args, world_size: int) -> None:
    if args.tensor_parallel_size != world_size:
        raise UserInputError(f"--tensor-parallel-size {args.tensor_parallel_size} under torchrun with {world_size} "
                             "processes: give the same number (every process is one rank)")


def run_torchrun_worker(args) -> bool:
    """Under torchrun, on a rank other than 0: run this rank until rank 0 stops, return True; else
    (no torchrun, or rank 0) return False at once."""
    env = torchrun_env()
    if env is None or env.rank == 0:
        return False
    check_torchrun_world(args, env.world_size)
    cfg = ModelConfig.from_path(resolve_checkpoint(args.model))
    plan = plan_for_config(cfg, env.world_size)
    tp = init_group(plan, env.rank, rank_device(resolve_device(args.device), env.local_rank))
    try:
        _, runner, rss_start = load_rank(args, tp)
        serve_steps(runner, tp, rss_start)
    finally:
        destroy()
    return True
