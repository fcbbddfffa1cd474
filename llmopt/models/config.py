"""ModelConfig: the architecture facts the runtime needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Any

from llmopt.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None          # {"rope_type": "llama3" | "linear" | "default", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                     # qwen2: bias on q, k, v
    o_bias: bool = False                       # llama attention_bias=True: bias on o as well
    mlp_bias: bool = False
    qk_norm: bool = False                      # qwen3: RMSNorm on q and k heads before RoPE
    layer_windows: list[int | None] = field(default_factory=list)  # sliding window per layer (None = full)
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    quantization_config: dict | None = None
    hidden_act: str = "silu"

    @property
    def sliding_window(self) -> int | None:
        windows = [w for w in self.layer_windows if w]
        return max(windows) if windows else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {mt!r}: llmopt runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(f"unsupported hidden_act {d.get('hidden_act')!r}: only silu is implemented")
        hidden = d["hidden_size"]
        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or hidden // heads
        rope = d.get("rope_parameters") or {}
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
        if scaling is not None:
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in ("default", "linear", "llama3"):
                raise ModelLoadError(f"unsupported rope_scaling type {rtype!r}: llmopt implements default, linear and llama3")
            scaling = dict(scaling, rope_type=rtype)
            if rtype == "default":
                scaling = None
        n_layers = d["num_hidden_layers"]
        windows: list[int | None] = [None] * n_layers
        sw = d.get("sliding_window")
        layer_types = d.get("layer_types")
        if mt == "mistral" and sw:
            windows = [int(sw)] * n_layers
        elif mt in ("qwen2", "qwen3") and d.get("use_sliding_window") and sw:
            if layer_types:
                windows = [int(sw) if t == "sliding_attention" else None for t in layer_types]
            else:
                mwl = d.get("max_window_layers", n_layers)
                windows = [int(sw) if i >= mwl else None for i in range(n_layers)]
        elif layer_types and sw and mt == "llama":
            windows = [int(sw) if t == "sliding_attention" else None for t in layer_types]
        attention_bias = bool(d.get("attention_bias", False))
        if mt == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias, o_bias = attention_bias, attention_bias
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=hidden,
            intermediate_size=d["intermediate_size"], num_hidden_layers=n_layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(d.get("mlp_bias", False)),
            qk_norm=(mt == "qwen3"), layer_windows=windows,
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
            bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
            quantization_config=d.get("quantization_config"),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ModelLoadError(f"no config.json in {p.parent}: point --model at a Hugging Face checkpoint folder")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{p} is not valid JSON: {e}") from e
        return cls.from_hf_dict(d)
