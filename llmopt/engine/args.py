"""EngineArgs: every knob of the engine, with the toolkit's defaults (llmopt/defaults.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from llmopt import defaults
from llmopt.cache.kivi import KiviConfig, check_kivi_model, kivi_config
from llmopt.errors import UserInputError
from llmopt.models.config import resolve_device_name
from llmopt.validate import check_engine_limits

UNLIMITED_TOKENS = 1 << 40
log = logging.getLogger("llmopt.engine")


def default_batched_tokens(device: str) -> int:
    """--max-num-batched-tokens when none is given: smaller chunks on the CPU, where a prefill
    chunk is compute-bound and stalls every running decode for its whole length."""
    return defaults.batched_tokens(resolve_device_name(device, must_exist=False))


@dataclass
class EngineArgs:
    model: str | None = None                      # folder, .gguf, HF id in the cache, or a built-in name
    dtype: str = defaults.DTYPE
    device: str = defaults.DEVICE
    block_size: int = defaults.BLOCK_SIZE
    max_model_len: int | None = None              # default: the model's max_position_embeddings
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    max_num_batched_tokens: int | None = None     # None: the device's default (defaults.py); 0 = unlimited
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING
    kv_cache_memory: int | None = None            # bytes; default: all of KV_CACHE_MEMORY_CPU on the CPU
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION
    kv_cache_dtype: str = defaults.KV_CACHE_DTYPE
    attention_backend: str = defaults.ATTENTION_BACKEND
    seed: int = 0
    scheduling_policy: str = defaults.SCHEDULING_POLICY  # or "priority" (lower value first)
    detokenize: bool = True
    quantization: str | None = None               # int8 | fp8: a float checkpoint quantized per channel at load
    lm_head_dtype: str = defaults.LM_HEAD_DTYPE   # auto (int8 for quantized models on the CPU) | float | int8
    enforce_eager: bool = defaults.ENFORCE_EAGER  # True: no compiled decode step (vLLM's --enforce-eager)
    speculative_config: "dict | str | None" = None  # vLLM's --speculative-config: a dict, JSON, or a spec_config.json
    tensor_parallel_size: int = defaults.TENSOR_PARALLEL_SIZE  # ranks the model is split over (llmopt/distributed)
    kv_offload_bytes: int | None = None   # a second tier of this many bytes for evicted prefix blocks (host memory)
    kv_offload_dir: str | None = None     # ... kept in a memory-mapped file in this folder instead (persists)
    disable_hybrid_kv_cache_manager: bool = False   # vLLM's flag: mixed windows share one table, every block kept
    kivi_group_size: int = defaults.KIVI_GROUP_SIZE            # kivi2: tokens per key group (the block size)
    kivi_residual_length: int = defaults.KIVI_RESIDUAL_LENGTH  # kivi2: recent tokens kept in full precision

    @property
    def kivi(self) -> KiviConfig | None:
        """KIVI's sizes when the cache is kivi2 (llmopt/cache/kivi.py)."""
        return kivi_config(self.kv_cache_dtype, self.kivi_group_size, self.kivi_residual_length)

    @property
    def hybrid_kv_cache(self) -> bool:
        """Separate block tables per window (llmopt/cache/groups.py): not when asked off, nor when a
        proposer may write K/V over a request's table (it reads every block)."""
        return not self.disable_hybrid_kv_cache_manager and self.speculative_config is None

    def __post_init__(self) -> None:
        # deferred: optional plug-in (llmopt.speculative imports the engine, never at the engine's import)
        from llmopt.speculative.config import parse_speculative_config
        self.speculative_config = parse_speculative_config(self.speculative_config)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise UserInputError(f"--tensor-parallel-size {self.tensor_parallel_size}: give at least 1")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_batched_tokens(self.device)
        check_engine_limits(block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                            gpu_memory_utilization=self.gpu_memory_utilization)
        if not self.max_num_batched_tokens:
            self.max_num_batched_tokens = UNLIMITED_TOKENS
        self._check_offload()
        self._check_kivi()

    def _check_kivi(self) -> None:
        if self.kv_cache_dtype in ("kivi", "kivi-2bit", "kivi_2bit"):   # kv-estimate's spellings
            self.kv_cache_dtype = "kivi2"
        if self.kivi is None:   # (the KIVI flags with another dtype are refused there)
            return
        check_kivi_model(False, self.tensor_parallel_size)   # (windows: known once the model loads)
        if self.speculative_config is not None:
            raise UserInputError("kivi2 does not run with --speculative-config (drafts would rewind its residual): "
                                 "pick another --kv-cache-dtype")
        if self.block_size != self.kivi_group_size:   # a block is one KIVI group (vLLM forces a backend's block size too)
            log.info("kivi2: block size %d (its group size)", self.kivi_group_size)
            self.block_size = self.kivi_group_size

    def _check_offload(self) -> None:
        if self.kv_offload_dir is not None and self.kv_offload_bytes is None:
            raise UserInputError("--kv-offload-dir needs --kv-offload-bytes: the size of the file it keeps there")
        if self.kv_offload_bytes is None:
            return
        if self.kv_offload_bytes <= 0:
            raise UserInputError(f"--kv-offload-bytes must be a positive number of bytes (got {self.kv_offload_bytes})")
        if not self.enable_prefix_caching:
            raise UserInputError("--kv-offload-bytes keeps evicted prefix-cache blocks: it needs prefix caching "
                                 "(drop --no-enable-prefix-caching)")
        if self.tensor_parallel_size > 1:
            raise UserInputError("--kv-offload-bytes runs with --tensor-parallel-size 1 only")
        if self.kv_offload_dir is not None and not os.path.isdir(self.kv_offload_dir):
            raise UserInputError(f"--kv-offload-dir {self.kv_offload_dir}: no such folder")
