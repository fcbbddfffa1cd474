"""`estimate()`: bytes per token, weights, the memory budget of one GPU, the paged KV cache it leaves,
concurrency, the longest context, a batch x length grid and the naive formula, as one dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from llmopt import defaults
from llmopt.cache.kivi import KiviConfig
from llmopt.errors import UserInputError
from llmopt.estimate import naive as naive_mod
from llmopt.distributed.plan import quant_group_size
from llmopt.estimate.kv import FLOAT_BYTES, canonical_kv_dtype, layer_kv_specs, tp_split
from llmopt.estimate.arch import ModelArch
from llmopt.estimate.plan import GridCell, KVLayout, build_layout, grid, largest_length
from llmopt.estimate.presets import find_gpu
from llmopt.units import GIB
from llmopt.estimate.weights import WeightMemory, weight_memory
from llmopt.estimate.whatif import WhatIf, what_ifs
from llmopt.models.config import resolve_device_name, resolve_dtype_name, resolve_weight_dtype_name
from llmopt.validate import check_engine_limits, kv_cache_memory_problem


@dataclass
class LayerSummary:
    kind: str                   # full | sliding | mla
    window: int | None
    layers: int
    bytes_per_token: float      # per layer, one rank


@dataclass
class MemoryBudget:
    gpu: str
    gpu_memory_bytes: int       # total, one GPU
    gpu_memory_utilization: float
    budget_bytes: int           # total * utilization (what vLLM's profiler may use)
    weights_bytes: int          # one rank's weights
    reserve_bytes: int          # activations + logits + runtime (estimated, or --reserve-gib)
    reserve_detail: dict[str, int]
    kv_available_bytes: int     # budget - weights - reserve (negative: does not fit)


@dataclass
class PagedPlan:
    layout: str                 # uniform | uniform-type | hybrid
    groups: list[dict]
    block_size: int
    block_bytes: int            # bytes one block id costs (all layers using it, one rank)
    available_bytes: int
    num_blocks: int
    kv_cache_bytes: int         # num_blocks * block_bytes (+ KIVI's residual): what is allocated
    tokens: int
    blocks_per_request: int     # at max_model_len
    request_bytes: int
    max_concurrency: float
    longest_context: int
    longest_context_limited_by: str   # memory | model
    residual_blocks: int = 0    # KIVI: full-precision blocks (of residual_block_bytes each)
    residual_block_bytes: int = 0
    residual_blocks_per_request: int = 0   # at max_model_len


@dataclass
class KVEstimate:
    model: str
    source: str
    origin: str
    attention: str
    num_layers: int
    num_kv_heads: int
    kv_heads_per_rank: int
    head_dim: int
    max_position_embeddings: int
    device: str                 # cpu | cuda: where the plan runs (what `auto` resolved to)
    dtype: str                  # the model's compute dtype there (what `--dtype auto` resolved to)
    weight_dtype: str           # how its float weights are held (16-bit on the CPU for a 16-bit checkpoint)
    kv_cache_dtype: str
    tensor_parallel_size: int
    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    bytes_per_token: float      # one rank, all layers (KIVI: amortized, residual window excluded)
    bytes_per_token_model: float  # the whole model at tensor-parallel size 1
    layers: list[LayerSummary]
    weights: WeightMemory
    request_bytes: int          # one request at max_model_len, one rank, paged
    memory: MemoryBudget | None = None
    paged: PagedPlan | None = None
    grid: list[GridCell] = field(default_factory=list)
    naive: naive_mod.NaiveComparison | None = None
    what_if: list[WhatIf] = field(default_factory=list)
    fits: bool | None = None
    problems: list[str] = field(default_factory=list)
    note: str = ""


def _num(x: Fraction) -> float | int:
    return int(x) if x.denominator == 1 else float(x)


def _tp_group_size(arch: ModelArch, weight_format: str, group_size: int | None) -> int | None:
    """The quantization group a row-parallel shard must hold whole: the checkpoint's (weight format
    auto), or int4's --group-size; None for float and per-channel weights."""
    fmt = weight_format.strip().lower()
    if fmt == "auto":
        return quant_group_size(arch.quantization_config)
    if fmt == "int4":
        g = defaults.QUANT_GROUP_SIZE if group_size is None else group_size
        return g if g > 0 else None
    return None


def reserve_estimate(arch: ModelArch, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> dict[str, int]:
    """Non-KV memory besides weights: the forward's peak activations over a max_num_batched_tokens
    step (a few hidden-wide buffers and the MLP's gate/up/act intermediates), float32 sampler
    logits for max_num_seqs rows, and a fixed runtime overhead."""
    act = FLOAT_BYTES.get(arch.serving_dtype, 2)
    ffn = arch.intermediate_size
    if arch.moe:
        ffn = max(ffn if arch.moe.first_dense_layers else 0,
                  arch.moe.intermediate_size * arch.moe.experts_per_tok + arch.moe.shared_intermediate_size)
    per_token = 4 * arch.hidden_size + 3 * -(-ffn // tp)
    return {"activations": max_num_batched_tokens * per_token * act,
            "logits": max_num_seqs * arch.vocab_size * 4,
            "runtime": int(defaults.ESTIMATE_RUNTIME_OVERHEAD_GIB * GIB)}


def estimate(arch: ModelArch, *, device: str | None = None, dtype: str = defaults.DTYPE,
             kv_cache_dtype: str = defaults.KV_CACHE_DTYPE, block_size: int = defaults.BLOCK_SIZE,
             max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
             max_num_seqs: int = defaults.MAX_NUM_SEQS, tensor_parallel_size: int = 1, gpu: str | None = None,
             gpu_memory_gib: float | None = None, gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION,
             kv_cache_memory: int | None = None, reserve_bytes: int | None = None, weight_format: str = "auto",
             group_size: int | None = None, batch_sizes: list[int] | None = None, seq_lens: list[int] | None = None,
             naive: bool = False, hybrid: bool = True, what_if: bool = False,
             kivi: KiviConfig | None = None) -> KVEstimate:
    """The whole plan. `device`/`dtype` resolve `auto` as the engine does (models/config.py):
    device auto is a GPU when one is planned for (gpu / gpu_memory_gib) or present here, else the
    CPU; None plans for a GPU. dtype auto computes in float32 on the CPU (a 16-bit checkpoint's
    weights held 16-bit), in the checkpoint's dtype on a GPU; a KV dtype of auto is the compute
    dtype. `what_if` re-runs the plan with the usual levers (fp8
    KV, quantized weights, 2x GPUs, the longest context that fits) when a memory budget is given.
    kivi: KIVI's group and residual sizes for kivi2 (default: the paper's)."""
    dev = resolve_device_name(device or "cuda", gpu_planned=gpu is not None or gpu_memory_gib is not None,
                              must_exist=False)
    kind = "cpu" if dev == "cpu" else "cuda"
    compute = resolve_dtype_name(dtype, kind, arch.checkpoint_dtype)
    if max_num_batched_tokens is None:   # the engine's default on that device
        max_num_batched_tokens = defaults.batched_tokens(kind)
    # 16-bit float weights: a float safetensors checkpoint's (the loader's holds_16bit); a quantized
    # one keeps its float tensors in the compute dtype, a GGUF its own types
    as_stored = arch.quantization_config or arch.source in ("gguf", "builtin")
    arch = replace(arch, dtype=compute,
                   weight_dtype=compute if as_stored else resolve_weight_dtype_name(dtype, kind, arch.checkpoint_dtype))
    levers = dict(device=dev, dtype=arch.dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size, max_model_len=max_model_len,
                  max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                  tensor_parallel_size=tensor_parallel_size, gpu=gpu, gpu_memory_gib=gpu_memory_gib,
                  gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory=kv_cache_memory,
                  reserve_bytes=reserve_bytes, weight_format=weight_format, group_size=group_size, hybrid=hybrid,
                  kivi=kivi)
    tp = tensor_parallel_size
    plan = tp_split(arch, tp, _tp_group_size(arch, weight_format, group_size))   # the engine's check and split
    check_engine_limits(block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization)
    kv_dtype = canonical_kv_dtype(kv_cache_dtype, arch)
    max_len = max_model_len or arch.max_position_embeddings
    max_num_batched_tokens = max_num_batched_tokens or max_len   # 0: unlimited, a whole context per step
    layers = layer_kv_specs(arch, kv_dtype, tp, kivi)
    layout = build_layout(layers, block_size, hybrid)
    block_size = layout.groups[0].block_size if layout.kivi is not None else block_size   # the engine's
    per_kind: dict[tuple, list] = {}
    for x in layers:
        per_kind.setdefault((x.kind, x.window), []).append(x)
    summary = [LayerSummary(k, w, len(v), _num(v[0].token_bytes)) for (k, w), v in per_kind.items()]
    weights = weight_memory(arch, weight_format, group_size, tp, device=dev)
    note = arch.note
    if max_len > arch.max_position_embeddings:     # planning what-ifs; `llmopt kv-estimate` refuses it
        note = (note + "; " if note else "") + (f"max_model_len {max_len:,} exceeds the model's "
                                                 f"max_position_embeddings {arch.max_position_embeddings:,}")
    est = KVEstimate(
        model=arch.name, source=arch.source, origin=arch.origin, attention=arch.attention, num_layers=arch.num_layers,
        num_kv_heads=1 if arch.mla else arch.num_kv_heads,
        kv_heads_per_rank=1 if arch.mla else plan.kv_heads_per_rank,
        head_dim=layers[0].head_size, max_position_embeddings=arch.max_position_embeddings,
        device=dev, dtype=arch.dtype, weight_dtype=arch.weight_dtype, kv_cache_dtype=kv_dtype,
        tensor_parallel_size=tp, block_size=block_size, max_model_len=max_len,
        max_num_batched_tokens=max_num_batched_tokens,
        bytes_per_token=_num(sum((x.token_bytes for x in layers), Fraction(0))),
        bytes_per_token_model=_num(sum((x.token_bytes for x in layer_kv_specs(arch, kv_dtype, 1, kivi)), Fraction(0))),
        layers=summary, weights=weights, request_bytes=layout.bytes_for(max_len, max_num_batched_tokens), note=note)
    available = _fit_memory(est, arch, dev, weights, gpu, gpu_memory_gib, gpu_memory_utilization, tp,
                            max_num_batched_tokens, max_num_seqs, reserve_bytes, kv_cache_memory)
    _fit_blocks(est, layout, available, max_len, max_num_batched_tokens, max_num_seqs, arch, batch_sizes, seq_lens)
    if naive:
        layers1 = layer_kv_specs(arch, kv_dtype, 1, kivi)
        est.naive = naive_mod.compare(arch, kv_dtype, layers1, build_layout(layers1, block_size, hybrid), max_len, 1,
                                      block_size, max_num_batched_tokens)
    est.fits = None if available is None else not est.problems
    if what_if and est.memory is not None:
        est.what_if = what_ifs(est, lambda **kw: estimate(arch, **kw), levers)
    return est


def _fit_memory(est: KVEstimate, arch: ModelArch, dev: str, weights: WeightMemory, gpu, gpu_memory_gib, util, tp,
                mnbt: int, max_num_seqs: int, reserve_bytes, kv_cache_memory: int | None) -> int | None:
    """est.memory (when a GPU budget is given) and its problems; the KV-cache bytes to plan with
    (None: no budget, so no fit verdict)."""
    available = kv_cache_memory
    if gpu is not None or gpu_memory_gib is not None:
        est.memory = _budget(arch, gpu, gpu_memory_gib, util, weights, tp, mnbt, max_num_seqs, reserve_bytes)
        if available is None:
            available = est.memory.kv_available_bytes
        elif available > est.memory.kv_available_bytes:
            est.problems.append(f"--kv-cache-memory {available / GIB:.2f} GiB is more than the "
                                f"{max(0, est.memory.kv_available_bytes) / GIB:.2f} GiB the budget leaves")
        if est.memory.kv_available_bytes <= 0:
            est.problems.append(f"weights ({weights.bytes_per_rank / GIB:.1f} GiB per GPU) + reserve "
                                f"({est.memory.reserve_bytes / GIB:.1f} GiB) exceed the budget "
                                f"({est.memory.budget_bytes / GIB:.1f} GiB)")
    if kv_cache_memory is not None and dev == "cpu":   # the engine refuses what this machine cannot hold
        problem = kv_cache_memory_problem(kv_cache_memory, "cpu")
        if problem is not None:
            est.problems.append(problem)
    return available


def _fit_blocks(est: KVEstimate, layout: KVLayout, available: int | None, max_len: int, mnbt: int, max_num_seqs: int,
                arch: ModelArch, batch_sizes: list[int] | None, seq_lens: list[int] | None) -> None:
    """est.paged (the blocks `available` bytes hold) and est.grid, with their problems."""
    if available is not None:
        if layout.kivi is not None:
            est.paged = _paged_kivi(layout, max(0, available), max_len, mnbt, max_num_seqs, est)
            if est.paged is None:
                return
        else:
            est.paged = _paged(layout, max(0, available), max_len, mnbt, arch)
        budget_ok = est.memory is None or est.memory.kv_available_bytes > 0
        if est.paged.num_blocks < est.paged.blocks_per_request and budget_ok:
            est.problems.append(f"one request of {max_len:,} tokens needs {est.paged.blocks_per_request:,} blocks, the "
                                f"cache holds {est.paged.num_blocks:,}: the longest context that fits is "
                                f"{est.paged.longest_context:,} tokens")
    if batch_sizes or seq_lens:
        est.grid = grid(layout, batch_sizes or [1], seq_lens or [max_len], mnbt,
                        est.paged.num_blocks if est.paged else None,
                        est.paged.residual_blocks if est.paged and layout.kivi is not None else None)
        misses = [c for c in est.grid if c.fits is False]
        if misses:
            est.problems.append(f"{len(misses)} of {len(est.grid)} grid cells do not fit (e.g. batch "
                                f"{misses[0].batch_size} x {misses[0].seq_len:,} tokens)")


def _budget(arch, gpu, gpu_memory_gib, util, weights, tp, mnbt, max_num_seqs, reserve_bytes) -> MemoryBudget:
    if gpu_memory_gib is not None:
        if gpu_memory_gib <= 0:
            raise UserInputError(f"--gpu-memory must be positive GiB, got {gpu_memory_gib}")
        name, total = (gpu or "custom"), int(gpu_memory_gib * GIB)
    else:
        preset = find_gpu(gpu)
        name, total = preset.name, preset.memory_bytes
    detail = ({"given": reserve_bytes} if reserve_bytes is not None
              else reserve_estimate(arch, tp, mnbt, max_num_seqs))
    reserve = sum(detail.values())
    budget = int(total * util)
    return MemoryBudget(name, total, util, budget, weights.bytes_per_rank, reserve, detail,
                        budget - weights.bytes_per_rank - reserve)


def _paged_kivi(layout: KVLayout, available: int, max_len: int, mnbt: int, max_num_seqs: int,
                est: KVEstimate) -> PagedPlan | None:
    """The engine's two KIVI pools (llmopt/cache/kivi.py: kivi_pools); None, with the problem, when
    the budget holds no request of max_len."""
    try:
        pools = layout.kivi_pools(available, max_len, max_num_seqs, mnbt)
    except UserInputError as e:
        est.problems.append(str(e))
        return None
    n, nr = pools.num_blocks, pools.num_residual_blocks
    per, res = layout.blocks_per_request(max_len, mnbt), layout.residual_blocks(max_len)
    free_residual = pools.planned_requests * res    # the step's share is not a request's
    upper = max(max_len, est.max_position_embeddings)
    longest = largest_length(lambda length: layout.blocks_per_request(length, mnbt) <= n
                             and layout.residual_blocks(length) <= free_residual, upper)
    concurrency = min(n / per if per else float("inf"), free_residual / res if res else float("inf"))
    rb = layout.residual_block_bytes
    return PagedPlan(layout.mode, _group_rows(layout, max_len, mnbt), layout.groups[0].block_size, layout.block_bytes,
                     available, n, n * layout.block_bytes + nr * rb, layout.tokens(n), per,
                     layout.bytes_for(max_len, mnbt), concurrency, longest, "model" if longest >= upper else "memory",
                     nr, rb, res)


def _group_rows(layout: KVLayout, max_len: int, mnbt: int) -> list[dict]:
    return [{"kind": g.kind, "window": g.window, "layers": len(g.layers), "block_size": g.block_size,
             "page_bytes": g.page_bytes, "blocks_per_request": g.blocks(max_len, mnbt)} for g in layout.groups]


def _paged(layout: KVLayout, available: int, max_len: int, mnbt: int, arch: ModelArch) -> PagedPlan:
    n = layout.num_blocks(available)
    per = layout.blocks_per_request(max_len, mnbt)
    upper = max(max_len, arch.max_position_embeddings)
    longest = layout.longest_context(available, mnbt, upper)
    return PagedPlan(layout.mode, _group_rows(layout, max_len, mnbt), layout.groups[0].block_size, layout.block_bytes,
                     available, n, n * layout.block_bytes, layout.tokens(n), per, per * layout.block_bytes,
                     n / per if per else float("inf"), longest, "model" if longest >= upper else "memory")
