"""The CPU decode step with one C++ call per decoder layer (llmopt/kernels/cpu_decode.cpp).

A decode step of a few sequences (one new token each) spends most of its time between the GEMVs
in Python: ~100 small ops per layer. `CpuDecode` holds one `torch.classes.llmopt_cpu.DecodeLayer`
per layer, referencing (not copying) the layer's weights as loaded: float32 or 16-bit linears, the CPU
layouts of quantized modules (int8 / int4 codes with scales, fp8, 4-bit float codes with their block
scales) and the fused q/k/v and gate/up storage (llmopt/layers/fuse.py). Embedding, the final norm
and the head stay in Python (one call each). The runner uses it on the CPU, for a float32 model and
any KV cache dtype (16-bit rows read widened and written rounded to nearest even, fp8 and int8 ones
quantized as the reference path quantizes them and dequantized inside attention; kivi2: the float
residual written, its 2-bit pages read in place, `run(pages=...)`), for steps of up to
CPU_DECODE_MAX_ROWS tokens: decode steps, speculative decoding's verification steps and prefill
chunks, each token a row that attends over its own prefix (prefill measured 1.1-2.0x faster than
the Python layers for prompts of 256 to 4,000 tokens, docs/benchmarks.md); models it cannot take
run the Python layers.
The weights are read once, when the runner is built: a model changed after that is not seen.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from llmopt import defaults
from llmopt.kernels import cpu_quant

log = logging.getLogger("llmopt.engine")

KF32, KW8, KF8, KBF16, KF16 = 0, 1, 3, 4, 5   # cpu_decode.cpp's Kind (grouped codes': cpu_quant.KINDS, FP4_KINDS)
_FLOAT_KINDS = {torch.float32: KF32, torch.bfloat16: KBF16, torch.float16: KF16}
_EMPTY = torch.empty(0)


def _f32(t: torch.Tensor | None) -> torch.Tensor:
    return _EMPTY if t is None else t.detach().float().contiguous()


def linear_spec(lin) -> tuple | None:
    """(kind, weight, scales, scale * zeros, bias, act-order perm, group size) of a linear the C++
    layer runs, or None."""
    from llmopt.layers.modules import PackedIntLinear   # deferred: start-up time (quantized modules)
    from llmopt.layers.modules16 import Linear16   # deferred: start-up time
    from llmopt.layers.modules_fp4 import Fp4Linear   # deferred: start-up time (quantized modules)
    from llmopt.layers.modules_w8a8 import W8Linear   # deferred: start-up time
    if isinstance(lin, tuple):   # fused float weights (w, b): float32, or 16-bit (Linear16)
        w, b = lin
        if w.dtype not in _FLOAT_KINDS or w.is_meta:
            return None
        return (_FLOAT_KINDS[w.dtype], w.detach().contiguous(), _EMPTY, _EMPTY, _f32(b), _EMPTY, w.shape[1])
    if lin._forward_hooks or lin._forward_pre_hooks:
        return None
    bias = _f32(lin.bias)
    if type(lin) is nn.Linear or type(lin) is Linear16:
        return linear_spec((lin.weight, lin.bias))
    if isinstance(lin, PackedIntLinear) and lin._cpu is not None:
        kind, gs = lin._cpu
        perm = _EMPTY if lin.cpu_perm is None else lin.cpu_perm.long().contiguous()
        return (cpu_quant.KINDS[kind][1], lin.cpu_codes, lin.cpu_scales, lin.cpu_szeros, bias, perm, gs)
    if isinstance(lin, Fp4Linear) and lin.nibbles and lin.act_kind is None:   # (W4A4: the Python layer quantizes x)
        return (cpu_quant.FP4_KINDS[lin.table_name], lin.codes, lin.scales, _EMPTY, bias, _EMPTY, lin.block)
    if type(lin) is W8Linear and lin.activations != "dynamic" and not lin.weight.is_meta:
        s, k = _f32(lin.weight_scale).reshape(-1), lin.in_features
        if lin.kind == "fp8":
            return (KF8, lin.weight.view(torch.uint8), s, _EMPTY, bias, _EMPTY, k)
        return (KW8, lin.weight, s, _EMPTY, bias, _EMPTY, k)
    return None


def _group(owner: nn.Module, attr: str, names) -> list | None:
    """The specs of the linears `names` of owner (one, when fused), or None."""
    f = getattr(owner, attr)
    if f is not None and f.backs(owner) and not any(getattr(owner, n)._forward_hooks for n in names):
        spec = linear_spec(f.run)
        return None if spec is None else [spec]
    specs = [linear_spec(getattr(owner, n)) for n in names]
    return None if any(s is None for s in specs) else specs


def _layer_object(layer, cfg, scale: float):
    a, mlp = layer.self_attn, layer.mlp
    groups = [_group(a, "_qkv", ("q_proj", "k_proj", "v_proj")), [linear_spec(a.o_proj)],
              _group(mlp, "_gate_up", ("gate_proj", "up_proj")), [linear_spec(mlp.down_proj)]]
    if any(g is None or None in g for g in groups):
        return None
    norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([a.q_norm, a.k_norm] if a.q_norm else [])
    if any(n._forward_hooks or n._forward_pre_hooks or n.weight.dtype != torch.float32 for n in norms):
        return None
    qn, kn = (_f32(a.q_norm.weight), _f32(a.k_norm.weight)) if a.q_norm is not None else (_EMPTY, _EMPTY)
    obj = torch.classes.llmopt_cpu.DecodeLayer(
        cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, cfg.intermediate_size,
        -1 if a.window is None else int(a.window), float(cfg.rms_norm_eps), float(scale),
        _f32(layer.input_layernorm.weight), _f32(layer.post_attention_layernorm.weight), qn, kn)
    for role, specs in enumerate(groups):
        for spec in specs:
            obj.add_linear(role, *spec)
    obj.set_int8_activations(defaults.CPU_DECODE_INT8_ACTIVATIONS)
    return obj


class CpuDecode:
    max_rows = defaults.CPU_DECODE_MAX_ROWS

    def __init__(self, model, layers: list) -> None:
        self.model = model
        self.layers = layers
        from llmopt.layers.modules_w8a8 import Int8Head   # deferred: start-up time (quantized modules)
        head = model.lm_head   # the int8 head (quantized models): integer tiles too, its codes in [-127, 127]
        self.int8_head = type(head) is Int8Head and not head._forward_hooks and \
            bool(head.codes.min() > -128) and head.in_features % 32 == 0
        from llmopt.layers.modules16 import Linear16   # deferred: start-up time
        self.float_head = type(head) in (nn.Linear, Linear16) and head.bias is None and not head._forward_hooks and \
            head.weight.dtype in _FLOAT_KINDS and head.weight.is_contiguous()   # both cores: aten's M = 1 GEMV uses one
        self.int8_activations = defaults.CPU_DECODE_INT8_ACTIVATIONS

    def set_int8_activations(self, on: bool) -> None:
        """Integer tiles with int8 activations for int8/int4 and FP4 E2M1 weights (the layers and the int8 head)."""
        self.int8_activations = on
        for layer in self.layers:
            layer.set_int8_activations(on)

    @classmethod
    def build(cls, runner) -> "CpuDecode | None":
        """The C++ decode step for the runner's model, or None (and why, in the debug log) where it
        does not apply: not the CPU, not float32, tensor parallel, no C++
        kernels, or a layer whose modules it does not know (or that carry hooks)."""
        from llmopt.models.llama import LlamaForCausalLM   # deferred: start-up time (model code)
        model = runner.model
        why = None
        if runner.device.type != "cpu" or runner.dtype != torch.float32 or runner.backend != "torch":
            why = "needs a float32 model on the CPU with the torch backend"
        elif runner.tp is not None or not isinstance(model, LlamaForCausalLM):
            why = "needs no tensor parallelism and a Llama-family model"
        elif cpu_quant.ops() is None or not hasattr(torch.classes.llmopt_cpu, "DecodeLayer"):
            why = "the C++ kernels are not available"
        if why is None:
            layers = [_layer_object(layer, runner.cfg, runner.scale) for layer in model.model.layers]
            if any(o is None for o in layers):
                why = "a layer holds modules it does not run"
            else:
                return cls(model, layers)
        log.debug("C++ decode layers off: %s", why)
        return None

    @staticmethod
    def rows_context(attn, seq_idx: torch.Tensor, positions: torch.Tensor):
        """The step's tables per token row: row t of sequence s gets s's block table and the context
        length positions[t] + 1 (a verified draft sees the drafts before it, not after), and kivi2's
        quant_blocks[s] (None without pages); per KV-cache group (`for_layer`)."""
        from types import SimpleNamespace
        lens = (positions + 1).to(torch.int32)
        steps = [SimpleNamespace(block_tables=st.block_tables[seq_idx].contiguous(), seq_lens=lens,
                                 slot_mapping=st.slot_mapping,
                                 quant_blocks=None if st.quant_blocks is None else st.quant_blocks[seq_idx])
                 for st in [attn] + attn.group_steps]
        first = steps[0]
        first.for_layer = lambda i: steps[attn.r.layer_group[i]]
        return first

    def run(self, ids: torch.Tensor, positions: torch.Tensor, attn, key_caches, value_caches,
            logit_rows: torch.Tensor | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
            k_scale_caches: list | None = None, v_scale_caches: list | None = None,
            pages: tuple | None = None) -> torch.Tensor:
        """Float32 logits [len(logit_rows) or len(ids), vocab] of a step of token rows: row t attends
        over attn.block_tables[t] up to attn.seq_lens[t] (its own position included). k_scale, v_scale:
        an fp8 cache's scales; k/v_scale_caches: an int8 cache's, one tensor a layer. pages: kivi2's
        (key pages, value pages), one tensor a layer each, the caches being its residual: row t reads
        its first attn.quant_blocks[t] blocks from the pages (llmopt/kernels/kivi.py)."""
        from llmopt.models.llama import rope_cos_sin   # deferred: start-up time (model code)
        key_pages, value_pages = pages if pages is not None else (None, None)
        quant_blocks = _EMPTY
        if pages is not None:
            if attn.quant_blocks is None:
                raise ValueError("kivi2 pages need the step's quant_blocks")
            quant_blocks = attn.quant_blocks.to(torch.int32).contiguous()
        m = self.model
        x = m.embed(ids).contiguous()   # a new tensor: the layers update it in place
        cos, sin = rope_cos_sin(m.inv_freq, positions, x.dtype)
        cos, sin = cos.contiguous(), sin.contiguous()
        capture, aux = m.capture_hidden, []
        for i, layer in enumerate(self.layers):
            if capture is not None and i in capture:
                aux.append(x.clone())
            st = attn.for_layer(i)   # the layer's KV-cache group: its tables and slots
            layer.forward(x, cos, sin, key_caches[i], value_caches[i], st.block_tables, st.seq_lens,
                          st.slot_mapping, k_scale, v_scale, k_scale_caches[i] if k_scale_caches else _EMPTY,
                          v_scale_caches[i] if v_scale_caches else _EMPTY,
                          _EMPTY if key_pages is None else key_pages[i], _EMPTY if value_pages is None else value_pages[i],
                          quant_blocks)
        h = m.model.norm(x)
        if capture is not None:
            m.captured = (h, aux)
        if logit_rows is not None:
            h = h[logit_rows]
        head = m.lm_head
        if self.float_head:
            return torch.ops.llmopt_cpu.f32_gemm(h, head.weight)
        if self.int8_head and self.int8_activations:
            return torch.ops.llmopt_cpu.idot_gemm(h, head.codes, head.scales_col, _EMPTY, head.in_features, KW8, True)
        return m.compute_logits(h).float()
