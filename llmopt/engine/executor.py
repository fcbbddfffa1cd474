"""The executor: what runs a scheduled step's forward for the engine, as vLLM v1's `Executor`.

One process: the engine's `ModelRunner` is its own executor (`runner.py`). Tensor parallelism:
`llmopt.distributed.executor.TPExecutor` (rank 0 broadcasts each step to the other ranks). The
engine gets one at construction (`create_executor`, the one place that chooses) and afterwards calls
only what `Executor` names.

`execute_model(scheduler_output)` returns a ModelRunnerOutput (runner.py): the logits rows the step
asked for (`num_logits` per request, schedule order) and, when `scheduler_output.hidden_layers` is not None (a proposer that
reads the target's features, EAGLE), the hidden states of every scheduled token.
"""

from __future__ import annotations

from typing import Callable, Protocol

from llmopt.engine.args import EngineArgs
from llmopt.engine.runner import KVCacheInfo, ModelRunner, ModelRunnerOutput
from llmopt.engine.scheduler import SchedulerOutput
from llmopt.errors import LLMOptError
from llmopt.models.loader import LoadedModel, load_model


class EngineDeadError(LLMOptError):
    """A step failed in a way no single request explains: the engine serves nothing more."""


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


def create_executor(args: EngineArgs, loaded: LoadedModel | None, progress=None,
                    check: Callable[[LoadedModel], None] = lambda loaded: None) -> Executor:
    """The executor the engine's args ask for, chosen here once: tensor-parallel ranks when
    `tensor_parallel_size` > 1 (every rank loads its own shard), else a ModelRunner over `loaded`
    (loaded here when None). `check(loaded)` runs once the model is loaded (before the KV cache is
    allocated in one process)."""
    if args.tensor_parallel_size > 1:
        # deferred: optional plug-in (torch.distributed, worker processes), imported only for tensor parallelism
        from llmopt.distributed.executor import start_tensor_parallel
        executor = start_tensor_parallel(args, loaded, progress)
        try:
            check(executor.loaded)
        except BaseException:
            executor.shutdown()
            raise
        return executor
    if loaded is None:
        loaded = load_model(args.model, args.dtype, args.device, progress, quantization=args.quantization,
                            lm_head_dtype=args.lm_head_dtype)
    check(loaded)
    return ModelRunner(loaded, args.block_size, args.kv_cache_dtype, args.kv_cache_memory, args.gpu_memory_utilization,
                       args.max_num_batched_tokens, args.attention_backend, args.enforce_eager)
