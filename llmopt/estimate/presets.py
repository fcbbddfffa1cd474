"""Built-in model and GPU presets for `llmopt kv-estimate`, each with the source of its numbers.

A model preset is the architecture part of the model's published Hugging Face `config.json`
(same keys), so a preset and a downloaded checkpoint go through the same parser. Presets are
addressable by their Hugging Face id (`meta-llama/Llama-3.1-70B`) or a short name
(`llama-3.1-70b`), case-insensitively.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmopt.errors import UserInputError

HF = "https://huggingface.co/{}/blob/main/config.json"


@dataclass(frozen=True)
class ModelPreset:
    hf_id: str
    short: str
    config: dict[str, Any]
    source: str = ""
    note: str = ""

    @property
    def url(self) -> str:
        return self.source or HF.format(self.hf_id)


def _llama(layers, hidden, heads, kv, inter, vocab, max_pos, **kw) -> dict[str, Any]:
    d = {"model_type": "llama", "num_hidden_layers": layers, "hidden_size": hidden,
         "num_attention_heads": heads, "num_key_value_heads": kv, "intermediate_size": inter,
         "vocab_size": vocab, "max_position_embeddings": max_pos, "tie_word_embeddings": False,
         "torch_dtype": "bfloat16"}
    d.update(kw)
    return d


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

MODEL_PRESETS: list[ModelPreset] = [
    ModelPreset("meta-llama/Llama-2-7b-hf", "llama-2-7b",
                _llama(32, 4096, 32, 32, 11008, 32000, 4096, torch_dtype="float16"),
                note="multi-head attention (32 KV heads)"),
    ModelPreset("meta-llama/Llama-3.1-8B", "llama-3.1-8b",
                _llama(32, 4096, 32, 8, 14336, 128256, 131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
                note="GQA 32:8"),
    ModelPreset("meta-llama/Llama-3.1-70B", "llama-3.1-70b",
                _llama(80, 8192, 64, 8, 28672, 128256, 131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
                note="GQA 64:8"),
    ModelPreset("mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1",
                _llama(32, 4096, 32, 8, 14336, 32000, 32768, model_type="mistral", sliding_window=4096),
                note="GQA 32:8, every layer a 4,096-token sliding window"),
    ModelPreset("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b",
                _llama(32, 4096, 32, 8, 14336, 32000, 32768, model_type="mixtral", sliding_window=None,
                       num_local_experts=8, num_experts_per_tok=2, rope_theta=1000000.0),
                note="MoE, 8 experts, top-2"),
    ModelPreset("Qwen/Qwen2.5-7B", "qwen2.5-7b",
                _llama(28, 3584, 28, 4, 18944, 152064, 131072, model_type="qwen2", rope_theta=1000000.0,
                       sliding_window=131072, use_sliding_window=False, max_window_layers=28),
                note="GQA 28:4, q/k/v bias"),
    ModelPreset("Qwen/Qwen3-8B", "qwen3-8b",
                _llama(36, 4096, 32, 8, 12288, 151936, 40960, model_type="qwen3", head_dim=128,
                       rope_theta=1000000.0, sliding_window=None, use_sliding_window=False),
                note="GQA 32:8, q/k RMSNorm"),
    ModelPreset("deepseek-ai/DeepSeek-V3", "deepseek-v3",
                _llama(61, 7168, 128, 128, 18432, 129280, 163840, model_type="deepseek_v3",
                       kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
                       v_head_dim=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                       moe_intermediate_size=2048, first_k_dense_replace=3, moe_layer_freq=1,
                       quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}),
                note="MLA (one 512+64 latent per token per layer), MoE 256 experts top-8; FP8 block-scaled "
                     "checkpoint; the multi-token-prediction layer is not counted"),
    ModelPreset("google/gemma-2-9b-it", "gemma-2-9b",
                _llama(42, 3584, 16, 8, 14336, 256000, 8192, model_type="gemma2", head_dim=256,
                       sliding_window=4096, tie_word_embeddings=True, query_pre_attn_scalar=256,
                       hidden_activation="gelu_pytorch_tanh"),
                note="alternating 4,096-token sliding-window and global layers (21 + 21)"),
    ModelPreset("google/gemma-3-27b-it", "gemma-3-27b",
                _llama(62, 5376, 32, 16, 21504, 262208, 131072, model_type="gemma3_text", head_dim=128,
                       sliding_window=1024, sliding_window_pattern=6, tie_word_embeddings=True,
                       query_pre_attn_scalar=168, hidden_activation="gelu_pytorch_tanh"),
                note="5 sliding-window (1,024) layers per global layer; text decoder only (the "
                     "vision tower is not counted)"),
    ModelPreset("HuggingFaceTB/SmolLM2-135M", "smollm2-135m",
                _llama(30, 576, 9, 3, 1536, 49152, 8192, rope_theta=100000.0, tie_word_embeddings=True),
                note="GQA 9:3, tied embeddings (the default model's architecture)"),
    ModelPreset("HuggingFaceTB/SmolLM2-1.7B", "smollm2-1.7b",
                _llama(24, 2048, 32, 32, 8192, 49152, 8192, rope_theta=130000.0, tie_word_embeddings=True),
                note="multi-head attention, tied embeddings"),
]


def find_model_preset(name: str) -> ModelPreset | None:
    key = name.strip().lower()
    for p in MODEL_PRESETS:
        if key in (p.hf_id.lower(), p.short, p.hf_id.split("/")[-1].lower()):
            return p
    return None


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_mib: int               # total memory as the driver reports it (nvidia-smi / cudaMemGetInfo)
    source: str
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


_SMI = "nvidia-smi memory.total of an idle {} (what vLLM's gpu_memory_utilization multiplies)"
GPU_PRESETS: list[GpuPreset] = [
    GpuPreset("H100-80GB", 81559, _SMI.format("NVIDIA H100 80GB HBM3"), ("h100", "h100-sxm", "h800")),
    GpuPreset("H200", 143771, _SMI.format("NVIDIA H200 (141 GB HBM3e)"), ("h200-141gb",)),
    GpuPreset("A100-40GB", 40960, _SMI.format("NVIDIA A100-SXM4-40GB"), ("a100-40g",)),
    GpuPreset("A100-80GB", 81920, _SMI.format("NVIDIA A100-SXM4-80GB"), ("a100", "a100-80g")),
    GpuPreset("L40S", 46068, _SMI.format("NVIDIA L40S (48 GB GDDR6)"), ()),
    GpuPreset("L4", 23034, _SMI.format("NVIDIA L4 (24 GB GDDR6)"), ()),
    GpuPreset("RTX-4090", 24564, _SMI.format("NVIDIA GeForce RTX 4090 (24 GB GDDR6X)"), ("4090", "rtx4090")),
]


def find_gpu(name: str) -> GpuPreset:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for g in GPU_PRESETS:
        if key == g.name.lower() or key in g.aliases:
            return g
    raise UserInputError(f"unknown --gpu {name!r}: use one of {', '.join(g.name for g in GPU_PRESETS)}, "
                         f"or give --gpu-memory GiB")
