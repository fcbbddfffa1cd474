"""The seed's formula, 2 x layers x hidden x seq_len x batch x bytes, beside the real accounting, and
what makes them differ for this model (GQA/MQA, MLA, sliding windows, scales, paging)."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from llmopt.estimate.kv import FLOAT_BYTES, LayerKV
from llmopt.estimate.arch import ModelArch
from llmopt.estimate.plan import KVLayout

ELEMENT_BYTES = {"int8": Fraction(1), "int4": Fraction(1, 2), "kivi2": Fraction(1, 4), "fp8_ds_mla": Fraction(1)}


@dataclass
class NaiveComparison:
    formula: str
    seq_len: int
    batch_size: int
    naive_bytes: int
    real_bytes: int             # paged bytes the batch holds, whole model (all ranks' share at tp=1)
    ratio: float                # naive / real
    differences: list[str] = field(default_factory=list)


def compare(arch: ModelArch, dtype: str, layers: list[LayerKV], layout: KVLayout, seq_len: int, batch: int,
            block_size: int, max_num_batched_tokens: int) -> NaiveComparison:
    """`layers`/`layout`: the model at tensor-parallel size 1 (the formula knows no ranks)."""
    elem = Fraction(FLOAT_BYTES[dtype]) if dtype in FLOAT_BYTES else ELEMENT_BYTES[dtype]
    naive = int(2 * arch.num_layers * arch.hidden_size * seq_len * batch * elem)
    real = layout.bytes_for(seq_len, max_num_batched_tokens) * batch
    diffs = []
    h = arch.hidden_size
    if arch.mla:
        w = arch.mla.kv_lora_rank + arch.mla.qk_rope_head_dim
        diffs.append(f"MLA: one latent of {w} values per token per layer (kv_lora_rank {arch.mla.kv_lora_rank} + "
                     f"rope {arch.mla.qk_rope_head_dim}), not K and V of {h} each: {2 * h / w:.1f}x less")
    else:
        width = arch.num_kv_heads * arch.head_dim
        if arch.num_kv_heads != arch.num_attention_heads:
            diffs.append(f"{arch.attention}: K and V are {arch.num_kv_heads} heads x {arch.head_dim} = {width} wide, "
                         f"not hidden {h:,}: {h / width:.1f}x less")
        elif width != h:
            diffs.append(f"head_dim x heads = {width} differs from hidden {h}")
    sliding = [x for x in layers if x.kind == "sliding"]
    if sliding:
        w = sliding[0].window
        cap = min(w - 1 + max_num_batched_tokens, seq_len)
        if cap < seq_len:
            diffs.append(f"{len(sliding)} of {len(layers)} layers use a {w:,}-token sliding window: they hold at most "
                         f"cdiv({cap:,}, {block_size}) + 1 blocks per request, not {seq_len:,} tokens")
    if dtype == "int8":
        diffs.append("int8 stores a float32 scale per token and KV head for K and V (+8 bytes per head per token)")
    elif dtype == "int4":
        diffs.append("int4 (q4_0) stores an fp16 scale per 32 values (4.5 bits per value)")
    elif dtype == "kivi2":
        diffs.append("KIVI stores fp16 scales and zero points per group and keeps the last "
                     f"{layers[0].kivi.residual_length} tokens in full precision")
    if layout.mode == "hybrid" and layout.padding_layers:
        diffs.append(f"vLLM pads the layer groups with {layout.padding_layers} empty layer slots")
    if seq_len % block_size:
        diffs.append(f"paging rounds each request up to whole blocks of {block_size} tokens")
    if not diffs:
        diffs.append("plain multi-head attention: the formula is right (up to block rounding)")
    return NaiveComparison("2 x layers x hidden x seq_len x batch x bytes", seq_len, batch, naive, real,
                           naive / real if real else float("inf"), diffs)
