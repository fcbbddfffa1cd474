"""ModelArch: the architecture facts memory planning needs, parsed from a Hugging Face style config
dict (sources.py turns a config.json, a .gguf's metadata, the HF cache or a preset into one), so
`--num-layers`/`--num-kv-heads`/... overrides work the same on every source."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.estimate.tensors import TensorInfo
from llmopt.models.config import parse_hf_config, resolve_dtype_name, text_config


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
class ModelArch:
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
    dtype: str = ""                   # what the model runs in; "" until resolved (then the checkpoint's)
    weight_dtype: str = ""            # how its float weights are held (16-bit on the CPU: models/config.py)
    mla: MLA | None = None
    moe: MoE | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    quantization_config: dict | None = None
    tensors: list[TensorInfo] | None = None   # the file's real tensors, when it was read
    config: dict[str, Any] = field(default_factory=dict, repr=False)
    note: str = ""

    def __post_init__(self) -> None:
        if not self.dtype:           # `auto` on a GPU: the checkpoint's dtype (models/config.py)
            self.dtype = resolve_dtype_name("auto", "cuda", self.checkpoint_dtype)
        if not self.weight_dtype:
            self.weight_dtype = self.dtype

    @property
    def attention(self) -> str:
        if self.mla:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "MHA" if self.num_kv_heads == self.num_attention_heads else "GQA"

    @property
    def serving_dtype(self) -> str:
        """The model's compute dtype: what a KV cache dtype of `auto` means (estimate() resolves it
        for the device planned, as the engine does)."""
        return self.dtype


OVERRIDE_KEYS = {  # --flag name -> config.json key
    "num_layers": "num_hidden_layers", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
    "intermediate_size": "intermediate_size", "vocab_size": "vocab_size", "sliding_window": "sliding_window",
    "max_position_embeddings": "max_position_embeddings", "kv_lora_rank": "kv_lora_rank",
    "qk_rope_head_dim": "qk_rope_head_dim",
}


def arch_from_config(d: dict[str, Any], name: str, source: str, origin: str, note: str = "") -> ModelArch:
    """The shared parser (models/config.py: parse_hf_config) plus what only planning needs: MLA, MoE,
    Gemma's four norms per layer."""
    d = text_config(d)
    hf = parse_hf_config(d, origin)
    mt, inter = hf.model_type, hf.intermediate_size
    try:
        mla = None
        if d.get("kv_lora_rank"):
            mla = MLA(int(d["kv_lora_rank"]), int(d.get("qk_rope_head_dim") or 64),
                      int(d.get("qk_nope_head_dim") or 128), int(d.get("v_head_dim") or 128),
                      int(d["q_lora_rank"]) if d.get("q_lora_rank") else None)
        moe = None
        if d.get("num_local_experts"):
            moe = MoE(int(d["num_local_experts"]), int(d.get("num_experts_per_tok") or 2), inter, 0, 0, "mixtral")
        elif d.get("n_routed_experts"):
            mi = int(d["moe_intermediate_size"])
            moe = MoE(int(d["n_routed_experts"]), int(d["num_experts_per_tok"]), mi,
                      mi * int(d.get("n_shared_experts") or 0), int(d.get("first_k_dense_replace") or 0), "deepseek")
        elif d.get("num_experts") and d.get("moe_intermediate_size"):
            moe = MoE(int(d["num_experts"]), int(d["num_experts_per_tok"]), int(d["moe_intermediate_size"]),
                      int(d.get("shared_expert_intermediate_size") or 0), 0, "qwen")
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{origin}: MLA/MoE config lacks a valid {e}") from e
    return ModelArch(
        name=name, source=source, origin=origin, model_type=mt, num_layers=hf.num_hidden_layers,
        hidden_size=hf.hidden_size, num_attention_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads, head_dim=hf.head_dim, intermediate_size=inter,
        vocab_size=hf.vocab_size, max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings, checkpoint_dtype=hf.torch_dtype,
        layer_windows=hf.layer_windows, mla=mla, moe=moe, qkv_bias=hf.qkv_bias, o_bias=hf.o_bias,
        qk_norm=hf.qk_norm, norms_per_layer=4 if mt in ("gemma2", "gemma3", "gemma3_text") else 2,
        quantization_config=hf.quantization_config, config=dict(d), note=note)


def apply_overrides(arch: ModelArch, overrides: dict[str, Any]) -> ModelArch:
    """`--num-layers`, `--num-kv-heads`, ... re-parse the config with the new values.
    `--sliding-window W` is a what-if on the parsed windows, whatever the model type would make of a
    `sliding_window` key: the layers that slide get W, every layer when none does; 0 removes them."""
    given = {k: v for k, v in overrides.items() if v is not None}
    if not given:
        return arch
    d = dict(arch.config)
    for k, v in given.items():
        if k not in OVERRIDE_KEYS:
            raise UserInputError(f"unknown override {k!r}: use one of {', '.join(OVERRIDE_KEYS)}")
        if k == "sliding_window":
            if not isinstance(v, int) or v < 0:
                raise UserInputError(f"--sliding-window must be a non-negative integer (0: none), got {v!r}")
            continue
        if not isinstance(v, int) or v <= 0:
            raise UserInputError(f"--{k.replace('_', '-')} must be a positive integer, got {v!r}")
        d[OVERRIDE_KEYS[k]] = v
    if "num_layers" in given and d.get("layer_types"):
        d.pop("layer_types")      # re-derive the pattern for the new depth
    out = arch_from_config(d, arch.name, arch.source, arch.origin, arch.note)
    out.dtype, out.weight_dtype = arch.dtype, arch.weight_dtype
    if "sliding_window" in given:
        w = given["sliding_window"]
        slides = [x is not None for x in out.layer_windows]
        if not any(slides):
            slides = [True] * out.num_layers
        out.layer_windows = [w if s and w else None for s in slides]
    out.note = (arch.note + "; " if arch.note else "") + "overridden: " + ", ".join(f"{k}={v}" for k, v in given.items())
    return out      # tensors dropped: the file's shapes no longer describe this model
