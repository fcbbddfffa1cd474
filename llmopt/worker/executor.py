"""The executor interface: what runs a scheduled step's forward for the engine, as vLLM v1's
`Executor`. One process: a `ModelRunner` (runner.py) is its own executor. Tensor parallelism:
`llmopt.distributed.executor.TPExecutor` (rank 0 broadcasts each step to the other ranks). The
engine gets one at construction (`llmopt.engine.executor.create_executor`, the one place that
chooses) and afterwards calls only what `Executor` names.

`execute_model(scheduler_output)` returns a ModelRunnerOutput (runner.py): the logits rows the step
asked for (`num_logits` per request, schedule order) and, when `scheduler_output.hidden_layers` is
not None (a proposer that reads the target's features, EAGLE), the hidden states of every scheduled
token.
"""

from __future__ import annotations

from typing import Protocol

from llmopt.core.scheduler import SchedulerOutput
from llmopt.errors import EngineDeadError  # noqa: F401  (re-exported: where the engine and executors take it)
from llmopt.models.loader import LoadedModel
from llmopt.worker.runner import KVCacheInfo, ModelRunnerOutput


class Executor(Protocol):
    """What the engine calls on whatever runs its forwards."""
    loaded: LoadedModel       # the target as this process holds it (rank 0's shard under tensor parallelism)
    num_blocks: int           # KV blocks per layer (a proposer's own KV mirrors the target's block table)
    backend: str              # kernel backend, "torch" or "triton"

    def kv_cache_info(self) -> KVCacheInfo: ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def check_health(self) -> None:
        """Raise EngineDeadError when no more steps can run; return quietly otherwise."""

    def shutdown(self) -> None:
        """Release what outlives the engine (worker processes, the process group)."""
