"""How a model splits over N tensor-parallel ranks: the one check of a tensor-parallel size (the
engine and kv-estimate both call `tp_plan`) and the per-rank shapes. No torch here: kv-estimate
imports it and stays fast.

Megatron-style split (as vLLM): q/k/v and gate/up are column-parallel (each rank computes a slice of
the heads and of the MLP width), o_proj and down_proj row-parallel (partial sums, all-reduced), the
embedding and the LM head split over the vocabulary (padded up to a multiple of N). Valid sizes: N
divides the attention heads and the MLP width, and either N divides the KV heads or the KV heads
divide N; then each KV head is replicated on N / kv ranks (rank r holds KV head r * kv // N). A
quantized checkpoint's row-parallel shards must hold whole groups: (input width / N) % group == 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from llmopt.errors import UserInputError


@dataclass(frozen=True)
class TPPlan:
    world_size: int
    num_heads: int
    num_kv_heads: int
    heads_per_rank: int
    kv_heads_per_rank: int
    kv_replicated: bool          # fewer KV heads than ranks: each rank holds one, shared by N / kv ranks
    intermediate_per_rank: int
    vocab_size: int
    vocab_per_rank: int          # ceil(vocab / N): the last rank's rows past the vocabulary are zero padding

    def kv_head_start(self, rank: int) -> int:
        """The first KV head rank `rank` holds."""
        if self.kv_replicated:
            return rank * self.num_kv_heads // self.world_size
        return rank * self.kv_heads_per_rank

    def vocab_range(self, rank: int) -> tuple[int, int]:
        """The vocabulary rows [start, stop) rank `rank` holds (stop - start < vocab_per_rank on a
        padded last rank)."""
        start = min(rank * self.vocab_per_rank, self.vocab_size)
        return start, min(start + self.vocab_per_rank, self.vocab_size)

    def local_config(self, cfg):
        """A models/config.py ModelConfig with this rank's head counts, MLP width and vocabulary rows:
        what the model's modules are built from (the model keeps the whole config as `config`)."""
        return dataclasses.replace(cfg, num_attention_heads=self.heads_per_rank,
                                   num_key_value_heads=self.kv_heads_per_rank,
                                   intermediate_size=self.intermediate_per_rank, vocab_size=self.vocab_per_rank)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _problem(n: int, heads: int, kv: int, inter: int, group: int | None, head_dim: int | None) -> str | None:
    """Why N ranks cannot split the model (None: they can)."""
    if heads % n:
        return f"does not divide the {heads:,} attention heads"
    if inter % n:
        return f"does not divide the MLP width {inter:,}"
    if kv % n and n % kv:
        return f"and the {kv:,} KV heads do not divide one another"
    if group and group > 0 and n > 1:
        if (inter // n) % group:
            return (f"splits a quantization group: a rank's share of the MLP width {inter:,} is {inter // n:,} "
                    f"inputs of down_proj, not a multiple of the group size {group}")
        if head_dim and (heads // n * head_dim) % group:
            return (f"splits a quantization group: a rank's share of o_proj's {heads * head_dim:,} inputs is "
                    f"{heads // n * head_dim:,}, not a multiple of the group size {group}")
    return None


def valid_sizes(num_attention_heads: int, num_key_value_heads: int, intermediate_size: int,
                group_size: int | None = None, head_dim: int | None = None) -> list[int]:
    """Every tensor-parallel size the model takes (each divides the attention heads)."""
    return [n for n in _divisors(num_attention_heads)
            if _problem(n, num_attention_heads, num_key_value_heads, intermediate_size, group_size, head_dim) is None]


def tp_plan(num_attention_heads: int, num_key_value_heads: int, intermediate_size: int, vocab_size: int,
            world_size: int, group_size: int | None = None, head_dim: int | None = None) -> TPPlan:
    """The split of a model over `world_size` ranks; UserInputError naming the model's numbers and
    the valid sizes when it does not split. `group_size` (a quantized checkpoint's, > 0) with
    `head_dim` adds the whole-groups rule for the row-parallel shards."""
    n = world_size
    if not isinstance(n, int) or n < 1:
        raise UserInputError(f"--tensor-parallel-size {n}: give at least 1")
    heads, kv, inter = num_attention_heads, num_key_value_heads, intermediate_size
    why = _problem(n, heads, kv, inter, group_size, head_dim)
    if why is not None:
        ok = ", ".join(map(str, valid_sizes(heads, kv, inter, group_size, head_dim)))
        raise UserInputError(f"--tensor-parallel-size {n} {why} (valid sizes for this model: {ok})")
    return TPPlan(world_size=n, num_heads=heads, num_kv_heads=kv, heads_per_rank=heads // n,
                  kv_heads_per_rank=max(1, kv // n), kv_replicated=kv < n, intermediate_per_rank=inter // n,
                  vocab_size=vocab_size, vocab_per_rank=-(-vocab_size // n))


def quant_group_size(quantization_config: dict[str, Any] | None) -> int | None:
    """The group size of a checkpoint's quantization_config (AWQ, GPTQ, compressed-tensors groups);
    None for per-channel or unquantized weights."""
    q = quantization_config or {}
    g = q.get("group_size", q.get("q_group_size"))
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("strategy") == "group" and w.get("group_size"):
            g = w["group_size"]
    try:
        g = int(g) if g is not None else None
    except (TypeError, ValueError):
        return None
    return g if g and g > 0 else None


def plan_for_config(cfg, world_size: int) -> TPPlan:
    """tp_plan for a models/config.py ModelConfig (its quantization group size included)."""
    return tp_plan(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size,
                   world_size, quant_group_size(cfg.quantization_config), cfg.head_dim)
