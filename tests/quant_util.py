"""Quantizers written here (plain RTN, FP8, INT8) applied to tiny checkpoints (tests/conftest.py:
make_tiny) in any of our formats, and the references they are compared with."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from llmopt.quant.formats import pack_linear, quantization_config
from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool) -> IntQuantized:
    """Round to nearest per group; zero points clamped to >= 1 so GPTQ v1 can store them."""
    out, n_in = w.shape
    gs = n_in if group_size == -1 else group_size
    g = w.float().reshape(out, n_in // gs, gs)
    maxq = (1 << bits) - 1
    if sym:
        s = g.abs().amax(-1) / ((1 << (bits - 1)) - 1)
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = (hi - lo) / maxq
        z = torch.round(-lo / s).clamp(1, maxq)
    s = s.half().float()   # what fp16-scale formats store, so every reader dequantizes the same numbers
    q = torch.clamp(torch.round(g / s[..., None]) + z[..., None], 0, maxq)
    return IntQuantized(qweight=q.reshape(out, n_in).to(torch.int32), scales=s, zeros=z.to(torch.int32),
                        bits=bits, group_size=group_size, sym=sym)


def fp8(w: torch.Tensor, activations: str = "dynamic") -> FloatQuantized:
    s = (w.abs().amax(1, keepdim=True) / 448).bfloat16().float()
    return FloatQuantized((w / s).clamp(-448, 448).to(torch.float8_e4m3fn), s, activations)


def int8(w: torch.Tensor, activations: str = "dynamic") -> Int8Quantized:
    s = (w.abs().amax(1, keepdim=True) / 127).bfloat16().float()
    return Int8Quantized(torch.round(w / s).clamp(-127, 127).to(torch.int8), s, activations)


def write_quantized(src: Path, dst: Path, fmt: str, quantize, qcfg: dict, dtype=torch.float16,
                    scale_dtype=None) -> dict[str, object]:
    """Quantize every decoder Linear of the float checkpoint in `src` with `quantize(w)`, write the
    `fmt` checkpoint to `dst`; returns {module name: canonical form}."""
    from safetensors.torch import load_file
    state = load_file(str(src / "model.safetensors"))
    out, canon = {}, {}
    for name, t in state.items():
        mod = name[: -len(".weight")]
        if name.endswith(".weight") and mod.split(".", 3)[-1] in LINEARS:
            qt = quantize(t)
            if scale_dtype is not None and isinstance(qt, IntQuantized):   # what the checkpoint will hold
                qt.scales = qt.scales.to(scale_dtype).float()
            canon[mod] = qt
            out.update(pack_linear(mod, qt, fmt, scale_dtype))
        else:
            out[name] = t.to(dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qcfg
    config["torch_dtype"] = config["dtype"] = str(dtype).replace("torch.", "")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return canon


def dequantized_reference(src: Path, canon: dict, dtype=torch.float32, stored=torch.float16):
    """The float transformers model with each quantized Linear's weight replaced by its
    dequantization and every other weight rounded to the `stored` dtype of the checkpoint."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(src, dtype=dtype).eval()
    for p in model.parameters():
        p.data = p.data.to(stored).to(dtype)
    for name, qt in canon.items():
        model.get_submodule(name).weight.data = qt.dequantize(dtype)
    return model


class FakeQuantActivations:
    """Forward pre-hooks that round each quantized Linear's input per token, as W8A8 does:
    fp8: x -> fp8(x / s) * s with s = amax / 448;  int8: x -> round(x / s) * s with s = amax / 127
    (vLLM's scaled_int8_quant; compressed-tensors' own fake quantization divides by 127.5)."""

    def __init__(self, model, names, kind: str, int8_divisor: float = 127.0):
        self.handles = [model.get_submodule(n).register_forward_pre_hook(self._hook) for n in names]
        self.kind, self.int8_divisor = kind, int8_divisor

    def remove(self):
        for h in self.handles:
            h.remove()

    def _hook(self, module, args):
        x = args[0].float()
        amax = x.abs().amax(-1, keepdim=True)
        if self.kind == "fp8":
            s = (amax / 448).clamp(min=1 / (448 * 512))
            return ((x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).to(args[0].dtype),
        s = torch.where(amax > 0, amax / self.int8_divisor, torch.ones_like(amax))
        return (torch.round(x / s).clamp(-128, 127) * s).to(args[0].dtype),


def our_logits(folder: Path, ids: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    from llmopt.models.attention import DenseCausalAttention
    from llmopt.models.loader import load_model
    lm = load_model(str(folder), dtype=dtype, device="cpu", tokenizer=False, lm_head_dtype="float")  # the exact head
    with torch.no_grad():
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        return lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention())).float()


def our_layer(heads=4, kv_heads=4, seed=0):
    """One of our DecoderLayers (hidden 64) with weights N(0, 0.2) (norms around 1), and its context
    for 32 positions."""
    from llmopt.models.attention import DenseCausalAttention
    from llmopt.models.config import ModelConfig
    from llmopt.models.llama import DecoderLayer, rope_cos_sin, rope_inv_freq
    from llmopt.quant.layerwise import LayerContext
    torch.manual_seed(seed)
    cfg = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16, rms_norm_eps=1e-6)
    layer = DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.ndim == 1 else 0.0))
    ctx = LayerContext(*rope_cos_sin(rope_inv_freq(cfg), torch.arange(32), torch.float32), DenseCausalAttention())
    return layer, ctx


__all__ = ["LINEARS", "dequantized_reference", "fp8", "int8", "our_logits", "rtn", "our_layer",
           "write_quantized", "quantization_config"]
