"""The Llama family in one file: llama, mistral (sliding window), qwen2 (qkv bias), qwen3 (q/k norm).

Module and parameter names mirror Hugging Face's, so checkpoints (and quantized checkpoints, whose
linear layers are swapped by llmopt.quant before loading) map one to one. The forward takes token
ids, positions and an attention context (see attention.py) and returns hidden states;
`compute_logits` applies the head, so callers can score only the positions they need.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt import kernels
from llmopt.models.config import ModelConfig
from llmopt.layers.fuse import Fused, call_fused, fuse
from llmopt.layers.runtime import trim_heap

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "int | None"], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
        if _fused(x, backend):
            return kernels.rms_norm(x, self.weight, self.eps, backend=backend)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies for RoPE, with the `linear` and `llama3` scalings (`freq_factors`: a GGUF's
    rope_freqs.weight, the llama3 scaling as llama.cpp stores it: each frequency divided by its factor)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if not s:
        return inv
    if s["rope_type"] == "linear":
        return inv / s["factor"]
    if s["rope_type"] == "freq_factors":
        return inv / torch.tensor(s["factors"], dtype=torch.float32)
    # llama3: low frequencies divided by `factor`, high kept, a smooth ramp between.
    factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    lo_wavelen, hi_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > lo_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= hi_wavelen) & (wavelen <= lo_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _backend(attn) -> str:
    """The kernel backend an attention context carries (`attn.backend`, the engine's
    --attention-backend); "auto" for contexts without one."""
    return getattr(attn, "backend", "auto")


def _fused(x: torch.Tensor, backend: str) -> bool:
    """Use llmopt.kernels' fused RMSNorm/rotary: on CUDA (Triton unless the backend is torch)
    or when the triton backend is chosen explicitly; never where autograd needs the graph."""
    return (x.is_cuda or backend == "triton") and not (torch.is_grad_enabled() and x.requires_grad)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [..., heads, head_dim]; cos/sin: [..., head_dim]."""
    h = x.shape[-1] // 2
    # rotate_half(x) = roll(x, h) with its first half negated: fold the sign into sin (a [..., d]
    # tensor, not [..., heads, d]) and finish in one addcmul: three passes over x instead of five
    signed_sin = torch.cat((-sin[..., :h], sin[..., h:]), dim=-1).unsqueeze(-2)
    return torch.addcmul(x * cos.unsqueeze(-2), x.roll(h, -1), signed_sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self._qkv: Fused | None = None

    def fuse_qkv(self) -> bool:
        """One [q; k; v] GEMM instead of three (the narrow k/v ones run far below the CPU's peak):
        float weights, or quantized ones in one layout (one kernel call), concatenated once with
        q/k/v_proj's tensors left as views into them (llmopt/layers/fuse.py)."""
        self._qkv = fuse(self, ("q_proj", "k_proj", "v_proj"))
        return self._qkv is not None

    def _project(self, x: torch.Tensor):
        return call_fused(self, "_qkv", x) or (self.q_proj(x), self.k_proj(x), self.v_proj(x))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionFn,
                q_from: int = 0) -> torch.Tensor:
        """q_from > 0: outputs only for the tokens from q_from on (along the last token dim; K/V for
        all of them), for callers that need the last layer's output at a suffix only."""
        lead = x.shape[:-1]
        q, k, v = self._project(x)
        if q_from:
            q, cos_q, sin_q = (t[..., q_from:, :] for t in (q, cos, sin))
        else:
            cos_q, sin_q = cos, sin
        q_lead = q.shape[:-1]
        q = q.reshape(*q_lead, self.num_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        backend = _backend(attn)
        if self.q_norm is not None:
            q, k = self.q_norm(q, backend), self.k_norm(k, backend)
        if _fused(q, backend) and not q_from:
            d = self.head_dim
            cs = [torch.broadcast_to(t, (*lead, d)).reshape(-1, d) for t in (cos, sin)]
            q, k = kernels.rotary(q.reshape(-1, self.num_heads, d), k.reshape(-1, self.num_kv_heads, d), *cs,
                                  backend=backend)
            q, k = q.view(*lead, self.num_heads, d), k.view(*lead, self.num_kv_heads, d)
        else:
            q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos, sin)
        o = attn(self.layer_idx, q, k, v, self.window)
        return self.o_proj(o.reshape(*q_lead, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)
        self._gate_up: Fused | None = None

    def fuse_gate_up(self) -> bool:
        """One kernel call for quantized gate/up (float ones stay two GEMMs: one measured no faster)."""
        self._gate_up = fuse(self, ("gate_proj", "up_proj"), floats=False)
        return self._gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = call_fused(self, "_gate_up", x) or (self.gate_proj(x), self.up_proj(x))
        if torch.is_grad_enabled():
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(g, inplace=True).mul_(u))   # no two [tokens, intermediate] temporaries


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp=None) -> None:
        super().__init__()
        self.tp = tp   # tensor parallel: o_proj and down_proj give partial sums, all-reduced here
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attn: AttentionFn, q_from: int = 0) -> torch.Tensor:
        backend = _backend(attn)
        h = self.self_attn(self.input_layernorm(x, backend), cos, sin, attn, q_from)
        if self.tp is not None:
            h = self.tp.all_reduce(h)
        x = (x[..., q_from:, :] if q_from else x) + h
        m = self.mlp(self.post_attention_layernorm(x, backend))
        return x + (self.tp.all_reduce(m) if self.tp is not None else m)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, tp=None) -> None:
        """tp: a llmopt.distributed.parallel.TPGroup: build this rank's shard (its heads, MLP width and
        vocabulary rows, llmopt/distributed/plan.py); `config` stays the whole model's."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        local = tp.plan.local_config(cfg) if tp is not None else cfg
        self.model = LlamaModel(local, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, local.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        # Speculative decoding (llmopt.speculative, EAGLE): None = off; a tuple of layer indices = after each
        # forward, `captured` holds (final hidden [*, hidden], [the hidden state entering each listed layer])
        self.capture_hidden: tuple[int, ...] | None = None
        self.captured: tuple[torch.Tensor, list[torch.Tensor]] | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:   # vocabulary-parallel: each rank holds a slice of the rows
            return self.tp.embed(self.model.embed_tokens, input_ids)
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                inputs_embeds: torch.Tensor | None = None, suffix_from: int = 0) -> torch.Tensor:
        """Hidden states after the final norm, shape [*input_ids.shape, hidden].

        suffix_from > 0: only the positions from there on (along the last token dim) are returned,
        and the last layer computes its queries, attention and MLP for those only (eval-ppl's
        sliding windows score a suffix). The attention context must accept fewer queries than keys
        (`supports_query_suffix`)."""
        if suffix_from and not getattr(attn, "supports_query_suffix", False):
            raise ValueError(f"{type(attn).__name__} cannot attend from a suffix of the queries")
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rope_cos_sin(self.inv_freq, positions, x.dtype)
        last = len(self.model.layers) - 1
        capture, aux = self.capture_hidden, []
        for i, layer in enumerate(self.model.layers):
            if capture is not None and i in capture:
                aux.append(x)
            x = layer(x, cos, sin, attn, suffix_from if i == last else 0)
        x = self.model.norm(x, _backend(attn))
        if capture is not None:
            self.captured = (x, aux)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:   # each rank's vocabulary slice, gathered on every rank
            return self.tp.gather_logits(self.lm_head(hidden))
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device) -> set[str]:
        """Fill parameters (on meta or real storage) from (HF name, tensor) pairs; returns the names
        it set. This is the one place a tensor-parallel rank slices its shard (`self.tp`; the
        tensors may then be safetensors slices, of which only the rank's part is read), but for a
        GGUF's tensors run as stored, which gguf_weights.install slices as it builds their modules."""
        params = dict(self.named_parameters(remove_duplicate=False))
        buffers = dict(self.named_buffers())
        aliases = _checkpoint_aliases(self)
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            name = aliases.get(name, name)
            if name not in params and name not in buffers:
                if self.config.tie_word_embeddings and name == "lm_head.weight":
                    continue
                raise KeyError(name)
            target = params.get(name, buffers.get(name))
            if self.tp is not None:
                tensor = self.tp.shard(name, tensor, self.config.quantization_config)
            keep_dtype = target.dtype if not target.is_floating_point() else dtype
            owner, _, attr = name.rpartition(".")
            module = self.get_submodule(owner)   # (now: a GGUF's install swaps modules as it streams)
            if attr in getattr(module, "held_in_own_dtype", ()):
                keep_dtype = getattr(module, attr).dtype   # 16-bit weights on the CPU (llmopt.layers.modules16)
            if name in buffers and getattr(module, "keep_checkpoint_dtype", False):
                keep_dtype = tensor.dtype   # quantized modules (llmopt.layers.modules): fp16 scales, fp8 codes as stored
            if tuple(target.shape) != tuple(tensor.shape) and attr not in getattr(module, "free_shape", ()):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(target.shape)}")
            new = tensor.to(device=device, dtype=keep_dtype)
            _set_tensor(self, name, new, is_param=name in params)
            loaded.add(name)
        if self.config.tie_word_embeddings and isinstance(self.lm_head, nn.Linear):   # (a GGUF table ties itself)
            self.lm_head.weight = self.model.embed_tokens.weight
            loaded.add("lm_head.weight")
        for module in self.modules():   # quantized modules check their buffers and prepare their kernels
            if hasattr(module, "finish_loading"):
                module.finish_loading()
        trim = any(hasattr(m, "cpu_codes") or getattr(m, "held_in_own_dtype", None) for m in self.modules())
        for layer in self.model.layers:
            layer.self_attn.fuse_qkv()
            layer.mlp.fuse_gate_up()
            if trim:   # (CPU repacked layers: their cpu_codes; 16-bit ones, copied as read)
                trim_heap()   # the layer's unfused tensors: freed holes the next layer's cannot reuse
        return loaded


def _checkpoint_aliases(root: nn.Module) -> dict[str, str]:
    """Checkpoint name -> parameter/buffer name, for modules whose checkpoint names hold dots a
    buffer name cannot (`checkpoint_names`: local checkpoint name -> buffer name; e.g. bitsandbytes'
    `weight.absmax`, llmopt.layers.modules_bnb). A module's `free_shape` buffers take the
    checkpoint's shape (sizes only the tensors themselves say)."""
    return {f"{mod}.{ck}" if mod else ck: f"{mod}.{buf}" if mod else buf
            for mod, m in root.named_modules() for ck, buf in getattr(m, "checkpoint_names", {}).items()}


def _set_tensor(root: nn.Module, name: str, value: torch.Tensor, is_param: bool) -> None:
    mod_name, _, attr = name.rpartition(".")
    mod = root.get_submodule(mod_name) if mod_name else root
    if is_param:
        old = getattr(mod, attr)
        setattr(mod, attr, nn.Parameter(value, requires_grad=False) if isinstance(old, nn.Parameter) else value)
    else:
        mod._buffers[attr] = value
