"""The parameter shapes of a model, derived from its config the way the Hugging Face modeling code
builds them (names follow HF), each with how tensor parallelism splits it (vLLM's layers):
`col` ColumnParallelLinear (rows split), `row` RowParallelLinear (columns split), `kv` the K/V
rows of QKVParallelLinear (KV heads split, replicated when fewer than ranks), `vocab`
VocabParallelEmbedding / ParallelLMHead, `rep` replicated (norms, MLA's A projections, routers)."""

from __future__ import annotations

import math

from dataclasses import dataclass

from llmopt.estimate.arch import ModelArch


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    group: str          # embed | head | attn | mlp | experts | router | norm
    tp: str             # col | row | kv | vocab | rep

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_linear(self) -> bool:
        return len(self.shape) == 2 and self.group in ("attn", "mlp", "experts")


def _attention(arch: ModelArch, p: str) -> list[Param]:
    h, hd, nh, kv = arch.hidden_size, arch.head_dim, arch.num_attention_heads, arch.num_kv_heads
    if arch.mla:
        m = arch.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        out = []
        if m.q_lora_rank:
            out += [Param(f"{p}.q_a_proj.weight", (m.q_lora_rank, h), "attn", "rep"),
                    Param(f"{p}.q_a_layernorm.weight", (m.q_lora_rank,), "norm", "rep"),
                    Param(f"{p}.q_b_proj.weight", (nh * qk, m.q_lora_rank), "attn", "col")]
        else:
            out.append(Param(f"{p}.q_proj.weight", (nh * qk, h), "attn", "col"))
        return out + [
            Param(f"{p}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), "attn", "rep"),
            Param(f"{p}.kv_a_layernorm.weight", (m.kv_lora_rank,), "norm", "rep"),
            Param(f"{p}.kv_b_proj.weight", (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), "attn", "col"),
            Param(f"{p}.o_proj.weight", (h, nh * m.v_head_dim), "attn", "row")]
    out = [Param(f"{p}.q_proj.weight", (nh * hd, h), "attn", "col"),
           Param(f"{p}.k_proj.weight", (kv * hd, h), "attn", "kv"),
           Param(f"{p}.v_proj.weight", (kv * hd, h), "attn", "kv"),
           Param(f"{p}.o_proj.weight", (h, nh * hd), "attn", "row")]
    if arch.qkv_bias:
        out += [Param(f"{p}.q_proj.bias", (nh * hd,), "attn", "col"), Param(f"{p}.k_proj.bias", (kv * hd,), "attn", "kv"),
                Param(f"{p}.v_proj.bias", (kv * hd,), "attn", "kv")]
    if arch.o_bias:                                   # llama attention_bias=True: o_proj has a bias too
        out.append(Param(f"{p}.o_proj.bias", (h,), "attn", "rep"))
    if arch.qk_norm:
        out += [Param(f"{p}.q_norm.weight", (hd,), "norm", "rep"), Param(f"{p}.k_norm.weight", (hd,), "norm", "rep")]
    return out


def _dense_mlp(p: str, h: int, inter: int, group: str = "mlp") -> list[Param]:
    return [Param(f"{p}.gate_proj.weight", (inter, h), group, "col"), Param(f"{p}.up_proj.weight", (inter, h), group, "col"),
            Param(f"{p}.down_proj.weight", (h, inter), group, "row")]


def _mlp(arch: ModelArch, i: int, p: str) -> list[Param]:
    h, moe = arch.hidden_size, arch.moe
    if moe is None or i < moe.first_dense_layers:
        return _dense_mlp(f"{p}.mlp", h, arch.intermediate_size)
    out: list[Param] = []
    e, mi = moe.num_experts, moe.intermediate_size
    if moe.naming == "mixtral":
        out.append(Param(f"{p}.block_sparse_moe.gate.weight", (e, h), "router", "rep"))
        for j in range(e):
            q = f"{p}.block_sparse_moe.experts.{j}"
            out += [Param(f"{q}.w1.weight", (mi, h), "experts", "col"), Param(f"{q}.w3.weight", (mi, h), "experts", "col"),
                    Param(f"{q}.w2.weight", (h, mi), "experts", "row")]
        return out
    out.append(Param(f"{p}.mlp.gate.weight", (e, h), "router", "rep"))
    if moe.naming == "deepseek":
        out.append(Param(f"{p}.mlp.gate.e_score_correction_bias", (e,), "router", "rep"))
    for j in range(e):
        out += _dense_mlp(f"{p}.mlp.experts.{j}", h, mi, "experts")
    if moe.shared_intermediate_size:
        name = "shared_experts" if moe.naming == "deepseek" else "shared_expert"
        out += _dense_mlp(f"{p}.mlp.{name}", h, moe.shared_intermediate_size)
        if moe.naming == "qwen":
            out.append(Param(f"{p}.mlp.shared_expert_gate.weight", (1, h), "router", "rep"))
    return out


_NORM_NAMES = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def model_params(arch: ModelArch) -> list[Param]:
    """Every parameter once: a tied head shares the embedding and is not listed again."""
    h = arch.hidden_size
    out = [Param("model.embed_tokens.weight", (arch.vocab_size, h), "embed", "vocab")]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}"
        out += _attention(arch, f"{p}.self_attn")
        out += _mlp(arch, i, p)
        out += [Param(f"{p}.{n}.weight", (h,), "norm", "rep") for n in _NORM_NAMES[:arch.norms_per_layer]]
    out.append(Param("model.norm.weight", (h,), "norm", "rep"))
    if not arch.tie_word_embeddings:
        out.append(Param("lm_head.weight", (arch.vocab_size, h), "head", "vocab"))
    return out


def count_params(arch: ModelArch) -> int:
    return sum(p.numel for p in model_params(arch))
