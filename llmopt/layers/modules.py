"""Runtime modules for packed integer checkpoints (AutoAWQ GEMM, GPTQ, compressed-tensors
pack-quantized). Their buffers carry the checkpoint's names, shapes and dtypes, so
`LlamaForCausalLM.load_weights` fills them by name; `finish_loading()` then prepares them to run.

- CPU: the codes are repacked once, at load time, for llmopt.kernels.cpu_quant (4-bit: the grouped
  nibble layout, uint8 [out, in / 2]; other widths: int8 codes [out, in]; float32 scales and
  scale * zero [out, groups]; act-order columns sorted by group) and the checkpoint's tensors are
  freed; forward decodes inside the GEMV/GEMM. No float copy of the weight is kept. A layer the
  kernels cannot take (unequal act-order groups, widths not a multiple of 8) dequantizes per call.
- CUDA: the codes are repacked once, at load time, into the W4A16 kernel's layout (int32 words of
  consecutive input rows, [in / 8, out], like GPTQ's qweight; act-order columns sorted by group) and
  the checkpoint's tensors are freed; forward runs llmopt.kernels.w4a16.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmopt.errors import ModelLoadError
from llmopt.kernels import cpu_quant
from llmopt.layers.formats import awq, compressed_tensors, gptq
from llmopt.layers.formats.packing import codes_per_word, pack_codes
from llmopt.layers.types import IntQuantized


def dequantize_fast(qt: IntQuantized, dtype: torch.dtype) -> torch.Tensor:
    """IntQuantized.dequantize without the [out, in] gathers when groups are contiguous (same numbers)."""
    out, n_in = qt.qweight.shape
    groups = qt.scales.shape[1]
    if qt.g_idx is not None or n_in % groups:
        return qt.dequantize(dtype)
    q = qt.qweight.view(out, groups, n_in // groups).to(torch.float32)
    w = (q - qt.zeros.to(torch.float32)[..., None]) * qt.scales.to(torch.float32)[..., None]
    return w.view(out, n_in).to(dtype)


class QuantLinear(nn.Module):
    """A Linear whose weight lives in checkpoint-named buffers (filled by load_weights)."""

    keep_checkpoint_dtype = True   # load_weights keeps these buffers' stored dtypes (fp16 scales, fp8 codes)

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device="meta"), requires_grad=False)
        else:
            self.bias = None

    def _declare(self, name: str, shape, dtype: torch.dtype) -> None:
        self.register_buffer(name, torch.empty(tuple(shape), dtype=dtype, device="meta"))

    def _check_loaded(self) -> None:
        missing = [n for n, b in self._buffers.items() if b is not None and b.is_meta]
        if missing:
            raise ModelLoadError(f"the checkpoint lacks the quantized tensor {missing[0]!r} of a "
                                 f"{type(self).__name__} ({self.out_features}x{self.in_features})")

    def _bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        return None if self.bias is None else self.bias.to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedIntLinear(QuantLinear):
    """Integer group quantization; subclasses name the buffers and unpack them."""

    def __init__(self, in_features: int, out_features: int, bias: bool, bits: int, group_size: int, sym: bool):
        super().__init__(in_features, out_features, bias)
        self.bits, self.group_size, self.sym = bits, group_size, sym
        self.per = codes_per_word(bits)
        gs = in_features if group_size == -1 else group_size
        self.n_groups = -(-in_features // gs)
        self._kernel: tuple | None = None   # (qweight [in/per, out], scales [G, out], zeros [G, out], perm, gs)
        self._cpu: tuple | None = None      # (cpu_quant.KINDS key, group size): cpu_codes/cpu_scales/... buffers

    def canonical(self) -> IntQuantized:
        raise NotImplementedError

    def finish_loading(self) -> None:
        self._check_loaded()
        self._prepare()

    def _prepare(self) -> None:
        dev = self._buffer_device().type
        if dev == "cuda":
            self._prepare_kernel()
        elif dev == "cpu":
            self._prepare_cpu()

    def _prepare_cpu(self) -> None:
        """Repack for llmopt.kernels.cpu_quant and free the checkpoint's tensors."""
        qt = self.canonical()
        k = qt.in_features
        gs = k if qt.group_size == -1 else qt.group_size
        codes, g, perm = qt.qweight, qt.group_index(), None
        if qt.g_idx is not None:
            perm = torch.argsort(g, stable=True)
            if torch.equal(perm, torch.arange(k)):
                perm = None
            else:
                codes, g = codes[:, perm], g[perm]
        if gs % 8 or k % gs or not torch.equal(g, torch.arange(k) // gs) or qt.scales.shape[1] != k // gs:
            return   # unequal groups or odd widths: dequantized per call (slow, rare)
        scales = qt.scales.float().contiguous()
        zeros = qt.zeros.float()
        if qt.bits == 4 and k % 64 == 0 and (gs == 32 or gs % 64 == 0):
            kind, packed = "w4", cpu_quant.pack_int4(codes)
        else:                      # any width up to 8 bits as int8 codes; 8-bit codes shifted by -128
            shift = 128 if qt.bits == 8 else 0
            kind, packed = "w8", (codes - shift).to(torch.int8).contiguous()
            zeros = zeros - shift
        for name in list(self._buffers):
            del self._buffers[name]
        self.register_buffer("cpu_codes", packed, persistent=False)
        self.register_buffer("cpu_scales", scales, persistent=False)
        self.register_buffer("cpu_szeros", (scales * zeros).contiguous(), persistent=False)
        self.register_buffer("cpu_perm", perm, persistent=False)
        self._cpu = (kind, gs)

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        kind, gs = self._cpu
        if self.cpu_perm is not None:
            x2 = x2[:, self.cpu_perm]
        return cpu_quant.grouped_gemm(kind, x2, self.cpu_codes, self.cpu_scales, self.cpu_szeros, gs)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] (a new tensor each call: tests and references, never the forward)."""
        if self._cpu is None:
            return dequantize_fast(self.canonical(), dtype)
        kind, gs = self._cpu
        w = cpu_quant.grouped_weight(cpu_quant.unpack(kind, self.cpu_codes), self.cpu_scales, self.cpu_szeros, gs)
        if self.cpu_perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.cpu_perm, w)
        return w.to(dtype)

    def _buffer_device(self) -> torch.device:
        return next(b for b in self._buffers.values() if b is not None).device

    def _prepare_kernel(self) -> None:
        try:
            import triton  # noqa: F401
        except ImportError:
            return
        qt = self.canonical()
        codes, g = qt.qweight, qt.group_index()
        perm = None
        gs = qt.in_features if qt.group_size == -1 else qt.group_size
        if qt.g_idx is not None:   # act-order: sort the input columns by group, permute x to match
            perm = torch.argsort(g, stable=True)
            codes, g = codes[:, perm], g[perm]
            if not torch.equal(g, torch.arange(qt.in_features, device=g.device) // gs):
                return   # unequal groups: stay on the dequantized path
        if qt.in_features % self.per or qt.scales.shape[1] != -(-qt.in_features // gs):
            return   # odd widths, or an act-order row shard's groups (llmopt.layers.shard_quant)
        scales = qt.scales.t().contiguous()
        self._kernel = (pack_codes(codes.t(), qt.bits, dim=0), scales, qt.zeros.t().to(scales.dtype).contiguous(),
                        perm, gs)
        for name in list(self._buffers):          # the kernel's copy replaces the checkpoint's tensors
            del self._buffers[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu is not None and not x.is_cuda:
            return cpu_quant.linear_2d(x, self._cpu_matmul, self.out_features, self.bias)
        if self._kernel is not None and x.is_cuda:
            from llmopt.kernels.w4a16 import w4a16_matmul  # deferred: imports triton, an optional dependency
            qweight, scales, zeros, perm, gs = self._kernel
            x2 = x.reshape(-1, self.in_features)
            if perm is not None:
                x2 = x2[:, perm]
            y = w4a16_matmul(x2, qweight, scales, zeros, gs, self.bits)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
            return y.reshape(*x.shape[:-1], self.out_features)
        return F.linear(x, dequantize_fast(self.canonical(), x.dtype), self._bias(x.dtype))   # no copy kept

    def extra_repr(self) -> str:
        return super().extra_repr() + f", bits={self.bits}, group_size={self.group_size}, sym={self.sym}"


class AWQLinear(PackedIntLinear):
    """AutoAWQ GEMM: qweight [in, out/8], qzeros [in/group, out/8], scales [in/group, out]."""

    def __init__(self, in_features, out_features, bias, bits, group_size, sym=False):
        super().__init__(in_features, out_features, bias, bits, group_size, sym)
        if group_size == -1 or in_features % group_size or out_features % self.per:
            raise ModelLoadError(f"an AWQ layer of {out_features}x{in_features} does not fit group size "
                                 f"{group_size} and {bits}-bit packing")
        self._declare("qweight", (in_features, out_features // self.per), torch.int32)
        self._declare("qzeros", (self.n_groups, out_features // self.per), torch.int32)
        self._declare("scales", (self.n_groups, out_features), torch.float16)

    def canonical(self) -> IntQuantized:
        t = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales}
        return awq.unpack(t, self.bits, self.group_size, self.sym)


class GPTQLinear(PackedIntLinear):
    """GPTQ v1 (or v2): qweight [in/8, out], qzeros [G, out/8] (minus one in v1), scales [G, out], g_idx [in]."""

    def __init__(self, in_features, out_features, bias, bits, group_size, sym, checkpoint_format="gptq",
                 n_groups: int | None = None):
        super().__init__(in_features, out_features, bias, bits, group_size, sym)
        if n_groups is not None:   # an act-order row shard keeps every group (llmopt.layers.shard_quant)
            self.n_groups = n_groups
        if in_features % self.per or out_features % self.per:
            raise ModelLoadError(f"a GPTQ layer of {out_features}x{in_features} does not fit {bits}-bit packing")
        self.checkpoint_format = checkpoint_format
        self._declare("qweight", (in_features // self.per, out_features), torch.int32)
        self._declare("qzeros", (self.n_groups, out_features // self.per), torch.int32)
        self._declare("scales", (self.n_groups, out_features), torch.float16)
        self._declare("g_idx", (in_features,), torch.int32)

    def canonical(self) -> IntQuantized:
        t = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales, "g_idx": self.g_idx}
        return gptq.unpack(t, self.bits, self.group_size, self.sym, self.checkpoint_format)


class CTPackedLinear(PackedIntLinear):
    """compressed-tensors pack-quantized: weight_packed [out, in*bits/32], weight_scale [out, G],
    weight_zero_point [out*bits/32, G] (asymmetric only), weight_shape [2]."""

    def __init__(self, in_features, out_features, bias, bits, group_size, sym):
        super().__init__(in_features, out_features, bias, bits, group_size, sym)
        self._declare("weight_packed", (out_features, -(-in_features // self.per)), torch.int32)
        self._declare("weight_scale", (out_features, self.n_groups), torch.bfloat16)
        if not sym:
            self._declare("weight_zero_point", (-(-out_features // self.per), self.n_groups), torch.int32)
        self._declare("weight_shape", (2,), torch.int64)

    def canonical(self) -> IntQuantized:
        t = {n: b for n, b in self._buffers.items() if b is not None}
        group = {"format": "pack-quantized",
                 "weights": {"num_bits": self.bits, "symmetric": self.sym, "group_size": self.group_size,
                             "strategy": "channel" if self.group_size == -1 else "group"}}
        return compressed_tensors.unpack(t, group)

    def finish_loading(self) -> None:
        self._check_loaded()
        if tuple(self.weight_shape.tolist()) != (self.out_features, self.in_features):
            raise ModelLoadError(f"weight_shape {self.weight_shape.tolist()} != the model's "
                                 f"[{self.out_features}, {self.in_features}]")
        self._prepare()
