"""The model runner: owns the per-layer paged K/V tensors and runs one forward per step over the
flattened tokens of every scheduled request.

Per step it builds, once, input_ids / positions / slot_mapping [N], block_tables [S, max_blocks],
seq_lens [S] and query_start_loc [S + 1], hands the model a paged attention context (write the new
K/V, then attend over the cache) and computes logits only for the rows that are asked for: the last
position of each request that samples, or its last k + 1 positions when k draft tokens are verified.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from llmopt import defaults, kernels
from llmopt.cache.groups import kv_cache_groups
from llmopt.cache.kivi import KiviConfig, check_kivi, check_kivi_model, key_page_bytes, kivi_pools, page_bytes, \
    value_page_bytes
from llmopt.core.scheduler import SchedulerOutput
from llmopt.errors import EngineDeadError, LLMOptError, UserInputError
from llmopt.kernels import kivi as kivi_kernels
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.config import auto_kv_dtype_name
from llmopt.models.loader import LoadedModel
from llmopt.models.logprobs import ScoredTokens, score_tokens

log = logging.getLogger("llmopt.engine")


@dataclass
class HiddenStates:
    """The target's hidden states of one step, one row per scheduled token (schedule order)."""
    final: torch.Tensor              # [N, hidden] after the final norm
    layers: list[torch.Tensor]       # [N, hidden] entering each asked layer: ascending index, once each


@dataclass
class ModelRunnerOutput:
    logits: torch.Tensor                       # float32 [sum of num_logits, vocab], schedule order
    hidden_states: HiddenStates | None = None  # when the step asked for them (SchedulerOutput.hidden_layers)
    # request id -> its scored prompt positions (ScheduledRequest.prompt_targets), when any were asked
    prompt_logprobs: dict[str, ScoredTokens] = field(default_factory=dict)


@dataclass
class KVCacheInfo:
    num_blocks: int
    block_size: int
    num_layers: int
    kv_cache_dtype: str
    bytes_per_block: int     # one block in one layer: K and V (+ int8 scales), as design.md defines
    bytes_allocated: int     # sum of nbytes of every K/V (and scale) tensor allocated
    block_layers: int = 0    # layers one block id holds: all of them, or a group's (hybrid models)
    group_windows: list = field(default_factory=lambda: [None])   # each KV-cache group's window
    offload_slots: int = 0           # blocks the offload tier holds (0: no tier)
    offload_block_bytes: int = 0     # bytes of one block of every layer, as the tier stores it
    offload_restored: list = field(default_factory=list)   # (hash, slot) a disk tier held at start-up
    num_residual_blocks: int = 0     # kivi2: full-precision blocks (llmopt/cache/kivi.py)
    residual_bytes_per_block: int = 0   # kivi2: one residual block in one layer

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class PagedAttention(kernels.PagedStep):
    """The model's attention context for one step: `(layer_idx, q, k, v, window) -> o` on [N, H, D].
    `backend` is the runner's kernel backend; the model's fused RMSNorm/RoPE read it too."""

    def __init__(self, runner: "ModelRunner") -> None:
        self.r = runner
        self.backend = runner.backend
        self.set_step(None, None, None, None)

        self.group_steps: list[kernels.PagedStep] = []   # groups after the first (hybrid models)

    def set_group_steps(self, steps: list[tuple]) -> None:
        """The step metadata of every group after the first: (slot_mapping, block_tables) each."""
        while len(self.group_steps) < len(steps):
            self.group_steps.append(kernels.PagedStep())
            self.group_steps[-1].backend = self.backend
        for st, (slots, tables) in zip(self.group_steps, steps):
            st.set_step(slots, tables, self.seq_lens, self.query_start_loc)

    def for_layer(self, layer_idx: int) -> kernels.PagedStep:
        """The metadata a layer reads: its group's block tables and slots."""
        g = self.r.layer_group[layer_idx]
        return self if g == 0 else self.group_steps[g - 1]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int | None) -> torch.Tensor:
        r = self.r
        kc, vc = r.key_caches[layer_idx], r.value_caches[layer_idx]
        step = self.for_layer(layer_idx)
        if r.kivi is not None:   # new rows into the full-precision residual; attention reads the pages too
            step.write(kc, vc, k, v, r.residual_dtype)
            pages = (r.key_pages[layer_idx], r.value_pages[layer_idx])
            return step.attend(q, kc, vc, r.scale, window, r.kv_dtype, pages=pages)
        ksc = r.k_scale_caches[layer_idx] if r.k_scale_caches else None
        vsc = r.v_scale_caches[layer_idx] if r.v_scale_caches else None
        step.write(kc, vc, k, v, r.kv_dtype, r.k_scale, r.v_scale, ksc, vsc)
        return step.attend(q, kc, vc, r.scale, window, r.kv_dtype, r.k_scale, r.v_scale, ksc, vsc)


class ModelRunner:
    """In one process, also the engine's executor (llmopt/engine/executor.py: Executor)."""

    def __init__(self, loaded: LoadedModel, block_size: int, kv_cache_dtype: str = "auto",
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_batched_tokens: int = 2048, attention_backend: str = "auto",
                 enforce_eager: bool = True, kv_offload_bytes: int | None = None,
                 kv_offload_dir: str | None = None, hybrid: bool = False, kivi: KiviConfig | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = defaults.MAX_NUM_SEQS) -> None:
        """kivi: KIVI's sizes for --kv-cache-dtype kivi2 (its pools are sized for requests of
        max_model_len, at most max_num_seqs of them: llmopt/cache/kivi.py)."""
        self.loaded = loaded
        self.model = loaded.model
        self.cfg = loaded.config
        self.dtype = loaded.dtype
        self.device = loaded.device
        self.block_size = block_size
        self.backend = kernels.resolve_backend(attention_backend, self.device)  # "torch" or "triton"
        if kv_cache_dtype not in kernels.KV_DTYPES:
            raise UserInputError(f"unknown KV-cache dtype {kv_cache_dtype!r}; choose one of {', '.join(kernels.KV_DTYPES)}")
        auto = auto_kv_dtype_name(*(str(t).removeprefix("torch.") for t in (self.dtype, loaded.weight_dtype)))
        if kv_cache_dtype == "auto":
            kv_cache_dtype = auto
        self.kv_dtype = kv_cache_dtype
        self.k_scale = self.v_scale = 1.0
        self.scale = self.cfg.head_dim ** -0.5
        self.num_layers = self.cfg.num_hidden_layers
        self.tp = getattr(self.model, "tp", None)    # tensor parallel: this rank's KV heads (llmopt/distributed/plan.py)
        self.num_kv_heads = self.tp.plan.kv_heads_per_rank if self.tp is not None else self.cfg.num_key_value_heads
        self.kivi = self._check_kivi(kivi) if kv_cache_dtype == "kivi2" else None
        self.num_residual_blocks = self.residual_bytes_per_block = 0
        if self.kivi is not None:   # the pages of one block, K and V; the residual: a float block of auto's dtype
            d = self.cfg.head_dim
            self.bytes_per_block = self.num_kv_heads * page_bytes(self.kivi.group_size, d)
            self.residual_dtype = auto
            self.residual_bytes_per_block = kernels.kv_block_bytes(block_size, self.num_kv_heads, d, auto, self.dtype)
        else:
            self.bytes_per_block = kernels.kv_block_bytes(block_size, self.num_kv_heads, self.cfg.head_dim,
                                                          kv_cache_dtype, self.dtype)
        # KV-cache groups (llmopt/cache/groups.py): layer j of every group shares the j-th tensors
        self.block_layers, self.kv_groups = kv_cache_groups(self.cfg.layer_windows or [None] * self.num_layers,
                                                            hybrid)
        self.layer_group, self.layer_slot = [0] * self.num_layers, list(range(self.num_layers))
        for g, spec in enumerate(self.kv_groups):
            for j, layer in enumerate(spec.layers):
                self.layer_group[layer], self.layer_slot[layer] = g, j
        budget = self._kv_budget(kv_cache_memory, gpu_memory_utilization, max_num_batched_tokens)
        self.num_blocks = budget // (self.block_layers * self.bytes_per_block)
        if self.kivi is not None:
            pools = kivi_pools(budget, self.num_layers * self.bytes_per_block,
                               self.num_layers * self.residual_bytes_per_block,
                               max_model_len or self.cfg.max_position_embeddings, max_num_seqs, max_num_batched_tokens,
                               self.kivi.group_size, self.kivi.residual_length)
            self.num_blocks, self.num_residual_blocks = pools.num_blocks, pools.num_residual_blocks
        if self.tp is not None:   # every rank holds the same blocks: the fewest any rank has room for
            self.num_blocks = self.tp.min_int(self.num_blocks)
        if self.num_blocks < 1:
            raise UserInputError(f"{budget:,} bytes of KV cache hold no block of {self.bytes_per_block * self.num_layers:,} "
                                 f"bytes (all layers): raise --kv-cache-memory or lower --block-size")
        self._allocate()
        self.offload = self._offload_store(kv_offload_bytes, kv_offload_dir)
        self.attn = PagedAttention(self)
        # llmopt.worker.compiled.CompiledDecode: decode-only steps of small batches that ask for no hidden states
        self.compiled = None
        if not enforce_eager and self.tp is not None:
            log.info("tensor parallel: the compiled decode step is off (eager steps)")
        elif not enforce_eager and len(self.kv_groups) > 1:
            log.info("KV-cache groups (mixed windows): the compiled decode step is off (eager steps)")
        elif not enforce_eager and self.kivi is not None:
            log.info("kivi2: the compiled decode step is off (eager steps)")
        elif not enforce_eager and self.device.type == "cpu":
            from llmopt.worker.compiled import CompiledDecode   # deferred: start-up time (torch.compile), --no-enforce-eager only
            if CompiledDecode.supports(self.model):
                self.compiled = CompiledDecode(self.model, self.backend, self.device)
        self.cpu_decode = None   # llmopt.worker.cpu_decode.CpuDecode: eager decode steps, one C++ call a layer
        if self.compiled is None and self.device.type == "cpu":
            from llmopt.worker.cpu_decode import CpuDecode   # deferred: start-up time (C++ kernels), CPU only
            self.cpu_decode = CpuDecode.build(self)

    # -- KV memory -------------------------------------------------------------------------------
    def _check_kivi(self, kivi: KiviConfig | None) -> KiviConfig:
        kivi = kivi or KiviConfig()
        check_kivi(kivi.group_size, kivi.residual_length, self.cfg.head_dim)
        if self.block_size != kivi.group_size:
            raise UserInputError(f"kivi2 needs --block-size equal to its group size {kivi.group_size}, got {self.block_size}")
        check_kivi_model(any(self.cfg.layer_windows or ()), 1 if self.tp is None else self.tp.plan.world_size)
        return kivi

    def _kv_budget(self, kv_cache_memory, utilization, max_tokens) -> int:
        if kv_cache_memory is not None:
            if kv_cache_memory <= 0:
                raise UserInputError("--kv-cache-memory must be a positive number of bytes")
            # deferred: start-up time (device queries); more than the device has: refused, as vLLM
            from llmopt.validate import check_kv_cache_memory
            check_kv_cache_memory(int(kv_cache_memory), self.device.type, self.device.index)
            return int(kv_cache_memory)
        if self.device.type != "cuda":
            return defaults.KV_CACHE_MEMORY_CPU
        if not 0 < utilization <= 1:
            raise UserInputError("--gpu-memory-utilization must be in (0, 1]")
        # Profile a forward of a full step's tokens to learn the activation peak, as vLLM does.
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            ids = torch.zeros(1, min(max_tokens, 8192), dtype=torch.long, device=self.device)
            pos = torch.arange(ids.shape[1], device=self.device)[None]
            dense = DenseCausalAttention()
            dense.backend = self.backend
            h = self.model(ids, pos, dense)
            self.model.compute_logits(h[:, -256:])
        activation_peak = torch.cuda.max_memory_allocated(self.device) - base
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * utilization) - (total - free) - activation_peak
        if budget <= 0:
            raise LLMOptError(f"no GPU memory left for the KV cache at --gpu-memory-utilization {utilization}: "
                              f"raise it or load a smaller model")
        return budget

    def _allocate(self) -> None:

        def alloc(s, dt):   # one tensor a group position, shared by that position's layer of each group
            shared = [torch.zeros(s, dtype=dt, device=self.device) for _ in range(self.block_layers)]
            return [shared[self.layer_slot[i]] for i in range(self.num_layers)]

        self.k_scale_caches: list[torch.Tensor] = []
        self.v_scale_caches: list[torch.Tensor] = []
        self.key_pages: list[torch.Tensor] = []
        self.value_pages: list[torch.Tensor] = []
        if self.kivi is not None:   # the residual is the float cache the layers write; the pages, the main pool
            d, g = self.cfg.head_dim, self.kivi.group_size
            residual = (self.num_residual_blocks, self.block_size, self.num_kv_heads, d)
            rdt = kernels.kv_cache_torch_dtype(self.residual_dtype, self.dtype)
            self.key_caches, self.value_caches = alloc(residual, rdt), alloc(residual, rdt)
            self.key_pages = alloc((self.num_blocks, self.num_kv_heads, key_page_bytes(g, d)), torch.uint8)
            self.value_pages = alloc((self.num_blocks, self.num_kv_heads, value_page_bytes(g, d)), torch.uint8)
            self._unique_kv = self.key_pages + self.value_pages
            self._residual = self.key_caches + self.value_caches
            return
        shape = (self.num_blocks, self.block_size, self.num_kv_heads, kernels.kv_head_width(self.kv_dtype, self.cfg.head_dim))
        cache_dtype = kernels.kv_cache_torch_dtype(self.kv_dtype, self.dtype)
        self.key_caches = alloc(shape, cache_dtype)
        self.value_caches = alloc(shape, cache_dtype)
        if self.kv_dtype == "int8":
            self.k_scale_caches = alloc(shape[:3], torch.float32)
            self.v_scale_caches = alloc(shape[:3], torch.float32)
        every = self.key_caches + self.value_caches + self.k_scale_caches + self.v_scale_caches
        self._unique_kv = list({id(t): t for t in every}.values())
        self._residual = []

    def _kv_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the main pool's blocks once (hybrid groups share them), as allocated: K/V
        and their scales, or kivi2's pages (its residual: `_residual`)."""
        return self._unique_kv

    def _offload_store(self, num_bytes: int | None, directory: str | None):
        """The offload tier's storage (llmopt/worker/offload.py), or None."""
        if num_bytes is None:
            return None
        from llmopt.cache.offload import offload_path   # deferred: start-up time, --kv-offload-bytes only
        from llmopt.worker.offload import HASH_BYTES, OffloadStore
        block_bytes = sum(t[0].nbytes for t in self._kv_tensors())
        slots = int(num_bytes) // (block_bytes + HASH_BYTES)   # each slot: the block's hash, then its bytes
        if slots < 1:
            raise UserInputError(f"--kv-offload-bytes {num_bytes:,} holds no block of {block_bytes:,} bytes (all layers)")
        path = offload_path(directory, self._layout_key()) if directory is not None else None
        return OffloadStore(self._kv_tensors(), slots, path)

    def _layout_key(self) -> str:
        """A digest of what decides a block's bytes: the checkpoint (its files' names, sizes and
        times), the modules as run, the dtypes, the block size and every KV tensor's layout."""
        import hashlib   # deferred: start-up time, --kv-offload-bytes only
        import json
        loaded = self.loaded
        files = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in loaded.path.iterdir() if f.is_file())
        if loaded.gguf is not None:
            files.append((str(loaded.gguf), loaded.gguf.stat().st_size, loaded.gguf.stat().st_mtime_ns))
        modules = [(n, list(t.shape), str(t.dtype)) for n, t in self.model.state_dict().items()]
        kv = [(list(t.shape[1:]), str(t.dtype)) for t in self._kv_tensors()]   # a block's layout, not how many
        blob = json.dumps([str(loaded.path.resolve()), files, modules, str(self.dtype), self.kv_dtype, self.block_size,
                           kv], default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    def kv_cache_info(self) -> KVCacheInfo:
        tensors = self._kv_tensors()
        info = KVCacheInfo(self.num_blocks, self.block_size, self.num_layers, self.kv_dtype,
                           self.bytes_per_block, sum(t.nbytes for t in tensors + self._residual), self.block_layers,
                           [g.window for g in self.kv_groups], num_residual_blocks=self.num_residual_blocks,
                           residual_bytes_per_block=self.residual_bytes_per_block)
        if self.offload is not None:
            info.offload_slots, info.offload_block_bytes = self.offload.num_slots, self.offload.block_bytes
            info.offload_restored = self.offload.found
        return info

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a shared partial block)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for t in self._kv_tensors():
            t[dst] = t[src]

    def kivi_work(self, copies: list[tuple[int, int]], converts: list[tuple[int, int]]) -> None:
        """KIVI: copy residual blocks src -> dst, then quantize residual blocks into main-pool pages,
        in every layer."""
        if copies:
            src = torch.tensor([p[0] for p in copies], device=self.device)
            dst = torch.tensor([p[1] for p in copies], device=self.device)
            for t in self._residual:
                t[dst] = t[src]
        if converts:
            res = torch.tensor([p[0] for p in converts], device=self.device)
            page = torch.tensor([p[1] for p in converts], device=self.device)
            for i in range(self.num_layers):
                kivi_kernels.convert_blocks(self.key_caches[i], self.value_caches[i], self.key_pages[i],
                                            self.value_pages[i], res, page)

    def check_health(self) -> None:
        """One process: nothing outside it can die."""

    def shutdown(self) -> None:
        """One process: nothing outlives the engine but a disk tier's lock, released here."""
        if self.offload is not None:
            self.offload.close()

    # -- one step --------------------------------------------------------------------------------
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """`execute`, with the target's hidden states of every scheduled token when the step asks
        for them (`out.hidden_layers`): the model keeps them for this forward only."""
        m = self.model
        m.capture_hidden, m.captured = out.hidden_layers, None
        try:
            logits, scored = self._run(out)
            got = m.captured
        finally:
            m.capture_hidden, m.captured = None, None
        return ModelRunnerOutput(logits, None if got is None else HiddenStates(got[0], list(got[1])), scored)

    def execute(self, out: SchedulerOutput) -> torch.Tensor:
        """Copy the blocks the scheduler asked for (copy-on-write), run the scheduled tokens; return
        float32 logits [sum of num_logits, vocab] in schedule order."""
        return self._run(out)[0]

    @torch.inference_mode()
    def _run(self, out: SchedulerOutput) -> tuple[torch.Tensor, dict[str, ScoredTokens]]:
        """`execute`, and the prompt positions scored where the step asks (`prompt_targets`): those
        steps take the model's own forward (the fast paths return logits rows, not hidden states)."""
        try:   # the cache's own moves first: a failure leaves pages the prefix cache vouches for unwritten
            if self.offload is not None:   # saves read blocks before loads (or this step) overwrite them
                self.offload.save(out.kv_saves)
                self.offload.load(out.kv_loads)
            self.kivi_work(out.kivi_copies, out.kivi_converts)
        except Exception as e:   # not rerun request by request (the engine's _isolate): the cache is unknown
            raise EngineDeadError(f"the step's KV-cache transfers failed: {type(e).__name__}: {e}") from e
        self.copy_blocks(out.blocks_to_copy)
        sched = out.scheduled
        if not sched:
            return torch.empty(0, self.cfg.vocab_size), {}
        dev, bs = self.device, self.block_size
        tokens: list[int] = []
        for s in sched:
            tokens.extend(s.token_ids)
        n_new = torch.tensor([len(s.token_ids) for s in sched])
        starts = torch.tensor([s.start_pos for s in sched])
        qsl = torch.zeros(len(sched) + 1, dtype=torch.int32)
        torch.cumsum(n_new, 0, out=qsl[1:])
        seq_idx = torch.repeat_interleave(torch.arange(len(sched)), n_new)
        positions = torch.arange(len(tokens)) - qsl[:-1].long()[seq_idx] + starts[seq_idx]
        width = max(len(s.block_ids) for s in sched)
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in sched], dtype=torch.int32)
        slots = tables[seq_idx, positions // bs].long() * bs + positions % bs
        logit_rows = torch.cat([torch.arange(int(qsl[i + 1]) - s.num_logits, int(qsl[i + 1]))
                                for i, s in enumerate(sched)])

        a = self.attn
        quant = None if self.kivi is None else \
            torch.tensor([s.num_quantized_blocks for s in sched], dtype=torch.int32).to(dev, non_blocking=True)
        a.set_step(slots.to(dev, non_blocking=True), tables.to(dev, non_blocking=True),
                   (starts + n_new).to(torch.int32).to(dev, non_blocking=True), qsl.to(dev, non_blocking=True), quant)
        if len(self.kv_groups) > 1:   # every later group's own tables and slots
            steps = []
            for g in range(1, len(self.kv_groups)):
                ids = [s.group_block_ids[g] for s in sched]
                t = torch.tensor([b + [0] * (width - len(b)) for b in ids], dtype=torch.int32)
                sl = t[seq_idx, positions // bs].long() * bs + positions % bs
                steps.append((sl.to(dev, non_blocking=True), t.to(dev, non_blocking=True)))
            a.set_group_steps(steps)
        ids = torch.tensor(tokens, dtype=torch.long).to(dev, non_blocking=True)
        decode = len(tokens) == len(sched) and all(s.num_logits == 1 for s in sched)
        c, f = self.compiled, self.cpu_decode
        scoring = [(int(qsl[i]) + s.prompt_offset, s) for i, s in enumerate(sched) if s.prompt_targets]
        if c is not None and decode and len(sched) <= c.max_batch and out.hidden_layers is None and not scoring:
            return c.run(ids, positions.to(dev, non_blocking=True), a), {}   # decode only: the compiled step
        long_chunk = any(len(s.token_ids) >= 64 and s.start_pos + len(s.token_ids) > defaults.CPU_DECODE_MAX_CHUNK_CONTEXT
                         for s in sched)
        if f is not None and len(tokens) <= f.max_rows and not scoring and not long_chunk:
            # one row per token (decode, speculative verification and prefill chunks), each with
            # its sequence's block table and its own context length (the step's K/V all written first)
            every = all(s.num_logits == len(s.token_ids) for s in sched)
            return f.run(ids, positions, a if decode else f.rows_context(a, seq_idx, positions),
                         self.key_caches, self.value_caches, None if every else logit_rows, self.k_scale, self.v_scale,
                         self.k_scale_caches, self.v_scale_caches,
                         None if self.kivi is None else (self.key_pages, self.value_pages)), {}
        hidden = self.model(ids, positions.to(dev, non_blocking=True), a)
        return self.model.compute_logits(hidden[logit_rows.to(dev)]).float(), self._score(hidden, scoring)

    def _score(self, hidden: torch.Tensor, scoring: list) -> dict[str, ScoredTokens]:
        """The step's scored rows of every request asking the same top k, through the LM head at
        once (one pass over its weights, not one per request), split back per request."""
        scored: dict[str, ScoredTokens] = {}
        for k in sorted({s.prompt_top_k for _, s in scoring}):
            group = [(row, s) for row, s in scoring if s.prompt_top_k == k]
            rows = torch.cat([torch.arange(row, row + len(s.prompt_targets)) for row, s in group])
            targets = torch.tensor([t for _, s in group for t in s.prompt_targets])
            got = score_tokens(self.model, hidden[rows.to(hidden.device)], targets, k)
            sizes = [len(s.prompt_targets) for _, s in group]
            parts = zip(*(x.split(sizes) for x in (got.logprobs, got.ranks, got.top_ids, got.top_logprobs)))
            for (_, s), part in zip(group, parts):
                scored[s.request_id] = ScoredTokens(*part)
        return scored
