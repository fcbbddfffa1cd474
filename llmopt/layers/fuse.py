"""One call for the Linears that read the same input (q/k/v, gate/up), made once after loading.

Their weights are concatenated along the output dim (float weights and biases, 16-bit ones too; or a quantized
format's packed codes, scales and scale * zero rows, for the CPU kernels) and each module's
tensors are replaced by views into the fused storage, so memory does not grow. `call_fused` runs
the one GEMM (one kernel call instead of three or two) while the fused storage still backs every
module: a module replaced or reloaded (new tensor objects, or new memory under them) makes its
owner fall back to separate calls for good; a hooked one is called on its own while the hook is there.

Quantized modules fuse when they share a layout: PackedIntLinear (AWQ, GPTQ, compressed-tensors
pack-quantized, repacked for llmopt.kernels.cpu_quant: int4 grouped nibbles or int8 codes) with
equal bits, group size and act-order permutation (GPTQ's g_idx gives q/k/v one permutation when
they were quantized from one Hessian; different permutations stay unfused), W8Linear (int8 /
fp8, weight-only or dynamic W8A8; a per-tensor scale becomes per-row rows) and Fp4Linear
(NVFP4, MXFP4, NF4 / FP4 weight-only, loaded: one code table and block; every scale level is
already multiplied into the float32 block scales, so their rows concatenate).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt.layers.modules import PackedIntLinear
from llmopt.layers.modules16 import Linear16
from llmopt.layers.modules_fp4 import Fp4Linear
from llmopt.layers.modules_w8a8 import W8Linear


def _tensors(lin: nn.Module) -> tuple:
    return tuple((n, t, t.data_ptr()) for d in (lin._parameters, lin._buffers) for n, t in d.items()
                 if t is not None)


class Fused:
    """The outputs of the owner's Linears `names` on one input from one call: `run` is (w, b) for
    F.linear or a quantized module over the concatenated rows (neither registered with the owner:
    the parameters and buffers the model lists stay the per-module views)."""

    def __init__(self, names, lins, run) -> None:
        self.names = tuple(names)
        self.sizes = [lin.out_features for lin in lins]
        self.run = run
        self.parts = [(lin, _tensors(lin)) for lin in lins]

    def backs(self, owner: nn.Module) -> bool:
        """Whether each Linear is still the module fused and holds the same tensor objects over the
        same memory (a `.data =` swap keeps the object); cheap: called on every eager forward."""
        mods = owner._modules
        for name, (lin, tensors) in zip(self.names, self.parts):
            if mods.get(name) is not lin:
                return False
            for n, t, ptr in tensors:
                if lin._parameters.get(n, lin._buffers.get(n)) is not t or t.data_ptr() != ptr:
                    return False
        return True

    def __call__(self, x: torch.Tensor):
        y = F.linear(x, *self.run) if isinstance(self.run, tuple) else self.run(x)
        return y.split(self.sizes, dim=-1)


def fuse(owner: nn.Module, names, floats: bool = True) -> Fused | None:
    """Fuse the owner's Linears `names` (all float nn.Linear, unless not `floats`; or all quantized
    in one layout), or None."""
    lins = [getattr(owner, n) for n in names]
    if all(type(lin) is nn.Linear for lin in lins):
        run = _fuse_float(lins) if floats else None
    elif all(type(lin) is Linear16 for lin in lins):   # 16-bit float weights: fused as float ones are
        run = _fuse_16bit(lins) if floats else None
    else:
        run = fuse_quantized(lins)
    return None if run is None else Fused(names, lins, run)


def call_fused(owner: nn.Module, attr: str, x: torch.Tensor) -> tuple:
    """The outputs of the Linears fused in `owner.<attr>` (a Fused, or None: not fused) on x."""
    f: Fused | None = getattr(owner, attr)
    if f is None:
        return ()
    lins = [getattr(owner, n) for n in f.names]
    if any(lin._forward_pre_hooks or lin._forward_hooks for lin in lins):
        return tuple(lin(x) for lin in lins)      # someone watches a projection: call each
    if torch.compiler.is_compiling() or f.backs(owner):   # compiled: checked before (drop_stale)
        return f(x)
    setattr(owner, attr, None)                    # a module was replaced or reloaded: separate from now on
    return tuple(lin(x) for lin in lins)


def drop_stale(model: nn.Module) -> int:
    """Unfuse every Fused of the model that no longer backs its modules (the eager forward checks
    this on each call; a compiled graph cannot, so compiling checks first); how many were dropped."""
    n = 0
    for m in model.modules():
        for attr, f in list(vars(m).items()):
            if isinstance(f, Fused) and not f.backs(m):
                setattr(m, attr, None)
                n += 1
    return n


def _same(lins, *attrs) -> bool:
    return all(len({repr(getattr(lin, a)) for lin in lins}) == 1 for a in attrs)


def _fuse_float(lins):
    if any(lin.weight.is_meta for lin in lins) or not _same(lins, "in_features") or \
            len({(lin.weight.dtype, lin.weight.device, lin.bias is None) for lin in lins}) > 1:
        return None
    w = torch.cat([lin.weight.detach() for lin in lins])
    b = torch.cat([lin.bias.detach() for lin in lins]) if lins[0].bias is not None else None
    _point_at(lins, {"weight": w, "bias": b}, params=("weight", "bias"))
    return (w, b)


def _fuse_16bit(lins) -> Linear16 | None:
    first = lins[0]
    if any(lin.weight.is_meta for lin in lins) or not _same(lins, "in_features") or \
            len({(lin.weight.dtype, lin.bias is None) for lin in lins}) > 1:
        return None
    fused = Linear16(first.in_features, sum(lin.out_features for lin in lins), first.bias is not None,
                     first.weight.dtype, device="meta")
    cat = {"weight": torch.cat([lin.weight.detach() for lin in lins])}
    if first.bias is not None:
        cat["bias"] = torch.cat([lin.bias.detach() for lin in lins])
    for name, t in cat.items():
        setattr(fused, name, nn.Parameter(t, requires_grad=False))
    _point_at(lins, cat, params=("weight", "bias"))
    return fused


def fuse_quantized(lins) -> nn.Module | None:
    """One module computing the concatenated outputs of quantized Linears of one input (their
    tensors become views into its rows), or None when they do not share a layout."""
    first = lins[0]
    if any(lin.bias is not None and lin.bias.is_meta for lin in lins) or len({lin.bias is None for lin in lins}) > 1:
        return None
    total = sum(lin.out_features for lin in lins)
    bias = first.bias is not None
    if all(isinstance(lin, PackedIntLinear) and lin._cpu is not None for lin in lins):
        if not _same(lins, "_cpu", "bits", "group_size", "sym", "in_features") or \
                len({(lin.cpu_scales.dtype, _zero_kind(lin.cpu_szeros)) for lin in lins}) > 1 or \
                len({None if lin.cpu_perm is None else tuple(lin.cpu_perm.tolist()) for lin in lins}) > 1:
            return None
        fused = PackedIntLinear(first.in_features, total, bias, first.bits, first.group_size, first.sym)
        fused._cpu = first._cpu
        split = ("cpu_codes", "cpu_scales", "cpu_szeros")
        fused.register_buffer("cpu_perm", first.cpu_perm, persistent=False)
    elif all(isinstance(lin, Fp4Linear) and lin.act_kind is None and "codes" in lin._buffers for lin in lins):
        if not _same(lins, "table_name", "block", "nibbles", "in_features") or \
                len({lin.codes.device for lin in lins}) > 1:
            return None
        fused = Fp4Linear(first.in_features, total, bias, first.table_name, first.block)
        fused.nibbles = first.nibbles
        split = ("codes", "scales")
    elif all(type(lin) is W8Linear and not lin.weight.is_meta for lin in lins):
        if not _same(lins, "kind", "activations", "in_features") or len({lin.weight.device for lin in lins}) > 1:
            return None
        fused = W8Linear(first.in_features, total, bias, first.kind, per_channel=True,
                         activations=first.activations)
        split = ("weight", "weight_scale")
    else:
        return None
    cat = {}
    for name in split:
        parts = [getattr(lin, name) for lin in lins]
        if name == "cpu_szeros" and parts[0].dim() == 1:   # none, or one zero code: the same for all
            fused.register_buffer(name, parts[0], persistent=False)
            continue
        if name == "weight_scale":   # per-tensor scales [1] as rows [out, 1]
            parts = [s.float().reshape(-1, 1).expand(lin.out_features, 1) for s, lin in zip(parts, lins)]
        cat[name] = torch.cat(parts).contiguous()
        fused.register_buffer(name, cat[name], persistent=False)
    if bias:
        cat["bias"] = torch.cat([lin.bias.detach() for lin in lins])
        fused.bias = nn.Parameter(cat["bias"], requires_grad=False)
    _point_at(lins, cat, params=("bias",))
    return fused


def _zero_kind(szeros: torch.Tensor):
    """What a layer holds for its zero points: per group (True), none (False) or one implied zero
    code (its value): layers fuse only where these agree."""
    return szeros.dim() == 2 or (float(szeros) if szeros.numel() else False)


def _point_at(lins, cat: dict, params) -> None:
    """Replace each module's tensors by its rows of the concatenated ones (views: no second copy);
    a tensor whose rows are not the module's (a per-tensor scale) is kept."""
    a = 0
    for lin in lins:
        b = a + lin.out_features
        for name, t in cat.items():
            own = getattr(lin, name, None)
            if t is None or own is None or own.shape[:1] != (lin.out_features,) or own.dtype != t.dtype:
                continue
            if name in params:
                setattr(lin, name, nn.Parameter(t[a:b], requires_grad=False))
            else:
                lin._buffers[name] = t[a:b]
        a = b
