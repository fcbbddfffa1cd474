"""KV-cache bytes per token for every attention layer, for each KV dtype.

Formulas (per layer, per token, for the KV heads one tensor-parallel rank holds):
- MHA / GQA / MQA:  2 (K and V) * kv_heads * head_dim * bytes_per_element  — vLLM's
  `AttentionSpec.real_page_size_bytes = 2 * block_size * num_kv_heads * head_size * dtype_size`.
- MLA (DeepSeek): one latent of kv_lora_rank + qk_rope_head_dim values, no separate K and V —
  vLLM's `MLAAttentionSpec.real_page_size_bytes = block_size * num_kv_heads(=1) * head_size(=576) * dtype_size`.
- A sliding window does not change bytes per token; it caps the blocks a request holds (plan.py).

KV dtypes and the bytes they really take (scales counted):
- float32 4, bfloat16/float16 2.
- fp8 / fp8_e4m3 / fp8_e5m2: 1 byte; per-tensor k_scale/v_scale per layer, no per-token memory.
- int8: 1 byte + a float32 scale per (token, KV head) for K and for V — the engine's layout
  (`k_scale_cache`/`v_scale_cache` `[num_blocks, block_size, kv_heads]`) and vLLM's
  int8_per_token_head (`page_size_bytes += 2 * block_size * num_kv_heads * 4`).
- int4: llama.cpp's q4_0 layout along head_dim: 32 values in 16 bytes + one fp16 scale (18 bytes per 32),
  the engine's layout (head_dim a multiple of 32).
- kivi2: KIVI 2-bit (Liu et al. 2024, arXiv:2402.02750): keys quantized per channel in groups of G
  tokens, values per token in groups of G channels, an fp16 scale and zero point per group, and
  the most recent R tokens kept in full precision (the residual window, a per-request cost): the
  engine's pages (llmopt/cache/kivi.py), a block being one group of G tokens.
- fp8_ds_mla: vLLM's FlashMLA sparse layout for MLA, 656 bytes per token per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import ceil

from llmopt.cache.kivi import KiviConfig, check_kivi, check_kivi_model, page_bytes
from llmopt.distributed.plan import TPPlan, tp_plan
from llmopt.errors import UserInputError
from llmopt.estimate.arch import ModelArch
from llmopt.ggml_types import Q4_0_BYTES, Q4_0_VALUES, kv_int4_head_bytes
from llmopt.models.config import auto_kv_dtype_name

FLOAT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16",
           "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "kivi": "kivi2", "kivi-2bit": "kivi2",
           "kivi_2bit": "kivi2", "q4_0": "int4"}
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "kivi2",
             "fp8_ds_mla")
DS_MLA_TOKEN_BYTES = 656                    # vLLM fp8_ds_mla: 512 fp8 + 4 float32 scales + 64 bf16 rope


def canonical_kv_dtype(name: str, arch: ModelArch) -> str:
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key == "auto":
        auto = auto_kv_dtype_name(arch.serving_dtype, arch.weight_dtype)
        return auto if auto in FLOAT_BYTES else "bfloat16"
    if key not in KV_DTYPES:
        raise UserInputError(f"unknown --kv-cache-dtype {name!r}: use one of {', '.join(KV_DTYPES)}")
    return key


@dataclass(frozen=True)
class LayerKV:
    """One attention layer's KV cache on one rank."""
    index: int
    kind: str                    # full | sliding | mla
    window: int | None
    kv_heads: int                # heads this rank stores (1 for MLA: the latent)
    head_size: int               # values per head per token (K and V each; MLA: the latent width)
    token_bytes: Fraction        # bytes per token, all heads of this rank, amortized over groups
    residual_token_bytes: int = 0   # KIVI: a full-precision token, all heads of this rank
    kivi: KiviConfig | None = None

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one block of this layer (vLLM's page_size_bytes)."""
        return ceil(self.token_bytes * block_size)


def _head_token_bytes(dtype: str, head_dim: int, fp_bytes: int, kivi: KiviConfig) -> tuple[Fraction, int]:
    """(K+V bytes per token per KV head, K+V full-precision bytes per KIVI residual token)."""
    if dtype in FLOAT_BYTES:
        return Fraction(2 * head_dim * FLOAT_BYTES[dtype]), 0
    if dtype == "int8":
        return Fraction(2 * head_dim + 2 * 4), 0
    if dtype == "int4":
        return Fraction(2 * kv_int4_head_bytes(head_dim)), 0
    if dtype == "kivi2":   # a block's pages over its G tokens: codes, per-channel and per-token scales and zeros
        check_kivi(kivi.group_size, kivi.residual_length, head_dim)
        return Fraction(page_bytes(kivi.group_size, head_dim), kivi.group_size), 2 * head_dim * fp_bytes
    raise UserInputError(f"--kv-cache-dtype {dtype} applies to MLA models only")


def _mla_token_bytes(dtype: str, width: int) -> Fraction:
    if dtype in FLOAT_BYTES:
        return Fraction(width * FLOAT_BYTES[dtype])
    if dtype == "int8":
        return Fraction(width + 4)
    if dtype == "int4":
        return Fraction(ceil(width / Q4_0_VALUES) * Q4_0_BYTES)
    if dtype == "fp8_ds_mla":
        if width != 576:
            raise UserInputError(f"fp8_ds_mla needs a 512 + 64 latent, this model's is {width}")
        return Fraction(DS_MLA_TOKEN_BYTES)
    raise UserInputError(f"--kv-cache-dtype {dtype} is not supported for MLA models (KIVI quantizes K and V "
                         "separately; MLA stores one latent)")


def tp_split(arch: ModelArch, tp: int, group_size: int | None = None) -> TPPlan:
    """The engine's own tensor-parallel check and split (llmopt/distributed/plan.py: tp_plan), so kv-estimate
    refuses exactly the sizes the engine refuses and plans the KV heads each rank allocates (split
    across ranks; one replicated per rank when there are fewer than ranks, as vLLM). MLA splits its
    heads and replicates the latent; a MoE model splits each expert's width as well."""
    kv = arch.num_attention_heads if arch.mla else arch.num_kv_heads
    plan = tp_plan(arch.num_attention_heads, kv, arch.intermediate_size, arch.vocab_size, tp, group_size,
                   arch.head_dim)
    if arch.moe and arch.moe.intermediate_size != arch.intermediate_size:
        tp_plan(arch.num_attention_heads, kv, arch.moe.intermediate_size, arch.vocab_size, tp, group_size,
                arch.head_dim)
    return plan


def layer_kv_specs(arch: ModelArch, kv_dtype: str, tp: int = 1, kivi: KiviConfig | None = None) -> list[LayerKV]:
    """kivi: KIVI's sizes for kivi2 (default: the paper's)."""
    plan = tp_split(arch, tp)
    dtype = canonical_kv_dtype(kv_dtype, arch)
    if arch.mla:
        width = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
        tb = _mla_token_bytes(dtype, width)
        return [LayerKV(i, "mla", None, 1, width, tb) for i in range(arch.num_layers)]
    heads = plan.kv_heads_per_rank
    fp_bytes = FLOAT_BYTES.get(canonical_kv_dtype("auto", arch), 2)
    kivi = (kivi or KiviConfig()) if dtype == "kivi2" else None
    if kivi is not None:
        check_kivi_model(any(arch.layer_windows), tp)
    per_head, res_bytes = _head_token_bytes(dtype, arch.head_dim, fp_bytes, kivi)
    return [LayerKV(i, "sliding" if w else "full", w, heads, arch.head_dim, per_head * heads, res_bytes * heads, kivi)
            for i, w in enumerate(arch.layer_windows)]


def bytes_per_token(arch: ModelArch, kv_dtype: str = "auto", tp: int = 1) -> Fraction:
    """KV bytes one token costs across all layers on one rank (amortized; KIVI's residual excluded)."""
    return sum((layer.token_bytes for layer in layer_kv_specs(arch, kv_dtype, tp)), Fraction(0))
