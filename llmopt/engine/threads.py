"""The one owner of the compute threads: which OS thread runs the engine's tensor work, and with how
many OpenMP threads.

torch's CPU ops and our C++ kernels (kernels/cpu_quant.py) share one OpenMP runtime, and an OpenMP
runtime keeps one team of worker threads per OS thread that has entered a parallel region. When a
second thread starts stepping an engine (a server's step thread, after the model loaded in the main
thread), a second team appears; with more OpenMP threads than cores, GNU libgomp stops spinning
between parallel regions and sleeps instead (its throttled spin count), so each of the ~300
parallel regions of a decode step waits for a wake-up: one stream on two cores fell from 176-181 to
119-154 tok/s in the step thread and to 130-141 in the main thread after it, where it stayed.

The fix is one team at a time: the thread that hands the compute to another gives its team back
(`release_openmp_pool`, OpenMP 5's `omp_pause_resource_all`, which frees the calling thread's pool
in libgomp), and everything that steps an engine off the main thread does so through one
long-lived `ComputeThread` (not `asyncio.to_thread`, whose pool may hand the next step to another
thread), which applies the thread count once, before its first op.

    compute = ComputeThread(name="llmopt-engine")     # the caller's thread count, the caller's team released
    future = compute.submit(engine_loop)               # a concurrent.futures.Future
    outputs = compute.run(engine.step)                 # blocks until it ran in the thread
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import functools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

log = logging.getLogger("llmopt.engine")

T = TypeVar("T")
OMP_PAUSE_SOFT = 1   # omp_pause_resource_t: free the threads, keep the settings
_OPENMP_NAMES = ("libgomp", "libiomp", "libomp")


@functools.cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime this process loaded (torch's own), or None (no OpenMP, or not Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[-1] for line in f if "/" in line]
    except OSError:
        return None
    for path in paths:
        name = path.rsplit("/", 1)[-1]
        if name.startswith(_OPENMP_NAMES):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                return None
            return lib if hasattr(lib, "omp_pause_resource_all") else None
    return None


def openmp_runtime() -> str | None:
    """The file name of the OpenMP runtime in use, or None."""
    lib = _openmp()
    return None if lib is None else lib._name.rsplit("/", 1)[-1]


def release_openmp_pool() -> bool:
    """Give back the OpenMP worker team of the calling thread (it is made again, at a cost of
    microseconds, if this thread runs a parallel region later). False when the runtime cannot."""
    lib = _openmp()
    return lib is not None and lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@dataclass(frozen=True)
class ThreadSettings:
    """What a compute thread runs with, read in that thread."""
    thread_name: str
    num_threads: int            # torch.get_num_threads() (the OpenMP team's size)
    openmp_runtime: str | None


def apply_threads(num_threads: int) -> ThreadSettings:
    """Set the calling thread's intra-op thread count (torch's and therefore the C++ kernels'
    OpenMP team) and report what it now runs with."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
    return current_settings()


def current_settings() -> ThreadSettings:
    return ThreadSettings(threading.current_thread().name, torch.get_num_threads(), openmp_runtime())


class ComputeThread:
    """One long-lived thread that runs every call given to it, in order. Created by the thread that
    owned the compute so far (which gives its OpenMP team back: `release_caller`), with that
    thread's intra-op thread count unless `num_threads` says otherwise."""

    def __init__(self, name: str = "llmopt-compute", num_threads: int | None = None,
                 release_caller: bool = True) -> None:
        self.num_threads = num_threads if num_threads is not None else torch.get_num_threads()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._started = threading.Event()
        self.settings: ThreadSettings | None = None
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        if release_caller:
            release_openmp_pool()
        self._thread.start()
        self._started.wait()

    def _main(self) -> None:
        self.settings = apply_threads(self.num_threads)
        self._started.set()
        while True:
            item = self._calls.get()
            if item is None:
                release_openmp_pool()
                return
            fn, args, future = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(e)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, fn: Callable[..., T], *args) -> "concurrent.futures.Future[T]":
        if not self._thread.is_alive():
            raise RuntimeError(f"compute thread {self._thread.name} has stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, args, future))
        return future

    def run(self, fn: Callable[..., T], *args) -> T:
        """Run fn(*args) in this thread and wait for its result (its exception is raised here)."""
        return self.submit(fn, *args).result()

    def close(self, timeout: float | None = None) -> None:
        """Stop after the calls already given (the thread gives its OpenMP team back)."""
        if self._thread.is_alive():
            self._calls.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout)
