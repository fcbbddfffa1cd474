"""The model's tensor-parallel layout: which of its layers are column-parallel (q/k/v, gate/up:
output rows split), row-parallel (o_proj, down_proj: input columns split, partial sums
all-reduced) or vocabulary-parallel (embedding, LM head), and the quantized modules rebuilt for a
rank's shard. llmopt.distributed.shard cuts the checkpoint tensors by this layout
(llmopt/distributed/plan.py: the per-rank shapes)."""

from __future__ import annotations

from llmopt.layers.modules import GPTQLinear
from llmopt.layers.shard_quant import row_groups

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")
VOCAB = ("embed_tokens", "lm_head")


def layout(name: str) -> str:
    """column | row | vocab | replicated: how tensor `name` (an HF name) is split."""
    parts = name.split(".")
    module = parts[-2] if len(parts) > 1 else ""
    if module in COLUMN:
        return "column"
    if module in ROW:
        return "row"
    if module in VOCAB:
        return "vocab"
    return "replicated"


def fit_quantized_modules(model, plan) -> int:
    """After convert_for_runtime on a rank's shard: an act-order GPTQ row-parallel shard keeps every
    group's scales and zeros (shard_quant), so its module is rebuilt with the whole Linear's group
    count. `plan`: the rank's llmopt.distributed.plan.TPPlan. Returns how many modules were rebuilt."""
    qcfg = model.config.quantization_config or {}
    if plan.world_size == 1 or not qcfg.get("desc_act"):
        return 0
    rebuilt = 0
    for name, mod in list(model.named_modules()):
        if type(mod) is not GPTQLinear or layout(f"{name}.qweight") != "row":
            continue
        groups = row_groups(name, qcfg, mod.in_features * plan.world_size, plan.world_size)
        if groups != mod.n_groups:
            model.set_submodule(name, GPTQLinear(mod.in_features, mod.out_features, mod.bias is not None, mod.bits,
                                                 mod.group_size, mod.sym, mod.checkpoint_format, n_groups=groups))
            rebuilt += 1
    return rebuilt
