"""ModelSpec: the architecture facts memory planning needs, parsed from a Hugging Face style config
dict (sources.py turns a config.json, a .gguf's metadata, the HF cache or a preset into one), so
`--num-layers`/`--num-kv-heads`/... overrides work the same on every source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.estimate.tensors import TensorInfo


@dataclass
class MLA:
    """DeepSeek multi-head latent attention: one compressed latent + one RoPE key per token."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None


@dataclass
class MoE:
    num_experts: int
    experts_per_tok: int
    intermediate_size: int            # per routed expert
    shared_intermediate_size: int     # all shared experts together (0: none)
    first_dense_layers: int           # layers [0, k) use the dense MLP (DeepSeek first_k_dense_replace)
    naming: str                       # "mixtral" | "deepseek" | "qwen": how the expert weights are named


@dataclass
class ModelSpec:
    name: str
    source: str                       # preset | config | gguf | hf-cache | builtin
    origin: str                       # URL of the preset's numbers, or the file read
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    checkpoint_dtype: str
    layer_windows: list[int | None]
    mla: MLA | None = None
    moe: MoE | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    quantization_config: dict | None = None
    tensors: list[TensorInfo] | None = None   # the file's real tensors, when it was read
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    note: str = ""

    @property
    def attention(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"

    @property
    def serving_dtype(self) -> str:
        """What `auto` means: the checkpoint dtype; float32 checkpoints are served in bfloat16 (as vLLM
        does on GPUs); a GGUF's KV cache defaults to float16 (llama.cpp's default cache type)."""
        if self.source in ("gguf", "builtin"):
            return "float16"
        return "bfloat16" if self.checkpoint_dtype in ("float32", "float") else self.checkpoint_dtype


OVERRIDE_KEYS = {  # --flag name -> config.json key
    "num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size", "vocab_size": "vocab_size", "sliding_window": "sliding_window",
    "max_position_embeddings": "max_position_embeddings", "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
}


def _windows(d: dict[str, Any], mt: str, n: int) -> list[int | None]:
    sw = d.get("sliding_window")
    if not sw:
        return [None] * n
    sw = int(sw)
    if d.get("layer_types"):
        return [sw if t == "sliding_attention" else None for t in d["layer_types"]][:n] + [None] * (n - len(d["layer_types"]))
    if mt == "gemma2":          # transformers Gemma2Config: even layers slide, odd layers are global
        return [sw if i % 2 == 0 else None for i in range(n)]
    if mt in ("gemma3", "gemma3_text"):   # every `sliding_window_pattern`-th layer is global
        pattern = int(d.get("sliding_window_pattern") or 6)
        return [sw if (i + 1) % pattern else None for i in range(n)]
    if mt.startswith("qwen"):
        if not d.get("use_sliding_window"):
            return [None] * n
        first = int(d.get("max_window_layers", n))
        return [sw if i >= first else None for i in range(n)]
    return [sw] * n             # mistral, mixtral, llama with an explicit window: every layer


def spec_from_config(d: dict[str, Any], name: str, source: str, origin: str, note: str = "") -> ModelSpec:
    if "text_config" in d and "num_hidden_layers" not in d:
        d = {**d["text_config"], "quantization_config": d.get("quantization_config"),
             "torch_dtype": d["text_config"].get("torch_dtype") or d.get("torch_dtype")}
    try:
        mt = str(d.get("model_type") or "llama")
        n = int(d["num_hidden_layers"])
        hidden = int(d["hidden_size"])
        heads = int(d["num_attention_heads"])
        kv = int(d.get("num_key_value_heads") or heads)
        head_dim = int(d.get("head_dim") or hidden // heads)
        vocab = int(d["vocab_size"])
        inter = int(d.get("intermediate_size") or 0)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{origin}: config lacks {e} (needs num_hidden_layers, hidden_size, "
                             f"num_attention_heads, vocab_size)") from e
    for key, v in (("num_layers", n), ("hidden_size", hidden), ("num_attention_heads", heads),
                   ("num_kv_heads", kv), ("head_dim", head_dim), ("vocab_size", vocab)):
        if v <= 0:
            raise UserInputError(f"{origin}: {key} must be positive, got {v}")
    if heads % kv:
        raise UserInputError(f"{origin}: {heads} attention heads are not a multiple of {kv} KV heads")
    mla = None
    if d.get("kv_lora_rank"):
        mla = MLA(int(d["kv_lora_rank"]), int(d.get("qk_rope_head_dim") or 64), int(d.get("qk_nope_head_dim") or 128),
                  int(d.get("v_head_dim") or 128), int(d["q_lora_rank"]) if d.get("q_lora_rank") else None)
    moe = None
    if d.get("num_local_experts"):
        moe = MoE(int(d["num_local_experts"]), int(d.get("num_experts_per_tok") or 2), inter, 0, 0, "mixtral")
    elif d.get("n_routed_experts"):
        mi = int(d["moe_intermediate_size"])
        moe = MoE(int(d["n_routed_experts"]), int(d["num_experts_per_tok"]), mi, mi * int(d.get("n_shared_experts") or 0),
                  int(d.get("first_k_dense_replace") or 0), "deepseek")
    elif d.get("num_experts") and d.get("moe_intermediate_size"):
        moe = MoE(int(d["num_experts"]), int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]),
                  int(d.get("shared_expert_intermediate_size") or 0), 0, "qwen")
    return ModelSpec(
        name=name, source=source, origin=origin, model_type=mt, num_layers=n, hidden_size=hidden,
        num_attention_heads=heads, num_kv_heads=kv, head_dim=head_dim, intermediate_size=inter,
        vocab_size=vocab, max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        checkpoint_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16").replace("torch.", ""),
        layer_windows=_windows(d, mt, n), mla=mla, moe=moe,
        qkv_bias=mt in ("qwen2", "qwen2_moe") or bool(d.get("attention_bias", False)),
        qk_norm=mt in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
        norms_per_layer=4 if mt in ("gemma2", "gemma3", "gemma3_text") else 2,
        quantization_config=d.get("quantization_config"), config=dict(d), note=note)


def apply_overrides(spec: ModelSpec, overrides: dict[str, Any]) -> ModelSpec:
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return spec
    d = dict(spec.config)
    for k, v in given.items():
        if k not in OVERRIDE_KEYS:
            raise UserInputError(f"unknown override {k!r}: use one of {', '.join(OVERRIDE_KEYS)}")
        if k != "sliding_window" and (not isinstance(v, int) or v <= 0):
            raise UserInputError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        d[OVERRIDE_KEYS[k]] = v
    if "num_layers" in given and d.get("layer_types"):
        d.pop("layer_types")      # re-derive the pattern for the new depth
    if "sliding_window" in given:
        w = given["sliding_window"]
        if not isinstance(w, int) or w < 0:
            raise UserInputError(f"--sliding-window must be a non-negative integer (0: none), got {w!r}")
        d["use_sliding_window"] = bool(w)
        d["sliding_window"] = w or None
    out = spec_from_config(d, spec.name, spec.source, spec.origin, spec.note)
    out.note = (spec.note + "; " if spec.note else "") + "overridden: " + ", ".join(f"{k}={v}" for k, v in given.items())
    return out      # tensors dropped: the file's shapes no longer describe this model
