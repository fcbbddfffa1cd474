"""Swap the targeted nn.Linear modules of a model built on the meta device for quantized modules
whose buffers carry the checkpoint's names, before `load_weights` fills them.

Which modules, per format:
- awq:  every Linear except lm_head and names containing a `modules_to_not_convert` entry;
- gptq: every Linear except lm_head (unless `lm_head: true`); `dynamic` entries `-:regex` skip
        modules, `+:regex` (or a bare regex) override bits / group_size / sym / desc_act for them;
- compressed-tensors: Linears matched by a config group's `targets` (`Linear`, an exact name or
  `re:regex`) and not by `ignore` (nvfp4- / mxfp4-pack-quantized groups, weight-only or with the
  NVFP4 / MXFP4 presets' FP4 activations: CTFp4Linear);
- bitsandbytes (4-bit): every Linear but lm_head when `llm_int8_skip_modules` is null, else every
  Linear no listed name matches (transformers' rule: llmopt.layers.formats.bnb.converts).
"""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from llmopt.errors import ModelLoadError
from llmopt.layers.formats import bnb, compressed_tensors, format_of
from llmopt.layers.fp8 import quantize_fp8
from llmopt.layers.int8 import quantize_int8
from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
from llmopt.layers.modules16 import Linear16
from llmopt.layers.modules_bnb import Bnb4bitLinear
from llmopt.layers.modules_fp4 import CTFp4Linear
from llmopt.layers.modules_w8a8 import Int8Embedding, Int8Head, W8Linear, int8_rows


def convert_for_runtime(model: nn.Module, quantization_config: dict) -> int:
    """Replace the targeted Linears in place; returns how many were replaced."""
    qcfg = quantization_config
    fmt = format_of(qcfg)
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    swaps = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        new = _build(fmt, qcfg, name, mod)
        if new is None:
            continue
        if name == "lm_head" and tied:
            raise ModelLoadError("the checkpoint quantizes lm_head but ties it to the embeddings: not supported")
        swaps.append((name, new))
    if not swaps:
        raise ModelLoadError(f"the {fmt} quantization_config targets none of the model's Linear layers")
    for name, new in swaps:
        model.set_submodule(name, new)
    return len(swaps)


def _build(fmt: str, qcfg: dict, name: str, lin: nn.Linear):
    dims = (lin.in_features, lin.out_features, lin.bias is not None)
    if fmt == "awq":
        if name == "lm_head" or any(s in name for s in (qcfg.get("modules_to_not_convert") or [])):
            return None
        bits, group_size = qcfg.get("bits", qcfg.get("w_bit", 4)), qcfg.get("group_size", qcfg.get("q_group_size"))
        if group_size is None:
            raise ModelLoadError("the awq quantization_config has no group_size")
        return AWQLinear(*dims, bits=int(bits), group_size=int(group_size))
    if fmt == "bitsandbytes":
        cfg = bnb.config_of(qcfg)
        return Bnb4bitLinear(*dims, cfg=cfg) if bnb.converts(name, cfg) else None
    if fmt == "gptq":
        args = gptq_args(qcfg, name)
        if args is None:
            return None
        return GPTQLinear(*dims, bits=args["bits"], group_size=args["group_size"], sym=args["sym"],
                          checkpoint_format=str(qcfg.get("checkpoint_format", "gptq")).lower())
    group = ct_group_for(qcfg, name, lin)
    if group is None:
        return None
    return ct_module(group, dims, name)


def gptq_args(qcfg: dict, name: str) -> dict | None:
    if name == "lm_head" and not qcfg.get("lm_head", False):
        return None
    args = {"bits": int(qcfg.get("bits", 4)), "group_size": int(qcfg.get("group_size", 128)),
            "sym": bool(qcfg.get("sym", True))}
    for key, override in (qcfg.get("dynamic") or {}).items():
        if key.startswith("-:"):
            if re.match(key[2:], name):
                return None
            continue
        pattern = key[2:] if key.startswith("+:") else key
        if re.match(pattern, name):
            args.update({k: override[k] for k in ("bits", "group_size", "sym") if k in (override or {})})
    return args


def _matches(name: str, mod: nn.Module, patterns) -> bool:
    for p in patterns or []:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif p == name or p == type(mod).__name__ or (p == "Linear" and isinstance(mod, nn.Linear)):
            return True
    return False


def ct_group_for(qcfg: dict, name: str, mod: nn.Module | None = None) -> dict | None:
    """The compressed-tensors config group that quantizes module `name` (its format filled in), or None."""
    mod = mod if mod is not None else nn.Linear(1, 1, device="meta")
    if _matches(name, mod, qcfg.get("ignore")):
        return None
    for group in (qcfg.get("config_groups") or {}).values():
        if _matches(name, mod, group.get("targets")):
            return dict(group, format=group.get("format") or qcfg.get("format"))
    return None


def ct_module(group: dict, dims: tuple, name: str):
    fmt, w = group.get("format"), group.get("weights") or {}
    acts = "dynamic" if group.get("input_activations") else "none"
    if fmt in compressed_tensors.FP4_FORMATS:
        return _ct_fp4(fmt, group, dims, name)
    if group.get("input_activations") and not group["input_activations"].get("dynamic", False):
        raise ModelLoadError(f"{name}: static activation scales are not supported: llmopt runs dynamic W8A8")
    strategy = w.get("strategy")
    if fmt == "pack-quantized":
        gs = int(w["group_size"]) if strategy == "group" else -1
        if strategy not in ("group", "channel"):
            raise ModelLoadError(f"{name}: pack-quantized strategy {strategy!r} is not supported")
        return CTPackedLinear(*dims, bits=int(w["num_bits"]), group_size=gs, sym=bool(w.get("symmetric", True)))
    kind = {"float": "fp8", "int": "int8"}.get(w.get("type"))
    if fmt in ("float-quantized", "int-quantized", "naive-quantized") and kind and int(w.get("num_bits", 8)) == 8 \
            and strategy in ("channel", "tensor") and w.get("symmetric", True):
        if kind == "int8" and acts == "none":
            raise ModelLoadError(f"{name}: weight-only int8 in {fmt} is not supported (llm-compressor packs it)")
        return W8Linear(*dims, kind=kind, per_channel=strategy == "channel", activations=acts)
    raise ModelLoadError(f"{name}: compressed-tensors format {fmt!r} with weights {w} is not supported: llmopt "
                         "runs pack-quantized (int4/int8), int-quantized (W8A8) and float-quantized (FP8)")


def _ct_fp4(fmt: str, group: dict, dims: tuple, name: str) -> CTFp4Linear:
    """An NVFP4A16 / MXFP4A16 group's Linear, or with input_activations exactly those of
    compressed-tensors' NVFP4 / MXFP4 presets (W4A4: FP4 activations, per block, dynamic) its W4A4 one."""
    w, acts = group.get("weights") or {}, group.get("input_activations")
    nvfp4 = fmt == "nvfp4-pack-quantized"
    want = {"type": "float", "num_bits": 4, "group_size": compressed_tensors.FP4_FORMATS[fmt], "symmetric": True,
            "strategy": "tensor_group" if nvfp4 else "group"}
    checks = [("weights", w, want)]
    if acts:   # NVFP4: per-16 E4M3 scales at run time under a static global scale ("local"); MXFP4: per-32 E8M0
        checks.append(("input activations", acts, dict(want, dynamic="local" if nvfp4 else True)))
    for what, args, want_args in checks:
        got = {k: args.get(k, True if k == "symmetric" else None) for k in want_args}
        odd = {k: v for k, v in got.items() if v != want_args[k]}
        if odd:
            raise ModelLoadError(f"{name}: {fmt} {what} with {odd} are not supported (want {want_args})")
    return CTFp4Linear(*dims, fmt=fmt, activations=bool(acts))


# -- at load time: --quantization int8|fp8 and the int8 LM head ------------------------------------
LOAD_QUANTIZATIONS = ("int8", "fp8")
LM_HEAD_DTYPES = ("auto", "float", "int8")


def convert_for_load_quantization(model: nn.Module, method: str) -> set[str]:
    """--quantization int8|fp8 on a float checkpoint: every decoder Linear becomes a weight-only
    W8Linear (per output channel) before loading; returns the swapped module names, for
    `quantize_as_loaded` to quantize their weights as they stream in."""
    if method not in LOAD_QUANTIZATIONS:
        raise ModelLoadError(f"unknown --quantization {method!r}: use one of {', '.join(LOAD_QUANTIZATIONS)}")
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    for name in names:
        lin = model.get_submodule(name)
        model.set_submodule(name, W8Linear(lin.in_features, lin.out_features, lin.bias is not None, kind=method,
                                           per_channel=True, activations="none"))
    return set(names)


def quantize_as_loaded(weights, names: set[str], method: str):
    """Wrap a (name, tensor) stream: the weights of `names` come out as their int8/fp8 codes and
    per-channel scales (W8Linear's buffers), one Linear at a time; everything else passes through."""
    for name, tensor in weights:
        prefix = name[:-len(".weight")] if name.endswith(".weight") else None
        if prefix not in names:
            yield name, tensor
            continue
        if method == "int8":
            q = quantize_int8(tensor, activations="none")
        else:
            q = quantize_fp8(tensor, "channel", activations="none")
        yield f"{prefix}.weight", q.weight
        yield f"{prefix}.weight_scale", q.weight_scale.float().reshape(-1, 1)


def resolve_lm_head_dtype(choice: str, quantized: bool, device) -> str:
    """auto: int8 for a quantized model on the CPU (llama.cpp's Q4 files hold the head in Q8_0), else float."""
    if choice not in LM_HEAD_DTYPES:
        raise ModelLoadError(f"unknown --lm-head-dtype {choice!r}: use one of {', '.join(LM_HEAD_DTYPES)}")
    if choice == "auto":
        return "int8" if quantized and str(device).startswith("cpu") else "float"
    return choice


def quantize_lm_head(model: nn.Module) -> bool:
    """Replace a float lm_head with an int8-per-row Int8Head (a tied embedding then reads the same
    int8 table through Int8Embedding: no float copy of it stays); False when the head is already
    quantized."""
    head = model.lm_head
    if type(head) is not nn.Linear and type(head) is not Linear16:
        return False
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    dtype = head.weight.dtype if type(head) is nn.Linear else torch.float32   # a 16-bit table computes in float32
    codes, scales = int8_rows(head.weight)
    new = Int8Head(codes.to(head.weight.device), scales.to(head.weight.device))
    model.lm_head = new
    if tied:
        model.model.embed_tokens = Int8Embedding(new, dtype)
    return True


def release_freed_memory() -> None:
    """Hand the heap freed by load-time repacking back to the OS (glibc's malloc_trim): the
    unpacked int32 codes of each layer are temporaries that glibc otherwise keeps resident."""
    import gc
    gc.collect()
    trim_heap()


def trim_heap() -> None:
    """glibc's malloc_trim(0): freed heap pages back to the OS now. Repacking a tensor at a time
    frees temporaries of a few MB each; glibc's growing mmap threshold puts the next ones on the
    heap, which it keeps: a 300M-parameter GGUF peaked at 1.53x its held weights without a trim
    after each tensor, 1.07x with one."""
    import ctypes
    import ctypes.util
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass
