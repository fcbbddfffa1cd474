"""Rank 0 of a tensor-parallel engine: `TPExecutor` is the engine's executor (llmopt/engine/executor.py:
`Executor`: execute_model, copy_blocks, kv_cache_info, check_health, shutdown) and drives the other ranks.

    executor = TPExecutor(args)                 # spawns ranks 1..N-1 (or joins a torchrun world), loads rank 0's shard
    out = executor.execute_model(sched)         # broadcasts the step, runs rank 0's part; logits are all-gathered

Start-up: the size is checked (`plan_for_config`) before anything starts; the workers join a
TCPStore on a free local port (rank 0 polls for them and notices one that exits), then the
process group. Each step is broadcast on the step group (TP_TIMEOUT_S); while idle, rank 0 pings the
workers every TP_HEARTBEAT_S so that their wait for the next step can time out when rank 0 is gone.
A watchdog thread polls the worker processes every TP_WATCHDOG_S: a worker that exits makes the
executor dead, and every later call raises EngineDeadError naming the rank, its pid and exit code
(the server's /health turns 503). Workers end with `shutdown()` (also at exit) or when this process
goes away.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

from llmopt import defaults
from llmopt.distributed import parallel
from llmopt.distributed.plan import TPPlan, plan_for_config
from llmopt.distributed.worker import (ERROR_KEY, JOINED_KEY, RankStats, StepMessage, check_torchrun_world, load_rank,
                                       rank_stats, run_torchrun_worker, worker_main)
from llmopt.worker.executor import EngineDeadError
from llmopt.worker.runner import ModelRunnerOutput
from llmopt.errors import LLMOptError, UserInputError
from llmopt.models.config import ModelConfig
from llmopt.models.loader import resolve_checkpoint, resolve_device

log = logging.getLogger("llmopt.engine")

SPEC_METHODS_TP = ("ngram",)   # drafters that need no model state on rank 0 alone


def check_tensor_parallel(args, cfg) -> TPPlan:
    """Refuse what tensor parallelism cannot run, before any process starts."""
    plan = plan_for_config(cfg, args.tensor_parallel_size)
    spec = args.speculative_config
    if spec is not None and spec.method not in SPEC_METHODS_TP:
        raise UserInputError(f"--speculative-config method {spec.method} does not run with --tensor-parallel-size "
                             f"{plan.world_size} (its drafter reads the target's weights or hidden states whole): use "
                             "method ngram, or --tensor-parallel-size 1")
    return plan


class TPExecutor:
    def __init__(self, args, progress=None) -> None:
        cfg = ModelConfig.from_path(resolve_checkpoint(args.model, progress))
        self.plan = plan = check_tensor_parallel(args, cfg)
        self.workers: list = []           # spawned worker processes, rank 1..N-1 (none under torchrun)
        self.dead: str | None = None    # why nothing can run any more (a worker exited, a step failed, shut down)
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._last_send = time.monotonic()
        self._store = None
        self._threads = torch.get_num_threads()
        env = parallel.torchrun_env()
        device = resolve_device(args.device)
        try:
            if env is not None:
                check_torchrun_world(args, env.world_size)
                self.tp = parallel.init_group(plan, 0, parallel.rank_device(device, env.local_rank))
            else:
                self.tp = self._spawn(args, plan, parallel.rank_device(device, 0))
            self.loaded, self.runner, self._rss_start = load_rank(args, self.tp, progress)
        except BaseException as e:
            # a collective that failed: a worker went away (its exit code and error say why)
            failure = None if isinstance(e, (LLMOptError, KeyboardInterrupt)) else self._worker_failure(wait=3.0)
            self._teardown()
            if failure is not None:
                raise LLMOptError(f"{failure} while the model loaded") from e
            raise
        self._watchdog = threading.Thread(target=self._watch, name="llmopt-tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(_shutdown_at_exit, weakref.ref(self))
        log.info("tensor parallel: %d ranks (%d heads, %d KV heads%s, MLP width %d and %d vocabulary rows per "
                 "rank), %s, %d thread(s) per rank", plan.world_size, plan.heads_per_rank, plan.kv_heads_per_rank,
                 " replicated" if plan.kv_replicated else "", plan.intermediate_per_rank, plan.vocab_per_rank,
                 parallel.backend_for(device), torch.get_num_threads())

    # -- start-up --------------------------------------------------------------------------------
    def _spawn(self, args, plan: TPPlan, device: torch.device):
        from llmopt.ports import free_port   # deferred: start-up time (socket only when ranks start)
        n = plan.world_size
        threads = parallel.threads_per_rank(n) if device.type == "cpu" else 1
        torch.set_num_threads(threads)
        addr, port = "127.0.0.1", free_port()
        self._store = dist.TCPStore(addr, port, n, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=defaults.TP_START_TIMEOUT_S))
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, n):
            p = ctx.Process(target=worker_main, daemon=True, name=f"llmopt-tp-rank{rank}",
                            args=(args, plan, rank, addr, port, threads, defaults.TP_TIMEOUT_S))
            p.start()
            self.workers.append(p)
        deadline = time.monotonic() + defaults.TP_START_TIMEOUT_S
        for rank in range(1, n):   # joined, or exited: never wait on a worker that is gone
            while not self._store.check([JOINED_KEY.format(rank)]):
                if (failure := self._worker_failure()) is not None:
                    raise LLMOptError(f"{failure} while starting")
                if time.monotonic() > deadline:
                    raise LLMOptError(f"tensor-parallel worker rank {rank} did not start within "
                                      f"{defaults.TP_START_TIMEOUT_S:.0f} s")
                time.sleep(0.05)
        return parallel.init_group(plan, 0, device, store=self._store)

    def _worker_failure(self, wait: float = 0.0) -> str | None:
        """'tensor-parallel worker rank R (pid P) exited with code C[: its error]' for the first
        worker that has exited, waiting up to `wait` seconds for one to; None if all run."""
        deadline = time.monotonic() + wait
        while True:
            for rank, p in enumerate(self.workers, start=1):
                if p.exitcode is not None:
                    why = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    key = ERROR_KEY.format(rank)
                    try:
                        if self._store is not None and self._store.check([key]):
                            why += ": " + self._store.get(key).decode(errors="replace")
                    except Exception:  # noqa: BLE001 - the store is rank 0's own; best effort
                        pass
                    return why
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    # -- the executor's interface ----------------------------------------------------------------
    model = property(lambda self: self.runner.model)
    num_blocks = property(lambda self: self.runner.num_blocks)
    backend = property(lambda self: self.runner.backend)

    def kv_cache_info(self):
        return self.runner.kv_cache_info()

    def execute_model(self, out) -> ModelRunnerOutput:
        return self._run(StepMessage("step", out=out), lambda: self.runner.execute_model(out))

    def execute(self, out) -> torch.Tensor:
        """The logits of a step alone (what ModelRunner.execute returns)."""
        return self.execute_model(out).logits

    def check_health(self) -> None:
        """EngineDeadError once a worker exited or a step failed (even while idle)."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            self._run(StepMessage("copy", pairs=list(pairs)), lambda: self.runner.copy_blocks(pairs))

    def rank_stats(self) -> list[RankStats]:
        """Every rank's parameter bytes, KV-cache bytes and resident memory (rank order)."""
        def gather():
            got: list = [None] * self.plan.world_size
            dist.gather_object(rank_stats(self.runner, 0, self._rss_start), got, dst=0, group=self.tp.group)
            return got
        return self._run(StepMessage("stats"), gather)

    def _run(self, msg: StepMessage, local):
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(self.dead)
            try:
                dist.broadcast_object_list([msg], src=0, group=self.tp.group)
                result = local()
            except Exception as e:  # noqa: BLE001 - the ranks are out of step: nothing more can run
                raise EngineDeadError(self._die(e)) from e
            except BaseException:   # interrupted mid-step: the same, without waiting for a reason
                self._die(None)
                raise
            finally:
                self._last_send = time.monotonic()
            return result

    def _die(self, error: Exception | None) -> str:
        """Mark the executor dead (the first reason wins) and stop the workers; the reason: a worker
        that exited (waited for a few seconds after a failed collective), else the error."""
        if self.dead is None:
            failure = self._worker_failure(wait=3.0 if error is not None else 0.0)
            self.dead = failure or (f"a tensor-parallel step failed: {type(error).__name__}: {error}" if error
                                    else "a tensor-parallel step was interrupted")
            log.error("%s: the engine stops", self.dead)
            self._stop.set()
            self._kill_workers()
        return self.dead

    # -- watchdog and heartbeat --------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(defaults.TP_WATCHDOG_S):
            if (failure := self._worker_failure()) is not None:
                with self._lock:   # not while a step is being broadcast
                    if self.dead is None and not self._stop.is_set():
                        self.dead = failure
                        log.error("%s: the engine stops", failure)
                        self._kill_workers()
                return
            if time.monotonic() - self._last_send >= defaults.TP_HEARTBEAT_S and self._lock.acquire(blocking=False):
                try:
                    if self.dead is None and not self._stop.is_set():
                        dist.broadcast_object_list([StepMessage("ping")], src=0, group=self.tp.group)
                except Exception as e:  # noqa: BLE001
                    self._die(e)
                finally:
                    self._last_send = time.monotonic()
                    self._lock.release()

    # -- shutdown --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the workers (a `stop` step; killed if they linger) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        acquired = self._lock.acquire(timeout=2 * defaults.TP_TIMEOUT_S)
        try:
            self._stop.set()   # the watchdog ends: workers leaving now are not failures
            if self.dead is None:
                self.dead = "the tensor-parallel engine was shut down"
                try:
                    dist.broadcast_object_list([StepMessage("stop")], src=0, group=self.tp.group)
                except Exception:  # noqa: BLE001 - a worker already gone
                    pass
        finally:
            if acquired:
                self._lock.release()
        self._teardown()

    def _kill_workers(self, grace: float = 0.0) -> None:
        for p in self.workers:
            p.join(grace)
            if p.exitcode is None:
                p.kill()
                p.join(5)

    def _teardown(self) -> None:
        self._stop.set()
        self._kill_workers(grace=5.0)
        self.workers = []
        parallel.destroy()
        self._store = None
        torch.set_num_threads(self._threads)


def _shutdown_at_exit(ref) -> None:
    executor = ref()
    if executor is not None:
        executor.shutdown()


def start_tensor_parallel(args, loaded=None, progress=None) -> TPExecutor:
    """Rank 0's executor for LLMEngine. Under torchrun, a rank other than 0 runs its steps here
    until rank 0 stops, then the process exits (SystemExit 0): it has no engine of its own."""
    if loaded is not None:
        raise UserInputError(f"--tensor-parallel-size {args.tensor_parallel_size}: every rank loads its own shard; "
                             "pass no preloaded model")
    if run_torchrun_worker(args):
        raise SystemExit(0)
    return TPExecutor(args, progress)
