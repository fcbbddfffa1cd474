"""The runtime module of 4-bit float checkpoints (NVFP4, MXFP4, bitsandbytes NF4 / FP4).

Each checkpoint format subclasses `Fp4Linear`: its buffers carry the checkpoint's names, shapes and
dtypes (filled by `LlamaForCausalLM.load_weights`), and `canonical()` turns them into an
Fp4Quantized (llmopt/layers/formats/fp4.py). `finish_loading()` then keeps only the runtime form and
frees the checkpoint's tensors:

- `codes`: uint8 [out, in / 2] in llmopt.kernels.cpu_quant.pack_int4's nibble layout when in % 64
  == 0 (the C++ kernels' int4 layout), else uint8 [out, in], one code a byte;
- `scales`: float32 [out, in / block], every scale level of the format multiplied out;
- `table_name` and `block`: which 16 values the codes index and how many columns a scale covers.

The forward dequantizes a slice of rows at a time (never the whole weight) and multiplies; on CUDA
(nibbles, triton installed) llmopt.kernels.fp4_triton decodes the codes inside a Triton GEMM instead.
A W4A4 layer (`act_kind` nvfp4 / mxfp4: compressed-tensors' NVFP4 and MXFP4 schemes) first
quantizes its input to FP4 and back (llmopt.layers.activations.fake_quantize_fp4, emulation: the
same GEMMs then run on the dequantized activations); the C++ decode layer declines such layers.

Subclasses here: CTFp4Linear (compressed-tensors NVFP4 / MXFP4) and GGUFMxfp4Linear (GGUF MXFP4);
bitsandbytes' is llmopt.layers.modules_bnb.
"""

from __future__ import annotations

import torch

from llmopt.errors import ModelLoadError
from llmopt.kernels import cpu_quant
from llmopt.layers.activations import fake_quantize_fp4
from llmopt.layers.formats import compressed_tensors
from llmopt.layers.formats.fp4 import GGML_MXFP4_BYTES, MXFP4_BLOCK, Fp4Quantized, mxfp4_from_ggml, table
from llmopt.layers.modules import QuantLinear


class Fp4Linear(QuantLinear):
    """A Linear whose weight is 4-bit float codes with block scales; subclasses name the buffers."""

    def __init__(self, in_features: int, out_features: int, bias: bool, table_name: str, block: int) -> None:
        super().__init__(in_features, out_features, bias)
        self.table_name, self.block = table_name, block
        self.nibbles = False   # codes held as pack_int4 nibbles (else a byte a code)
        self._table: torch.Tensor | None = None   # the code set's 16 values on the device of the Triton path
        self.act_kind: str | None = None   # W4A4: the input's FP4 format (nvfp4 / mxfp4), else None

    def canonical(self) -> Fp4Quantized:
        raise NotImplementedError

    def finish_loading(self) -> None:
        self._check_loaded()
        q = self.canonical()
        if q.codes.shape != (self.out_features, self.in_features) or q.block != self.block:
            raise ValueError(f"{type(self).__name__}: codes {tuple(q.codes.shape)} / block {q.block} do not match "
                             f"the layer's [{self.out_features}, {self.in_features}] / block {self.block}")
        input_scale = self._buffers.get("input_global_scale")
        for name in list(self._buffers):
            del self._buffers[name]
        if input_scale is not None:
            self.register_buffer("input_global_scale", input_scale.to(torch.float32).reshape(1), persistent=False)
        self.nibbles = self.in_features % 64 == 0
        codes = cpu_quant.pack_int4(q.codes) if self.nibbles else q.codes.to(torch.uint8).contiguous()
        self.register_buffer("codes", codes, persistent=False)
        self.register_buffer("scales", q.scales.to(torch.float32).contiguous(), persistent=False)

    def runtime(self) -> Fp4Quantized:
        """The loaded weight as an Fp4Quantized (codes one a byte)."""
        q = self._rows(0, self.out_features)
        q.bias = self.bias
        return q

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] (a new tensor each call: tests and references, never the forward)."""
        return self.runtime().dequantize(dtype)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.nibbles and not x2.is_cuda:
            y = cpu_quant.fp4_gemm(x2, self.codes, self.scales, self.block, self.table_name)
            if y is not None:
                return y
        return cpu_quant.sliced_matmul(x2, self.out_features, lambda a, b: self._rows(a, b).dequantize(x2.dtype))

    def _rows(self, a: int, b: int) -> Fp4Quantized:
        """Rows a..b of the loaded weight as an Fp4Quantized (codes one a byte)."""
        codes = self.codes[a:b]
        return Fp4Quantized(cpu_quant.unpack_int4(codes) if self.nibbles else codes, self.scales[a:b],
                            self.table_name, self.block)

    def _triton_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """y [..., out] in x's dtype through llmopt.kernels.fp4_triton (the codes decoded inside a Triton
        GEMM); None where it does not run (codes a byte a code, x not fp16/bf16/fp32, or no triton)."""
        if not self.nibbles or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return None
        try:
            from llmopt.kernels.fp4_triton import fp4_matmul  # deferred: imports triton, an optional dependency
        except ImportError:
            return None
        if self._table is None or self._table.device != x.device:
            self._table = table(self.table_name).to(x.device)
        y = fp4_matmul(x.reshape(-1, self.in_features), self.codes, self.scales, self.block, self._table)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """x as the layer's matmul reads it: FP4 and back for W4A4, else x itself."""
        if self.act_kind is None:
            return x
        return fake_quantize_fp4(x, self.act_kind, getattr(self, "input_global_scale", None))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.quantize_input(x)
        if x.is_cuda:
            y = self._triton_forward(x)
            if y is not None:
                return y
        return cpu_quant.linear_2d(x, self._matmul, self.out_features, self.bias)

    def extra_repr(self) -> str:
        acts = f", activations={self.act_kind}" if self.act_kind else ""
        return super().extra_repr() + f", table={self.table_name}, block={self.block}{acts}"


class CTFp4Linear(Fp4Linear):
    """compressed-tensors nvfp4-pack-quantized (weight_packed uint8 [out, in / 2], weight_scale
    float8_e4m3fn [out, in / 16], weight_global_scale float32 [1]) or mxfp4-pack-quantized (the same
    weight_packed, weight_scale uint8 [out, in / 32]): llmopt.layers.formats.compressed_tensors.
    `activations` True: W4A4 (NVFP4 adds input_global_scale float32 [1], the activations' static
    global scale)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str, activations: bool = False) -> None:
        block = compressed_tensors.FP4_FORMATS[fmt]
        if in_features % block:
            raise ModelLoadError(f"a {fmt} layer of {out_features}x{in_features}: {in_features} columns are not "
                                 f"whole groups of {block}")
        super().__init__(in_features, out_features, bias, "e2m1", block)
        self.fmt = fmt
        nvfp4 = fmt == "nvfp4-pack-quantized"
        self._declare("weight_packed", (out_features, in_features // 2), torch.uint8)
        scale_dtype = torch.float8_e4m3fn if nvfp4 else torch.uint8
        self._declare("weight_scale", (out_features, in_features // block), scale_dtype)
        if nvfp4:
            self._declare("weight_global_scale", (1,), torch.float32)
        if activations:
            self.act_kind = "nvfp4" if nvfp4 else "mxfp4"
            if nvfp4:
                self._declare("input_global_scale", (1,), torch.float32)

    def canonical(self) -> Fp4Quantized:
        t = {n: b for n, b in self._buffers.items() if b is not None}
        return compressed_tensors.unpack_fp4(t, self.fmt, self.bias).as_fp4()

    def extra_repr(self) -> str:
        return super().extra_repr() + f", format={self.fmt}"


class GGUFMxfp4Linear(Fp4Linear):
    """A GGUF MXFP4 tensor (GGML blocks of 32: an E8M0 byte, 16 bytes of nibbles; uint8 [out, in / 32
    * 17], llmopt.layers.formats.fp4.mxfp4_from_ggml), built holding its rows' bytes (`blocks`)
    until finish_loading turns them into the runtime form; a bias, where the model has one, is
    loaded by name."""

    def __init__(self, blocks: torch.Tensor, in_features: int, bias: bool) -> None:
        if in_features % MXFP4_BLOCK or blocks.shape[1] != in_features // MXFP4_BLOCK * GGML_MXFP4_BYTES:
            raise ModelLoadError(f"an MXFP4 tensor of {blocks.shape[1]} bytes a row is not {in_features} columns")
        super().__init__(in_features, blocks.shape[0], bias, "e2m1", MXFP4_BLOCK)
        self.register_buffer("blocks", blocks.contiguous())

    def canonical(self) -> Fp4Quantized:
        return mxfp4_from_ggml(self.blocks, self.bias).as_fp4()

    def extra_repr(self) -> str:
        return super().extra_repr() + ", ggml_type=MXFP4"
