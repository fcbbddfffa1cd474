"""Tensor-parallel shards of quantized checkpoint tensors (AutoAWQ GEMM, GPTQ, compressed-tensors).

A column shard of a Linear [out, in] keeps output features [r*out/N, (r+1)*out/N), a row shard
input features [r*in/N, (r+1)*in/N). Each tensor is described by the dim its output and its input
features lie along and by how many features one index there covers (1, the codes per int32 word
`p`, or the group size `g`), so a shard is one slice along one dim, read from a safetensors
PySafeSlice without reading the rest of the tensor. Per Linear (G groups):

- AWQ: qweight [in, out/p], qzeros [G, out/p], scales [G, out]. AWQ's nibble interleave
  (0, 2, 4, 6, 1, 3, 5, 7) permutes codes only inside each word, so whole words are exact shards.
- GPTQ: qweight [in/p, out], qzeros [G, out/p], scales [G, out], g_idx [in]. A row shard without
  act-order (desc_act false) keeps its groups' rows and rebases g_idx to start at 0. With act-order
  (desc_act true) a shard's columns belong to any of the G groups, so it keeps every group's scales
  and zeros (G rows, as vLLM does) and g_idx[in_start:in_end] unchanged: build the module as
  GPTQLinear(in/N, out, ..., n_groups=G) (`row_groups` says so). Such a layer has unequal groups,
  so it runs on the dequantize-per-call path.
- compressed-tensors pack-quantized (W4A16, W8A16): weight_packed [out, in/p], weight_scale
  [out, G] ([out, 1] per channel), weight_zero_point [out/p, G] when asymmetric, weight_shape [2]
  rewritten to the shard's [out, in]. int-/float-quantized (W8A8, FP8): weight [out, in],
  weight_scale [out, 1] per channel (a per-tensor [1] and input_scale are replicated).

Refused with a UserInputError: features that do not split into N equal parts, a row shard that
splits a quantization group or a packed word, a column shard that splits a packed word in a
format packed along the outputs (AWQ, GPTQ's qzeros, compressed-tensors' asymmetric zero points),
and any tensor of a bitsandbytes 4-bit checkpoint (each weight packed as one flat vector) or of a
compressed-tensors NVFP4 / MXFP4 one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from llmopt.errors import UserInputError
from llmopt.layers.formats import format_of
from llmopt.layers.formats.compressed_tensors import FP4_FORMATS
from llmopt.layers.formats.packing import codes_per_word
from llmopt.layers.runtime import ct_group_for, gptq_args

AWQ_TENSORS = ("qweight", "qzeros", "scales")
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
CT_TENSORS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "input_scale")
W8_FORMATS = ("int-quantized", "float-quantized", "naive-quantized")   # `.weight` holds the 8-bit codes

# suffix -> (output features, input features), each (dim, unit) or None (replicated along that split)
_LAYOUTS = {
    "awq": {"qweight": ((1, "p"), (0, 1)), "qzeros": ((1, "p"), (0, "g")), "scales": ((1, 1), (0, "g"))},
    "gptq": {"qweight": ((1, 1), (0, "p")), "qzeros": ((1, "p"), (0, "g")), "scales": ((1, 1), (0, "g")),
             "g_idx": (None, (0, 1))},
    "ct": {"weight_packed": ((0, 1), (1, "p")), "weight_scale": ((0, 1), (1, "g")),
           "weight_zero_point": ((0, "p"), (1, "g")), "weight": ((0, 1), (1, 1)), "input_scale": (None, None)},
}


@dataclass
class _Scheme:
    fmt: str               # awq | gptq | ct
    bits: int
    per: int               # codes per int32 word (1: not packed)
    group_size: int        # -1: one group per row
    packed_in: bool        # codes packed along the input features
    packed_out: bool       # something packed along the output features
    act_order: bool = False


def _looks_linear(module_name: str) -> bool:
    """Without the module itself: norms, embeddings and rotary tables are not Linears."""
    return not re.search(r"norm|embed|rotary", module_name.rpartition(".")[2])


def _ct_group(qcfg: dict, module_name: str, module: nn.Module | None):
    if module is None:
        module = nn.Linear(1, 1, device="meta") if _looks_linear(module_name) else nn.Module()
    return ct_group_for(qcfg, module_name, module)


def is_quantized_tensor(name: str, quant_config: dict | None, module: nn.Module | None = None) -> bool:
    """Whether checkpoint tensor `name` belongs to a quantized module's packed representation
    (codes, scales, zeros, g_idx, weight_shape, ...) under this quantization_config. `module`
    (optional) is the model's module owning the tensor, for compressed-tensors targets by class;
    without it a `.weight` of a module named like a norm, an embedding or a rotary table is float."""
    if not quant_config:
        return False
    module_name, _, suffix = name.rpartition(".")
    fmt = format_of(quant_config)
    if fmt == "bitsandbytes":   # (one flat vector a weight, blocks of the absmax vector across rows)
        raise UserInputError("tensor parallelism does not split bitsandbytes 4-bit checkpoints: run them on one "
                             "device (--tensor-parallel-size 1)")
    if fmt == "awq":
        return suffix in AWQ_TENSORS
    if fmt == "gptq":
        return suffix in GPTQ_TENSORS
    if any((g.get("format") or quant_config.get("format")) in FP4_FORMATS
           for g in (quant_config.get("config_groups") or {}).values()):   # (codes two a byte, E4M3 / E8M0 scales)
        raise UserInputError("tensor parallelism does not split nvfp4- / mxfp4-pack-quantized checkpoints yet: run "
                             "them on one device (--tensor-parallel-size 1)")
    if suffix in CT_TENSORS:
        return True
    if suffix != "weight":
        return False
    group = _ct_group(quant_config, module_name, module)
    return group is not None and group.get("format") in W8_FORMATS


def _scheme(name: str, qcfg: dict) -> _Scheme:
    module_name = name.rpartition(".")[0]
    fmt = format_of(qcfg)
    if fmt == "awq":
        bits = int(qcfg.get("bits", qcfg.get("w_bit", 4)))
        gs = int(qcfg.get("group_size", qcfg.get("q_group_size", -1)))
        return _Scheme("awq", bits, codes_per_word(bits), gs, packed_in=False, packed_out=True)
    if fmt == "gptq":
        args = gptq_args(qcfg, module_name)
        if args is None:
            raise UserInputError(f"{name}: the gptq quantization_config leaves {module_name} unquantized")
        return _Scheme("gptq", args["bits"], codes_per_word(args["bits"]), args["group_size"], packed_in=True,
                       packed_out=True, act_order=bool(qcfg.get("desc_act", False)))
    group = _ct_group(qcfg, module_name, None)
    if group is None:
        raise UserInputError(f"{name}: no compressed-tensors config group quantizes {module_name}")
    w = group.get("weights") or {}
    if group.get("format") == "pack-quantized":
        bits, sym = int(w["num_bits"]), bool(w.get("symmetric", True))
        gs = int(w["group_size"]) if w.get("strategy") == "group" else -1
        return _Scheme("ct", bits, codes_per_word(bits), gs, packed_in=True, packed_out=not sym)
    return _Scheme("ct", 8, 1, -1, packed_in=False, packed_out=False)


def row_groups(module_name: str, quant_config: dict, in_features: int, world: int) -> int:
    """How many groups' scales a row shard of module `module_name` holds (in_features: the full
    Linear's): in/N/g, or every group of the Linear for an act-order GPTQ shard."""
    s = _scheme(f"{module_name}.scales", quant_config)
    if s.group_size == -1:
        return 1
    if s.act_order:
        return -(-in_features // s.group_size)
    return _check(module_name, s, "in", in_features, world) // s.group_size


def _check(name: str, s: _Scheme, side: str, features: int, world: int) -> int:
    """The shard's width along `side` ("out" | "in"), or the reason it cannot be cut."""
    kind = "output" if side == "out" else "input"
    if features % world:
        raise UserInputError(f"{name}: {features} {kind} features do not split into {world} equal shards")
    width = features // world
    if side == "in" and s.group_size != -1 and width % s.group_size:
        raise UserInputError(f"{name}: a {world}-way row split would cut a quantization group: {width} input "
                             f"features per shard is not a multiple of the group size {s.group_size}")
    packed = s.packed_in if side == "in" else s.packed_out
    if packed and width % s.per:
        raise UserInputError(f"{name}: a {world}-way split would cut a packed word: {width} {kind} features per "
                             f"shard is not a multiple of the {s.per} {s.bits}-bit codes per int32 word")
    return width


def tensor_shape(tensor) -> tuple[int, ...]:
    """The shape of a tensor or a safetensors slice (read without reading the data)."""
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def read_whole(tensor) -> torch.Tensor:
    """A tensor, or all of a safetensors slice (0-d ones too: `[...]`, not `[:]`)."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor[...]


def _slice(tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + length): a copy, so no view keeps the full
    tensor alive; from a PySafeSlice only those bytes are read."""
    if isinstance(tensor, torch.Tensor):
        return tensor.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)
    index = slice(start, start + length)
    return tensor[index] if dim == 0 else tensor[:, index]


def shard_quantized(name: str, tensor, parallel: Literal["column", "row"], rank: int, world: int,
                    quant_config: dict) -> torch.Tensor:
    """This rank's slice of one quantized tensor (a torch.Tensor or a safetensors PySafeSlice, of
    which only the slice is read). column: the module's output features split in `world` equal
    parts; row: its input features. See the module docstring for each format's layout."""
    if parallel not in ("column", "row"):
        raise UserInputError(f"{name}: parallel must be 'column' or 'row', not {parallel!r}")
    if not 0 <= rank < world:
        raise UserInputError(f"{name}: rank {rank} is not in [0, {world})")
    s = _scheme(name, quant_config)
    suffix = name.rpartition(".")[2]
    side = "out" if parallel == "column" else "in"
    shape = tensor_shape(tensor)
    if s.fmt == "ct" and suffix == "weight_shape":
        out, n_in = (int(v) for v in read_whole(tensor).tolist())
        width = _check(name, s, side, out if side == "out" else n_in, world)
        return torch.tensor([width, n_in] if side == "out" else [out, width], dtype=torch.int64)
    layout = _LAYOUTS[s.fmt].get(suffix)
    if layout is None:
        raise UserInputError(f"{name}: not a tensor of a {s.fmt} quantized module")
    axis = layout[0] if side == "out" else layout[1]
    if suffix == "weight_scale" and len(shape) < 2:      # per-tensor scale
        axis = None
    units = {1: 1, "p": s.per, "g": s.group_size}
    if axis is not None and axis[1] == "g" and (s.group_size == -1 or (s.fmt == "gptq" and s.act_order)):
        axis = None                                      # one group per row, or act-order: every group
    if axis is None:
        return read_whole(tensor)
    dim, unit = axis[0], units[axis[1]]
    width = _check(name, s, side, shape[dim] * unit, world)
    part = _slice(tensor, dim, rank * width // unit, width // unit)
    if suffix == "g_idx" and not s.act_order:            # groups of this shard, from 0
        gs = s.group_size if s.group_size != -1 else shape[0]
        first, count = rank * width // gs, -(-width // gs)
        part = part - first
        if bool(((part < 0) | (part >= count)).any()):
            raise UserInputError(f"{name}: g_idx is not in group order though desc_act is false: a row shard "
                                 f"cannot keep only its own groups (mark the checkpoint desc_act: true)")
    return part
