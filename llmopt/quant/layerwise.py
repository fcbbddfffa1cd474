"""Quantize one decoder layer with the calibration activations that reach it.

Each method returns the quantized Linears, the activations for the next layer and the layer's
reconstruction error: ||y_q − y||² / ||y − x||² on the first calibration samples (y the float
layer's output, y_q the quantized one's, x its input: the error relative to what the layer adds).
Propagation follows each method's reference: GPTQ, RTN, FP8 and the 4-bit float methods (NVFP4,
MXFP4 by round to nearest or GPTQ, bitsandbytes NF4) pass on the quantized layer's output; AWQ (as
AutoAWQ) and SmoothQuant pass on the float output. With quantized activations (W8A8, W4A4) the
error and that output include them (the runtime's fake quantization on each Linear's input); W4A4
NVFP4 calibrates each Linear's static input global scale, 448 * 6 / amax of its inputs over the
calibration windows, as llm-compressor's static min/max observer (those inputs as the quantized
layer computes them, the Linears before it quantized, activations included).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn as nn

from llmopt import defaults
from llmopt.layers import fp8, int8
from llmopt.layers.formats.bnb import BnbQuantized
from llmopt.quant import awq, fp4, gptq, nf4, rtn, smoothquant
from llmopt.layers.activations import fake_quantize_fp4, fake_quantize_tokens
from llmopt.quant.config import QuantConfig

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
FORWARD_TOKENS = 4096   # calibration tokens per forward call (bounds the MLP's intermediate activations)


@dataclass
class LayerContext:
    cos: torch.Tensor
    sin: torch.Tensor
    attn: Callable

    def forward(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([layer(xb, self.cos, self.sin, self.attn) for xb in batches(x)])


@dataclass
class LayerOutcome:
    quantized: dict            # linear name (relative to the layer) -> IntQuantized | FloatQuantized | Int8Quantized
    next_x: torch.Tensor
    rel_error: float


def batches(x: torch.Tensor) -> list[torch.Tensor]:
    per = max(1, FORWARD_TOKENS // x.shape[1])
    return list(x.split(per))


class _Stop(Exception):
    pass


def input_of(target: nn.Module, run: Callable[[], object]) -> torch.Tensor:
    """The input `target` receives when `run()` is called; the forward stops right there."""
    box = {}

    def hook(_mod, args):
        box["x"] = args[0]
        raise _Stop

    handle = target.register_forward_pre_hook(hook)
    try:
        run()
    except _Stop:
        pass
    finally:
        handle.remove()
    return box["x"]


def set_weight(lin: nn.Linear, qt) -> None:
    lin.weight.data = dense(qt, lin.weight.dtype)


def dense(qt, dtype: torch.dtype) -> torch.Tensor:
    """A quantized weight's float values (bitsandbytes' stored form through its Fp4Quantized)."""
    return (qt.as_fp4() if isinstance(qt, BnbQuantized) else qt).dequantize(dtype)


@torch.no_grad()
def quantize_layer(layer: nn.Module, x: torch.Tensor, err_samples: int, ctx: LayerContext,
                   qconfig: QuantConfig) -> LayerOutcome:
    ex = x[:err_samples]
    y_ref = ctx.forward(layer, ex)
    quantized, next_x = METHODS[qconfig.method](layer, x, ctx, qconfig)
    handles = input_quantizers(layer, quantized, qconfig, LINEARS)
    try:
        # GPTQ passes on the quantized layer's output: its first samples are y_q
        gptq_like = qconfig.method == "gptq" or qconfig.fp4_algorithm == "gptq"
        y_q = next_x[:ex.shape[0]] if gptq_like and next_x is not None else ctx.forward(layer, ex)
        if next_x is None:
            next_x = y_q if ex.shape[0] == x.shape[0] else ctx.forward(layer, x)
    finally:
        for h in handles:
            h.remove()
    denom = float((y_ref - ex).double().pow(2).sum())
    err = float((y_q - y_ref).double().pow(2).sum()) / max(denom, 1e-30)
    return LayerOutcome(quantized, next_x, err)


def input_quantizers(layer: nn.Module, quantized: dict, qconfig: QuantConfig, names) -> list:
    """Forward pre-hooks on the Linears `names` that quantize their inputs as the runtime modules do
    (layers/modules_w8a8.py, layers/modules_fp4.py), as dequantize(quantize(x)); none without
    quantized activations. The caller removes them."""
    if qconfig.activations != "dynamic" or qconfig.method not in ("fp8", "int8", "nvfp4", "mxfp4"):
        return []
    last: list = []   # (x, global scale, result) of the last call: q/k/v and gate/up read one input

    def hook(n):
        g = getattr(quantized[n], "input_global_scale", None)   # (nvfp4's; mxfp4 and W8A8 have none)

        def pre(_m, a):
            x = a[0]
            if last and last[0] is x and (g is None) == (last[1] is None) and (g is None or torch.equal(g, last[1])):
                return (last[2],)
            y = (fake_quantize_tokens(x, qconfig.method) if qconfig.method in ("fp8", "int8")
                 else fake_quantize_fp4(x, qconfig.method, g))
            last[:] = [x, g, y]
            return (y,)
        return pre

    return [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]


def _linear(layer, name) -> nn.Linear:
    return layer.get_submodule(name)


def _rtn(layer, x, ctx, qconfig):
    out = {}
    for n in LINEARS:
        lin = _linear(layer, n)
        out[n] = rtn.quantize_rtn(lin.weight, qconfig.bits, qconfig.group_size, qconfig.sym, bias=_bias(lin),
                                  scale_dtype=qconfig.scale_torch_dtype)
        set_weight(lin, out[n])
    return out, None


def _fp8(layer, x, ctx, qconfig):
    out = {}
    for n in LINEARS:
        lin = _linear(layer, n)
        out[n] = fp8.quantize_fp8(lin.weight, qconfig.fp8_scale, qconfig.activations, bias=_bias(lin),
                                  scale_dtype=qconfig.scale_torch_dtype)
        set_weight(lin, out[n])
    return out, None


def _gptq(layer, x, ctx, qconfig):
    """True-sequential in one pass: q/k/v from the input norm's output; o from the attention output
    through the quantized q/k/v; gate/up from the post-attention norm of that; down from act(gate)·up
    through the quantized gate/up; then the layer's output for the next layer. Each Linear runs once
    over the calibration tokens (the intermediate activations are kept between the steps; act(gate)·up
    only while it fits `defaults.GPTQ_CACHE_BYTES`, else it is recomputed at the end). Linears that
    share an input (q/k/v, gate/up) share its Hessian and are quantized as one matrix: GPTQ treats
    rows independently, so that equals quantizing each."""
    at, mlp = layer.self_attn, layer.mlp
    out: dict = {}
    xs = batches(x)

    def quantize(names, inputs, width):
        """Hessian over `inputs` (an iterable, so the batches need not all exist at once), then GPTQ."""
        acc = gptq.HessianAccumulator(width)
        for t in inputs:
            acc.add(t)
        out.update(_gptq_rows(layer, names, acc.H, qconfig))

    h = x.shape[-1]
    quantize(LINEARS[:3], (layer.input_layernorm(xb) for xb in xs), h)
    attn_out = [input_of(at.o_proj, lambda xb=xb: at(layer.input_layernorm(xb), ctx.cos, ctx.sin, ctx.attn))
                for xb in xs]
    quantize(LINEARS[3:4], attn_out, at.o_proj.in_features)
    mid = [xb + at.o_proj(ab) for xb, ab in zip(xs, attn_out)]
    del attn_out
    quantize(LINEARS[4:6], (layer.post_attention_layernorm(hb) for hb in mid), h)
    inter_bytes = x.shape[0] * x.shape[1] * mlp.down_proj.in_features * x.element_size()
    keep = inter_bytes <= defaults.GPTQ_CACHE_BYTES
    kept = []

    def down_inputs():
        for hb in mid:
            m = input_of(mlp.down_proj, lambda hb=hb: mlp(layer.post_attention_layernorm(hb)))
            if keep:
                kept.append(m)
            yield m

    quantize(LINEARS[6:], down_inputs(), mlp.down_proj.in_features)
    if keep:
        next_x = torch.cat([hb + mlp.down_proj(m) for hb, m in zip(mid, kept)])
    else:
        next_x = torch.cat([hb + mlp(layer.post_attention_layernorm(hb)) for hb in mid])
    return out, next_x


def _gptq_rows(layer, names, H, qconfig) -> dict:
    """GPTQ on the Linears `names` (same input, so same H) stacked by rows; split back, set the
    dequantized weights in the layer."""
    lins = [_linear(layer, n) for n in names]
    w = torch.cat([lin.weight for lin in lins]) if len(lins) > 1 else lins[0].weight
    if qconfig.method in ("nvfp4", "mxfp4"):
        res = fp4.gptq_fp4(w, H, fp4.grid_for(qconfig.method, qconfig.format, w), damp=qconfig.damp,
                           act_order=qconfig.act_order)
        return _split_fp4(lins, names, res)
    res = gptq.gptq_quantize(w, H, qconfig.bits, qconfig.group_size, qconfig.sym, damp=qconfig.damp, act_order=qconfig.act_order,
                             scale_dtype=qconfig.scale_torch_dtype).quantized
    out, r0 = {}, 0
    for n, lin in zip(names, lins):
        r1 = r0 + lin.out_features
        qt = replace(res, qweight=res.qweight[r0:r1].clone(), scales=res.scales[r0:r1].clone(),
                     zeros=res.zeros[r0:r1].clone(), bias=_bias(lin))
        set_weight(lin, qt)
        out[n], r0 = qt, r1
    return out


def _split_fp4(lins, names, res) -> dict:
    """A stacked FP4 result split back into its Linears (sharing NVFP4's global scale), set in the layer."""
    out, r0 = {}, 0
    for n, lin in zip(names, lins):
        r1 = r0 + lin.out_features
        out[n], r0 = fp4.rows(res, r0, r1, _bias(lin)), r1
        set_weight(lin, out[n])
    return out


# Linears quantized as one matrix: those sharing an input (vLLM fuses them, so NVFP4's global scale is shared)
FUSED_GROUPS = (LINEARS[:3], LINEARS[3:4], LINEARS[4:6], LINEARS[6:])


def _fp4(layer, x, ctx, qconfig):
    """NVFP4 / MXFP4: GPTQ (the `_gptq` pass with FP4 grids) or round to nearest, per fused group;
    W4A4 NVFP4 then calibrates the input global scales. With FP4 activations the output for the next
    layer is left to quantize_layer (which quantizes the activations)."""
    if qconfig.fp4_algorithm == "gptq":
        out, next_x = _gptq(layer, x, ctx, qconfig)
    else:
        out, next_x = {}, None
        for names in FUSED_GROUPS:
            lins = [_linear(layer, n) for n in names]
            w = torch.cat([lin.weight for lin in lins])
            res = fp4.quantize_rtn(w, fp4.grid_for(qconfig.method, qconfig.format, w))
            out.update(_split_fp4(lins, names, res))
    if qconfig.activations != "dynamic":
        return out, next_x
    if qconfig.method == "nvfp4":
        _input_global_scales(layer, x, ctx, qconfig, out)
    return out, None


def _input_global_scales(layer, x, ctx, qconfig, out) -> None:
    """Each Linear's input_global_scale (set on its Nvfp4Quantized in `out`): 448 * 6 / amax of its
    inputs over all of x, the layer run with its weights quantized and the inputs of the Linears
    before it quantized (whose scales are fixed first, in FUSED_GROUPS' order; the Linears of a
    group read one input, so they share the scale)."""
    done: list[str] = []
    for names in FUSED_GROUPS:
        first = _linear(layer, names[0])
        handles = input_quantizers(layer, out, qconfig, done)
        amax = torch.zeros((), dtype=torch.float32)
        try:
            for xb in batches(x):
                a = input_of(first, lambda xb=xb: layer(xb, ctx.cos, ctx.sin, ctx.attn))
                amax = torch.maximum(amax, a.detach().abs().amax().to(torch.float32))
        finally:
            for h in handles:
                h.remove()
        for n in names:
            out[n].input_global_scale = fp4.nvfp4_global_scale(amax)
        done.extend(names)


def _nf4(layer, x, ctx, qconfig):
    """bitsandbytes NF4 with double quantization, blocks of --group-size (64), per Linear."""
    out = {}
    for n in LINEARS:
        lin = _linear(layer, n)
        out[n] = nf4.quantize(lin.weight, block=qconfig.group_size, quant_type="nf4", double_quant=True)
        out[n].bias = _bias(lin)
        set_weight(lin, out[n])
    return out, None


class _InputStats:
    """Forward pre-hooks that keep, per Linear, the mean |x| per channel, the absmax per channel,
    and the raw inputs of the first `keep` samples."""

    def __init__(self, modules: dict[str, nn.Module], keep: int) -> None:
        self.keep, self.seen = keep, 0
        self.sum, self.amax, self.count, self.sample = {}, {}, {}, {k: [] for k in modules}
        self.handles = [m.register_forward_pre_hook(self._hook(k)) for k, m in modules.items()]

    def _hook(self, key):
        def hook(_mod, args):
            a = args[0]
            ab = a.reshape(-1, a.shape[-1]).float().abs()
            # one forward batch (≤ FORWARD_TOKENS rows) sums in float32, the batches in float64: a
            # float64 reduction of the whole [tokens, intermediate] batch costs more than its GEMM
            self.sum[key] = self.sum.get(key, 0) + ab.sum(0).double()
            m = ab.amax(0)
            self.amax[key] = torch.maximum(self.amax[key], m) if key in self.amax else m
            self.count[key] = self.count.get(key, 0) + ab.shape[0]
            room = self.keep - sum(t.shape[0] for t in self.sample[key])
            if room > 0:
                self.sample[key].append(a[:room].clone())
        return hook

    def mean(self, key) -> torch.Tensor:
        return (self.sum[key] / self.count[key]).float()

    def inputs(self, key) -> torch.Tensor:
        return torch.cat(self.sample[key])

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _awq(layer, x, ctx, qconfig):
    at, mlp = layer.self_attn, layer.mlp
    keep = max(1, qconfig.awq_search_tokens // x.shape[1])
    stats = _InputStats({"qkv": at.q_proj, "o": at.o_proj, "mlp": mlp.gate_proj, "down": mlp.down_proj}, keep)
    try:
        next_x = ctx.forward(layer, x)          # float outputs, as AutoAWQ propagates them
    finally:
        stats.close()
    xin = {k: stats.inputs(k) for k in ("qkv", "o", "mlp", "down")}
    q = dict(bits=qconfig.bits, group_size=qconfig.group_size, sym=qconfig.sym, grid=qconfig.awq_grid,
             duo=qconfig.awq_duo_scaling, scale_dtype=qconfig.scale_torch_dtype)
    plan = [("qkv", layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj],
             lambda: at(xin["qkv"], ctx.cos, ctx.sin, ctx.attn))]
    if at.v_proj.weight.shape == at.o_proj.weight.shape:   # AutoAWQ's condition (no GQA): v's rows are o's inputs
        plan.append(("o", at.v_proj, [at.o_proj], lambda: at.o_proj(xin["o"])))
    plan += [("mlp", layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], lambda: mlp(xin["mlp"])),
             ("down", mlp.up_proj, [mlp.down_proj], lambda: mlp.down_proj(xin["down"]))]
    for key, prev, lins, inspect in plan:
        s, _ = awq.search_scales(stats.mean(key), lins, inspect, **q)
        awq.fold_scales(prev, lins, s)
        xin[key] = xin[key] / s
    clip_inputs = {"self_attn.v_proj": "qkv", "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp",
                   "mlp.down_proj": "down"}
    for n, key in clip_inputs.items():       # q and k are not clipped (their errors meet in the softmax)
        lin = _linear(layer, n)
        bounds = awq.search_clip(lin.weight, xin[key], qconfig.bits, qconfig.group_size, qconfig.sym, grid=qconfig.awq_grid,
                                 scale_dtype=qconfig.scale_torch_dtype)
        awq.apply_clip(lin, bounds, qconfig.group_size)
    out, _ = _rtn(layer, x, ctx, qconfig)
    return out, next_x


def _int8(layer, x, ctx, qconfig):
    next_x = None
    if qconfig.activations == "dynamic":
        at, mlp = layer.self_attn, layer.mlp
        stats = _InputStats({"qkv": at.q_proj, "mlp": mlp.gate_proj}, keep=0)
        try:
            next_x = ctx.forward(layer, x)      # smoothing leaves the float function as it is
        finally:
            stats.close()
        smoothquant.smooth(layer.input_layernorm, [at.q_proj, at.k_proj, at.v_proj], stats.amax["qkv"], qconfig.smoothquant_alpha)
        smoothquant.smooth(layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], stats.amax["mlp"],
                    qconfig.smoothquant_alpha)
    out = {}
    for n in LINEARS:
        lin = _linear(layer, n)
        out[n] = int8.quantize_int8(lin.weight, qconfig.activations, bias=_bias(lin), scale_dtype=qconfig.scale_torch_dtype)
        set_weight(lin, out[n])
    return out, next_x


def _bias(lin: nn.Linear):
    return None if lin.bias is None else lin.bias.detach().clone()


METHODS = {"rtn": _rtn, "gptq": _gptq, "awq": _awq, "fp8": _fp8, "int8": _int8, "nvfp4": _fp4, "mxfp4": _fp4,
           "nf4": _nf4}
