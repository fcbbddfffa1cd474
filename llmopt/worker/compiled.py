"""The compiled decode step (#14): `torch.compile` (inductor; its C++ backend on the CPU) of the
decoder layers and the head for decode-only steps of up to max(buckets) sequences.

- Per-layer graphs: one compiled graph runs every decoder layer (the same code, each layer's weights
  as graph inputs) and one the final norm and head; embedding and rotary tables stay eager. A graph
  of the whole 30-layer default model took 120 s to compile on the loaded 2-core machine, one layer
  16 s (docs/benchmarks.md).
- Batch-size buckets: a step of B sequences runs the graphs of the smallest bucket P >= B, its inputs
  padded with P - B dummy rows (token 0 at position 0). Each bucket is static-shape, compiled on
  its first use and announced with its time.
- Paged attention stays outside the graph: the graph calls the opaque op `llmopt::paged_attn(q, k,
  v)`, which reads the step's block tables, sequence lengths and slot mapping from the runner's
  attention context (set before each call, as vLLM's forward context) and attends only the step's
  B real rows. Block tables, sequence lengths and the layer index are never graph inputs or
  constants, so they never trigger a recompile.
- Small-M linear layers: a float `F.linear` whose input has at most COMPILE_GEMV_MAX_ROWS rows
  becomes a multiply-sum in the graph (an FX rewrite before inductor), which inductor turns into a
  multi-threaded reduction; the aten GEMV at M = 1 runs on one thread. Quantized modules call
  llmopt_cpu ops, which the graph calls as they are.
- Inductor's caches (FX graph, AOTAutograd, compiled C++) live under CACHE_DIR/inductor
  (TORCHINDUCTOR_CACHE_DIR unless the environment sets it), so a second process reuses them.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from llmopt import defaults
from llmopt.layers.fuse import drop_stale

log = logging.getLogger("llmopt.engine")


class _Step:
    """What the op reads: the runner's PagedAttention of the step being run, its number of real rows,
    each layer's sliding window, and the next layer's index (layers call the op in order)."""
    ctx = None
    rows = 0
    layer = 0
    windows: list = []


@torch.library.custom_op("llmopt::paged_attn", mutates_args=())
def paged_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write K/V of the step's real rows into the next layer's paged cache and attend; padding rows
    get zeros. The layer index is not an argument: as a constant of the graph it would make every
    layer a graph of its own."""
    n, i = _Step.rows, _Step.layer
    _Step.layer = i + 1
    out = q.new_zeros(q.shape)
    out[:n] = _Step.ctx(i, q[:n], k[:n], v[:n], _Step.windows[i])
    return out


@paged_attn.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class _OpAttention:
    """The attention context the compiled graph sees: every layer's call is the opaque op."""

    def __init__(self, backend: str) -> None:
        self.backend = backend

    def __call__(self, layer_idx: int, q, k, v, window):
        return paged_attn(q, k, v)


def _gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    y = (x.unsqueeze(-2) * w).sum(-1)
    return y if b is None else y + b


def _rewrite_small_linears(gm: torch.fx.GraphModule, max_rows: int) -> int:
    """F.linear(x, w[, b]) with at most max_rows rows of x -> _gemv; returns how many were rewritten."""
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch._C._nn.linear:
            continue
        x = node.args[0].meta.get("example_value") if isinstance(node.args[0], torch.fx.Node) else None
        if x is None or x.dtype != torch.float32 or x.numel() // max(1, x.shape[-1]) > max_rows:
            continue
        node.target = _gemv
        n += 1
    gm.recompile()
    return n


def _backend(max_rows: int):
    def compile_fn(gm: torch.fx.GraphModule, example_inputs):
        from torch._inductor.compile_fx import compile_fx
        _rewrite_small_linears(gm, max_rows)
        return compile_fx(gm, example_inputs)
    return compile_fn


def _layer_step(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: _OpAttention) -> torch.Tensor:
    return layer(x, cos, sin, attn)


def _head_step(model, x: torch.Tensor, attn: _OpAttention) -> torch.Tensor:
    return model.compute_logits(model.model.norm(x, attn.backend)).float()


def use_cache_dir() -> str:
    """Point inductor's caches at CACHE_DIR/inductor unless TORCHINDUCTOR_CACHE_DIR is set; the path.
    Importing inductor writes its /tmp default into the environment: that value is not the user's."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None or os.path.abspath(path) == os.path.abspath(default_cache_dir()):
        path = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(defaults.CACHE_DIR / "inductor")
    os.makedirs(path, exist_ok=True)
    return path


class CompiledDecode:
    """The compiled decode step of one runner: `run(ids, positions, attn)` for B <= max(buckets)."""

    def __init__(self, model, backend: str, device: torch.device,
                 buckets: tuple[int, ...] = defaults.COMPILE_BATCH_BUCKETS) -> None:
        self.model = model
        self.device = device
        self.buckets = tuple(sorted(set(buckets)))
        self.attn = _OpAttention(backend)
        self.compiled: set[int] = set()       # buckets whose graph has run
        self.compile_seconds: dict[int, float] = {}
        use_cache_dir()
        from llmopt.kernels import cpu_quant   # deferred: start-up time (loads the C++ kernels)
        cpu_quant.ops()          # build/load the quantized kernels now: graphs only read the result
        import torch._dynamo
        cfg = torch._dynamo.config
        # one graph per bucket for each model a process loads (the code objects are shared)
        cfg.recompile_limit = max(cfg.recompile_limit, 8 * len(self.buckets))
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 32 * len(self.buckets))
        backend_fn = _backend(defaults.COMPILE_GEMV_MAX_ROWS)
        self.layer_fn = torch.compile(_layer_step, backend=backend_fn, fullgraph=True, dynamic=False)
        self.head_fn = torch.compile(_head_step, backend=backend_fn, fullgraph=True, dynamic=False)
        self.windows = list(getattr(model.config, "layer_windows", None) or [None] * len(model.model.layers))

    @staticmethod
    def supports(model) -> bool:
        """Models whose forward is embed, rotary, a stack of `model.model.layers`, the final norm and
        the head (models/llama.py): what `_forward` replays with each layer compiled."""
        from llmopt.models.llama import LlamaForCausalLM   # deferred: start-up time (model code), CPU compile only
        return isinstance(model, LlamaForCausalLM)

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """LlamaForCausalLM.forward + compute_logits with one compiled graph serving every layer
        (same code, the layer's weights as inputs) and one for the norm and head."""
        from llmopt.models.llama import rope_cos_sin   # deferred: start-up time (model code)
        m = self.model
        x = m.embed(ids)
        cos, sin = rope_cos_sin(m.inv_freq, positions, x.dtype)
        _Step.layer = 0
        for layer in m.model.layers:
            x = self.layer_fn(layer, x, cos, sin, self.attn)
        return self.head_fn(m, x, self.attn)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        """Logits [B, vocab] float32 of a decode step of B = len(ids) sequences, one token each;
        `attn` is the runner's paged attention context with this step's metadata set."""
        n = ids.shape[0]
        p = self.bucket(n)
        if p > n:
            pad = p - n
            ids = torch.cat([ids, ids.new_zeros(pad)])
            positions = torch.cat([positions, positions.new_zeros(pad)])
        _Step.ctx, _Step.rows, _Step.windows = attn, n, self.windows
        try:
            if p in self.compiled:
                return self._forward(ids, positions)[:n]
            drop_stale(self.model)   # the eager forward checks each call that fused q/k/v, gate/up are current
            t = time.perf_counter()
            out = self._forward(ids, positions)[:n]
            dt = time.perf_counter() - t
            self.compiled.add(p)
            self.compile_seconds[p] = dt
            log.info("compiled the decode step for batch size %d in %.1f s (inductor cache: %s; "
                     "--enforce-eager turns compiling off)", p, dt, os.environ["TORCHINDUCTOR_CACHE_DIR"])
            return out
        finally:
            _Step.ctx, _Step.rows = None, 0
