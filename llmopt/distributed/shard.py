"""A rank's slice of each checkpoint tensor, cut as the tensor is read (`LlamaForCausalLM.load_weights`
calls this through `TPGroup.shard`): from a memory-mapped safetensors slice only the rank's rows or
columns are read, so a rank never holds a whole weight.

- column-parallel (q/k/v, gate/up): output rows; k/v by KV heads (a replicated KV head: the rank's one);
- row-parallel (o_proj, down_proj): input columns of the weight; the bias is added once, by rank 0;
- embedding and LM head: vocabulary rows, the last rank's padded with zeros to vocab_per_rank;
- everything else (norms): whole on every rank.
Packed tensors of quantized checkpoints (AWQ, GPTQ, compressed-tensors) are cut by
`llmopt.layers.shard_quant.shard_quantized`, which keeps codes, scales, zeros and g_idx together.
A GGUF tensor run as stored is decoded whole (one tensor at a time), then cut by `shard_grouped`:
the same slices of its codes, with their group scales and scale * zero.
"""

from __future__ import annotations

import torch

from llmopt.distributed.plan import TPPlan
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.kernels.cpu_quant import group_columns
from llmopt.layers.formats.ggml import GroupedCodes
from llmopt.layers.shard_quant import is_quantized_tensor, read_whole, shard_quantized, tensor_shape
from llmopt.layers.tp import layout


def _part(name: str, plan: TPPlan, rank: int) -> tuple[int, int]:
    """(index, parts): the slice of the output rows this rank holds, as one of `parts` equal parts."""
    if name.split(".")[-2] in ("k_proj", "v_proj") and plan.kv_replicated:
        return plan.kv_head_start(rank), plan.num_kv_heads
    return rank, plan.world_size


def _cut(tensor, dim: int, index: int, parts: int, name: str) -> torch.Tensor:
    size = tensor_shape(tensor)[dim]
    if size % parts:
        raise ModelLoadError(f"{name}: {size} rows along dim {dim} do not split into {parts} equal parts")
    step = size // parts
    key = (slice(None),) * dim + (slice(index * step, (index + 1) * step),)
    return tensor[key]


def shard_tensor(name: str, tensor, plan: TPPlan, rank: int, quantization_config: dict | None = None) -> torch.Tensor:
    """This rank's part of checkpoint tensor `name`; `tensor` is a tensor or a safetensors slice.
    The part is the rank's own memory: no view keeps the file's mapping (and its pages) alive."""
    part = _shard(name, tensor, plan, rank, quantization_config)
    if part.untyped_storage().nbytes() != part.nbytes:    # a view into something larger (a mapping)
        part = part.clone()
    return part


def _shard(name: str, tensor, plan: TPPlan, rank: int, quantization_config: dict | None) -> torch.Tensor:
    how = layout(name)
    if how == "replicated" or plan.world_size == 1:
        return read_whole(tensor)
    if quantization_config:
        if is_quantized_tensor(name, quantization_config):
            if how == "vocab":
                if plan.vocab_size % plan.world_size:
                    raise UserInputError(f"{name}: a quantized LM head of {plan.vocab_size:,} rows does not split "
                                         f"over {plan.world_size} ranks")
                how = "column"
            index, parts = _part(name, plan, rank)
            return shard_quantized(name, tensor, how, index, parts, quantization_config)
    leaf = name.rsplit(".", 1)[-1]
    if how == "column":
        return _cut(tensor, 0, *_part(name, plan, rank), name)
    if how == "row":
        if leaf == "weight":
            return _cut(tensor, 1, rank, plan.world_size, name)
        if leaf == "bias":      # the partial sums are added up: the bias once
            t = read_whole(tensor)
            return t if rank == 0 else torch.zeros_like(t)
        return read_whole(tensor)   # per-output-row scales (--quantization int8|fp8): every rank's rows
    start, stop = plan.vocab_range(rank)
    rows = tensor[start:stop]
    if stop - start < plan.vocab_per_rank:
        pad = rows.new_zeros((plan.vocab_per_rank - (stop - start), *rows.shape[1:]))
        rows = torch.cat([rows, pad])
    return rows


def shard_grouped(name: str, g: GroupedCodes, plan: TPPlan, rank: int) -> GroupedCodes:
    """This rank's part of a GGUF tensor as grouped codes [out, in]: the rows or input columns
    `_shard` takes of a float weight (a row shard in whole blocks), vocabulary rows padded with
    zero rows; scales and scale * zero cut alongside."""
    how = layout(name)
    if how == "replicated" or plan.world_size == 1:
        return g

    def each(cut_codes, cut_groups=None, codes=None) -> GroupedCodes:   # cut_groups: the scales' cut
        cut_groups = cut_groups or cut_codes
        packed = g.packed and codes is None
        return GroupedCodes(cut_codes(g.codes if codes is None else codes), cut_groups(g.scales),
                            cut_groups(g.szeros) if g.szeros.dim() == 2 else g.szeros, g.bits, g.group_size,
                            packed=packed)

    if how == "column":
        index, parts = _part(name, plan, rank)
        return each(lambda t: _cut(t, 0, index, parts, name))
    if how == "row":
        k = g.shape[1]
        step = k // plan.world_size
        if k % plan.world_size or step % g.group_size:
            raise ModelLoadError(f"{name}: {k} input columns do not split into {plan.world_size} "
                                 f"parts of whole {g.group_size}-column blocks")
        blocks = step // g.group_size

        def cut_groups(t):   # (a K-quant's sub-scales: in whole 256-column super-blocks)
            try:
                return group_columns(t, g.groups, rank * blocks, (rank + 1) * blocks)
            except ValueError:
                raise ModelLoadError(f"{name}: {k} input columns do not split into {plan.world_size} parts of "
                                     "whole 256-column super-blocks") from None
        return each(lambda t: t[:, rank * step:(rank + 1) * step].contiguous(),   # (packed codes: unpacked)
                    cut_groups, codes=g.unpacked())
    start, stop = plan.vocab_range(rank)
    pad = plan.vocab_per_rank - (stop - start)
    return each(lambda t: torch.cat([t[start:stop], t.new_zeros((pad, *t.shape[1:]))]) if pad
                else t[start:stop].contiguous())
