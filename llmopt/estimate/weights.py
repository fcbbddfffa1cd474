"""Weight memory for a weight format, from the parameter shapes (each parameter counted once: a tied
head shares the embedding), whole model and per tensor-parallel rank.

Formats (only the decoder's Linear weights are quantized; embeddings, head, norms and routers stay
in the base dtype, as AutoAWQ / GPTQ / llm-compressor checkpoints keep them):
- float32 / bfloat16 / float16: numel * bytes.
- fp8, int8: 1 byte per weight + a float32 scale per output channel.
- fp8-block: 1 byte per weight + a float32 scale per 128x128 block (DeepSeek-V3's checkpoint).
- int4 (group size g): 4-bit codes + per group an fp16 scale and a 4-bit zero point (AutoAWQ's
  GEMM layout: qweight and qzeros packed 8 per int32, scales fp16).
- nvfp4: 4-bit E2M1 codes + an E4M3 byte per 16 + a float32 global scale per Linear (compressed-tensors
  nvfp4-pack-quantized; a W4A4 checkpoint's `input_global_scale`, another float32 per Linear, is
  counted from its config); mxfp4: 4-bit codes + an E8M0 byte per 32 (compressed-tensors or GGUF MXFP4,
  17 bytes a block); nf4: bitsandbytes with double quantization: 4-bit codes + an 8-bit absmax code per
  64 (or --group-size) + a float32 absmax per 256 of those blocks, + the 16- and 256-entry float32 maps
  per Linear (its quant_state JSON, ~200 bytes, aside).
- a GGML type (q4_0, q4_k, q8_0, ...): every 2-D weight, embeddings included, at that type using
  gguf's GGML_QUANT_SIZES (elements / block size * bytes per block); norms stay float32.
- auto: what the checkpoint really holds: a .gguf's or a quantized safetensors folder's tensors as
  stored, a float folder's as the engine holds them (matrices in the weight dtype, vectors in the
  compute dtype: models/config.py), else the config's quantization_config, else the weight dtype.

On the CPU (device "cpu") the figure is what llmopt's engine keeps resident: grouped int4/int8
codes with a float32 scale and a float32 scaled zero per group (the layout of
llmopt/kernels/cpu_quant), 4-bit float codes (nvfp4, mxfp4, nf4) as nibbles where the width is a
multiple of 64 (else a byte a code) with a float32 scale per block (llmopt.layers.modules_fp4),
and for quantized weights the head, or the tied embedding it shares, as int8 per row + a float32
scale per row (--lm-head-dtype auto); a quantized checkpoint's folder is then counted from its
config, not its stored tensors. A 16-bit float checkpoint keeps its matrices
16-bit there (`--dtype auto`), its norms and biases float32. A GGUF file on the CPU is counted as the
engine holds it (llmopt.ggml_types.held_bytes: its block types repacked with their group
scales, fp16 as stored for Q4_x / Q5_x / Q8_0 and float32 for the K-quants, F16 / BF16 matrices as
stored, other types dequantized to float32); on a GPU too, as the Triton kernels hold it (4- or
8-bit codes, a float32 scale and zero point per group; the rest in the model's dtype), not the
file's bytes (vLLM's convention; our repacked layout holds more: 6 bits a Q4_1 weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import ceil

from llmopt import defaults
from llmopt.errors import UserInputError
from llmopt.ggml_types import held_bytes
from llmopt.estimate.kv import tp_split
from llmopt.estimate.arch import ModelArch
from llmopt.estimate.params import Param, count_params, model_params
from llmopt.estimate.tensors import TensorInfo, ggml_nbytes, ggml_type_names

FLOAT_FORMATS = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
WEIGHT_FORMATS = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8-block", "int8", "int4", "nvfp4", "mxfp4", "nf4",
                  "<ggml type>")
FP4_BLOCKS = {"nvfp4": 16, "mxfp4": 32, "nf4": defaults.NF4_BLOCK}   # values per scale (nf4: or --group-size)
_BNB_NESTED, _BNB_MAPS = 256, (16 + 256) * 4          # double quantization's absmax blocks; quant_map + nested map


@dataclass
class WeightMemory:
    format: str
    source: str                     # file (the tensors as stored) | config (shapes derived from config.json)
    params: int                     # parameters, each counted once
    bytes_total: int                # the whole model
    bytes_per_rank: int             # what one tensor-parallel rank holds
    by_group: dict[str, int] = field(default_factory=dict)   # bytes per part (embed, attn, mlp, experts, ...)


def _auto_format(arch: ModelArch) -> tuple[str, int]:
    q = arch.quantization_config or {}
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        return ("fp8-block" if q.get("weight_block_size") else "fp8"), 0
    if method == "compressed-tensors" and q.get("format") in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        return q["format"].split("-")[0], 0
    if method == "bitsandbytes" and q.get("load_in_4bit"):
        if not q.get("bnb_4bit_use_double_quant", False):
            raise UserInputError(f"{arch.name}: bitsandbytes 4-bit without double quantization is not modelled; "
                                 "pass --weight-format")
        return "nf4", 0
    if method in ("awq", "gptq"):
        bits = int(q.get("bits", q.get("w_bit", 4)))
        if bits != 4:
            raise UserInputError(f"{arch.name}: {bits}-bit {method} checkpoints are not modelled; pass --weight-format")
        return "int4", int(q.get("group_size", q.get("q_group_size", defaults.QUANT_GROUP_SIZE)))
    if method:
        raise UserInputError(f"{arch.name}: quantization method {method!r} is not modelled; pass --weight-format")
    return arch.weight_dtype if arch.weight_dtype in FLOAT_FORMATS else "bfloat16", 0


def _fp4_activations(arch: ModelArch) -> bool:
    """Whether a compressed-tensors FP4 checkpoint quantizes its activations too (W4A4)."""
    groups = ((arch.quantization_config or {}).get("config_groups") or {}).values()
    return any(isinstance(g, dict) and g.get("input_activations") for g in groups)


def _shard(p: Param, arch: ModelArch, tp: int) -> tuple[int, ...]:
    """The shape one rank holds."""
    if tp == 1 or p.tp == "rep":
        return p.shape
    if p.tp == "kv":
        return (tp_split(arch, tp).kv_heads_per_rank * arch.head_dim, *p.shape[1:])
    if p.tp == "row":
        return (p.shape[0], ceil(p.shape[1] / tp))
    return (ceil(p.shape[0] / tp), *p.shape[1:])          # col, vocab


def _linear_bytes(out: int, inp: int, fmt: str, group: int, cpu: bool = False) -> int:
    if fmt == "int4" and cpu:     # cpu_quant: nibbles, float32 scale and scaled zero per group
        return ceil(out * inp / 2) + out * ceil(inp / (inp if group in (-1, 0) else group)) * 8
    if fmt in ("fp8", "int8"):
        return out * inp + out * 4
    if fmt == "fp8-block":
        return out * inp + ceil(out / 128) * ceil(inp / 128) * 4
    if fmt == "int4":
        g = inp if group in (-1, 0) else group
        n_groups = ceil(inp / g)
        return ceil(out * inp / 2) + out * n_groups * 2 + ceil(out * n_groups / 2)
    raise AssertionError(fmt)


def _fp4_bytes(out: int, inp: int, fmt: str, block: int, cpu: bool = False) -> int:
    """A Linear of 4-bit float codes (module docstring): the checkpoint's bytes, or with `cpu` the engine's."""
    blocks = out * ceil(inp / block)
    if cpu:   # llmopt.layers.modules_fp4.Fp4Linear: codes and a float32 scale per block
        return (ceil(out * inp / 2) if inp % 64 == 0 else out * inp) + blocks * 4
    codes = ceil(out * inp / 2)
    if fmt == "nvfp4":
        return codes + blocks + 4
    if fmt == "mxfp4":
        return codes + blocks
    return codes + blocks + ceil(blocks / _BNB_NESTED) * 4 + _BNB_MAPS


def _ggml_bytes(shape: tuple[int, ...], type_name: str) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rows = 1
    for s in shape[:-1]:
        rows *= s
    return rows * ggml_nbytes(ceil(shape[-1] / block) * block, type_name)   # rows padded to whole blocks


def param_bytes(p: Param, shape: tuple[int, ...], fmt: str, group: int, base: int, cpu: bool = False,
                int8_head: bool = False) -> int:
    numel = 1
    for s in shape:
        numel *= s
    if int8_head and len(shape) == 2 and p.group in ("head", "embed"):
        return numel + shape[0] * 4      # int8 per row + a float32 scale per row (layers/runtime.py Int8Head)
    if fmt in FLOAT_FORMATS:   # (the CPU engine computes in float32: norms and biases held so)
        return numel * (4 if cpu and len(shape) == 1 else FLOAT_FORMATS[fmt])
    if fmt in FP4_BLOCKS:      # (before the GGML names: MXFP4 is one too, but here only the Linears)
        block = group if fmt == "nf4" and group > 0 else FP4_BLOCKS[fmt]
        return _fp4_bytes(shape[0], shape[1], fmt, block, cpu) if p.is_linear else numel * base
    if fmt.upper() in ggml_type_names():
        return _ggml_bytes(shape, fmt.upper()) if len(shape) == 2 else numel * 4
    if p.is_linear:
        return _linear_bytes(shape[0], shape[1], fmt, group, cpu)
    return numel * base


_GROUP_PATTERNS = (("embed_tokens", "embed"), ("token_embd", "embed"), ("lm_head", "head"), ("norm", "norm"),
                   ("experts", "experts"), ("ffn_", "mlp"), ("mlp", "mlp"), ("gate.", "router"))


_SAFETENSORS_FLOATS = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8}
_SAFETENSORS_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def _as_held(t: TensorInfo, arch: ModelArch) -> TensorInfo:
    """A float safetensors tensor as the engine holds it: matrices in the weight dtype, vectors
    (norms, biases) in the compute dtype (models/config.py); others as stored."""
    if t.dtype not in _SAFETENSORS_FLOATS:
        return t
    dtype = arch.weight_dtype if len(t.shape) >= 2 else arch.serving_dtype
    return TensorInfo(t.name, t.shape, _SAFETENSORS_NAMES[dtype], t.numel * FLOAT_FORMATS[dtype])


def _file_group(name: str) -> str:
    if name == "output.weight":          # a GGUF's untied head
        return "head"
    for pat, g in _GROUP_PATTERNS:
        if pat in name:
            return g
    return "attn"


def _file_rank_bytes(t: TensorInfo, arch: ModelArch, tp: int) -> int:
    """Approximate a rank's share of a stored tensor: replicated norms, KV rows by KV heads, else 1/tp."""
    if tp == 1 or "norm" in t.name or len(t.shape) < 2:
        return t.nbytes
    if any(k in t.name for k in ("k_proj", "v_proj", "attn_k.", "attn_v.")):
        return ceil(t.nbytes * tp_split(arch, tp).kv_heads_per_rank / arch.num_kv_heads)
    return ceil(t.nbytes / tp)


def weight_memory(arch: ModelArch, fmt: str = "auto", group_size: int | None = None, tp: int = 1,
                  device: str = "cuda", lm_head_dtype: str = defaults.LM_HEAD_DTYPE) -> WeightMemory:
    """device cpu: what the engine holds on the CPU (the module docstring); lm_head_dtype as the
    engine's --lm-head-dtype."""
    fmt = fmt.strip().lower()
    group = (FP4_BLOCKS.get(fmt, defaults.QUANT_GROUP_SIZE) if group_size is None else group_size)
    if group == 0 or group < -1:
        raise UserInputError(f"--group-size must be positive or -1 (per channel), got {group}")
    cpu = device == "cpu"
    if fmt == "auto" and arch.tensors and not (cpu and arch.quantization_config):
        tied_head = arch.tie_word_embeddings
        tensors = [t for t in arch.tensors if not (tied_head and t.name in ("lm_head.weight", "output.weight"))
                   and t.name != "rope_freqs.weight"]   # (Llama 3.x GGUF: RoPE factors, not a weight)
        if arch.source in ("gguf", "builtin"):   # a GGUF as the engine holds it (each rank its slices)
            fb = 4 if cpu else FLOAT_FORMATS.get(arch.serving_dtype, 2)
            tensors = [TensorInfo(t.name, t.shape, t.dtype, held_bytes(t.dtype, t.shape, fb, device))
                       for t in tensors]
        elif arch.source not in ("gguf", "builtin") and not arch.quantization_config:
            tensors = [_as_held(t, arch) for t in tensors]
        by: dict[str, int] = {}
        for t in tensors:
            by[_file_group(t.name)] = by.get(_file_group(t.name), 0) + t.nbytes
        kinds = sorted({t.dtype for t in tensors})
        return WeightMemory("auto (" + "/".join(kinds) + ")", "file", count_params(arch),
                            sum(t.nbytes for t in tensors), sum(_file_rank_bytes(t, arch, tp) for t in tensors), by)
    input_scale = 0   # bytes a Linear for its activations' global scale (W4A4 NVFP4, held on the CPU too)
    if fmt == "auto":
        fmt, g = _auto_format(arch)
        group = g or (FP4_BLOCKS.get(fmt, group) if group_size is None else group)
        input_scale = 4 if fmt == "nvfp4" and _fp4_activations(arch) else 0
    known = (fmt in FLOAT_FORMATS or fmt in ("fp8", "fp8-block", "int8", "int4") or fmt in FP4_BLOCKS
             or fmt.upper() in ggml_type_names())
    if not known:
        raise UserInputError(f"unknown --weight-format {fmt!r}: use auto, bfloat16, float16, float32, fp8, fp8-block, "
                             f"int8, int4 (with --group-size), nvfp4, mxfp4, nf4 or a GGML type such as q4_k, q8_0")
    if fmt == "int4" and group_size is not None and group != -1:   # as llmopt quantize refuses it
        odd = next((w for w in (arch.hidden_size, arch.intermediate_size) if w and w % group), None)
        if odd is not None:
            raise UserInputError(f"--group-size {group} does not divide the model's layer width {odd}: use a divisor "
                                 f"such as {next((g for g in defaults.QUANT_GROUP_SIZES if odd % g == 0), -1)} "
                                 "or -1 (per channel)")
    base = FLOAT_FORMATS.get(arch.serving_dtype, 2)
    quantized = fmt in FP4_BLOCKS or (fmt not in FLOAT_FORMATS and fmt.upper() not in ggml_type_names())
    if lm_head_dtype not in ("auto", "float", "int8"):
        raise UserInputError(f"unknown --lm-head-dtype {lm_head_dtype!r}: use auto, float or int8")
    int8_head = lm_head_dtype == "int8" or (lm_head_dtype == "auto" and quantized and cpu)
    by = {}
    total = rank = n = 0
    for p in model_params(arch):
        # the int8 table: the head, or with a tied head the embedding it shares
        q_head = int8_head and p.group == ("embed" if arch.tie_word_embeddings else "head")
        extra = input_scale if p.is_linear else 0   # (replicated: each rank holds the whole scale)
        b = param_bytes(p, p.shape, fmt, group, base, cpu, q_head) + extra
        by[p.group] = by.get(p.group, 0) + b
        total += b
        rank += param_bytes(p, _shard(p, arch, tp), fmt, group, base, cpu, q_head) + extra if tp > 1 else b
        n += p.numel
    label = (f"int4 (group {group})" if fmt == "int4" else fmt) + (", int8 head" if int8_head else "")
    return WeightMemory(label, "config", n, total, rank, by)
