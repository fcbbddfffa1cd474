"""`create_executor`: the one place that chooses what runs the engine's forwards (the interface is
`llmopt.worker.executor.Executor`): tensor-parallel ranks (llmopt.distributed) or one `ModelRunner`."""

from __future__ import annotations

from typing import Callable

from llmopt.engine.args import EngineArgs
from llmopt.models.loader import LoadedModel, load_model
from llmopt.worker.executor import Executor
from llmopt.worker.runner import ModelRunner


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
                       args.max_num_batched_tokens, args.attention_backend, args.enforce_eager,
                       args.kv_offload_bytes, args.kv_offload_dir, args.hybrid_kv_cache, args.kivi, args.max_model_len,
                       args.max_num_seqs)
