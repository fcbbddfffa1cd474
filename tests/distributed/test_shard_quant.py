"""llmopt.layers.shard_quant: tensor-parallel shards of quantized tensors. Each format's tensors are
written by the project's packers (llmopt.quant.formats.pack_linear over tests/quant_util's
quantizers), cut for 2 and 3 ranks by column and by row, loaded into the runtime module built with
the shard's features (its own shape checks), and dequantized: the shards are exactly the slices of
the full module's weight. Also through safetensors' get_slice (reading only the shard), the
refusals, act-order GPTQ and is_quantized_tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from llmopt.layers.shard_quant import is_quantized_tensor, row_groups, shard_quantized
from llmopt.errors import UserInputError
from llmopt.quant.formats import pack_linear, quantization_config
from llmopt.layers.modules import AWQLinear, GPTQLinear
from llmopt.layers.runtime import ct_group_for, ct_module
from llmopt.layers.types import FloatQuantized
from quant_util import fp8, int8, rtn

OUT, IN = 48, 192
PREFIX = "model.layers.0.mlp.down_proj"


def fp8_tensor(w):
    s = (w.abs().amax() / 448).reshape(1)
    return FloatQuantized((w / s).clamp(-448, 448).to(torch.float8_e4m3fn), s, "dynamic")


# name -> (format, quantize(w, **config keywords) or None for round-to-nearest, config keywords)
CASES = {
    "awq": ("awq", None, dict(method="awq", bits=4, group_size=32, sym=False)),
    "gptq-asym": ("gptq", None, dict(method="gptq", bits=4, group_size=32, sym=False)),
    "gptq-8bit": ("gptq", None, dict(method="gptq", bits=8, group_size=32, sym=True)),
    "gptq-channel": ("gptq", None, dict(method="gptq", bits=4, group_size=-1, sym=True)),
    "ct-w4a16-sym": ("compressed-tensors", None, dict(method="rtn", bits=4, group_size=32, sym=True)),
    "ct-w4a16-asym": ("compressed-tensors", None, dict(method="rtn", bits=4, group_size=32, sym=False)),
    "ct-w8a16": ("compressed-tensors", None, dict(method="rtn", bits=8, group_size=-1, sym=True)),
    "ct-int8": ("compressed-tensors", lambda w, **_: int8(w), dict(method="int8")),
    "ct-fp8": ("compressed-tensors", lambda w, **_: fp8(w), dict(method="fp8")),
    "ct-fp8-tensor": ("compressed-tensors", lambda w, **_: fp8_tensor(w), dict(method="fp8", fp8_scale="tensor")),
}


def build(case, out=OUT, n_in=IN, seed=0, **kw):
    """(full tensors by checkpoint name, quantization_config, canonical form)."""
    fmt, quantize, qkw = CASES[case]
    qkw = {**qkw, **kw}
    w = torch.randn(out, n_in, generator=torch.Generator().manual_seed(seed))
    qt = quantize(w) if quantize else rtn(w, qkw["bits"], qkw["group_size"], qkw["sym"])
    return pack_linear(PREFIX, qt, fmt), quantization_config(fmt, **qkw), qt


def module(qcfg, n_in, n_out, n_groups=None):
    """The runtime module for one Linear of this config, as convert_for_runtime builds it."""
    method = qcfg["quant_method"]
    if method == "awq":
        return AWQLinear(n_in, n_out, False, bits=qcfg["bits"], group_size=qcfg["group_size"])
    if method == "gptq":
        return GPTQLinear(n_in, n_out, False, qcfg["bits"], qcfg["group_size"], qcfg["sym"], n_groups=n_groups)
    return ct_module(ct_group_for(qcfg, PREFIX), (n_in, n_out, False), PREFIX)


def load(mod, tensors):
    """What LlamaForCausalLM.load_weights does for a quantized module: same shapes, then finish_loading."""
    for name, t in tensors.items():
        local = name.rpartition(".")[2]
        assert tuple(mod._buffers[local].shape) == tuple(t.shape), (local, tuple(t.shape))
        mod._buffers[local] = t
    mod.finish_loading()
    return mod


def dequant(mod):
    return mod.dequantized() if hasattr(mod, "dequantized") else mod.canonical().dequantize()


def shard_all(tensors, qcfg, parallel, rank, world):
    return {n: shard_quantized(n, t, parallel, rank, world, qcfg) for n, t in tensors.items()}


@pytest.mark.parametrize("parallel", ["column", "row"])
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_shards_are_exact_slices_of_the_full_weight(case, world, parallel):
    tensors, qcfg, qt = build(case)
    full = dequant(load(module(qcfg, IN, OUT), tensors))
    assert torch.equal(full, qt.dequantize())
    n_out, n_in = (OUT // world, IN) if parallel == "column" else (OUT, IN // world)
    pieces = [dequant(load(module(qcfg, n_in, n_out), shard_all(tensors, qcfg, parallel, r, world)))
              for r in range(world)]
    assert all(p.shape == (n_out, n_in) for p in pieces)
    assert torch.equal(torch.cat(pieces, dim=0 if parallel == "column" else 1), full)


class Spy:
    """A PySafeSlice that counts the elements it hands out."""

    def __init__(self, sl):
        self.sl, self.read = sl, 0

    def get_shape(self):
        return self.sl.get_shape()

    def __getitem__(self, key):
        t = self.sl[key]
        self.read += t.numel()
        return t


def same(a, b):
    bits = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("case", CASES)
def test_safetensors_get_slice_reads_only_the_shard(case, tmp_path):
    tensors, qcfg, _ = build(case)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with safe_open(str(path), framework="pt") as f:
        for world, parallel in ((2, "column"), (3, "row")):
            read = 0
            for rank in range(world):
                for name in f.keys():
                    spy = Spy(f.get_slice(name))
                    got = shard_quantized(name, spy, parallel, rank, world, qcfg)
                    assert same(got, shard_quantized(name, f.get_tensor(name), parallel, rank, world, qcfg)), name
                    assert spy.read == got.numel(), name
                    read += spy.read
            total = sum(t.numel() for t in tensors.values())
            replicated = sum(t.numel() for n, t in tensors.items()
                             if shard_quantized(n, t, parallel, 0, world, qcfg).shape == t.shape)
            assert replicated < total
            assert read == total + (world - 1) * replicated   # a sliced element is read once, by one rank


@pytest.mark.parametrize("case", ["awq", "gptq-asym", "ct-w4a16-asym"])
def test_a_row_shard_that_splits_a_group_is_refused(case):
    tensors, qcfg, _ = build(case, group_size=64)   # 192 / 2 = 96 input features per rank
    for name, t in tensors.items():
        with pytest.raises(UserInputError, match=r"96 input features per shard .* group size 64"):
            shard_quantized(name, t, "row", 0, 2, qcfg)
        shard_quantized(name, t, "row", 2, 3, qcfg)   # 64 per rank: whole groups


def test_splitting_a_packed_word_or_uneven_features_is_refused():
    tensors, qcfg, _ = build("gptq-channel", n_in=48)   # 24 per rank at world 2, 12 at world 4
    with pytest.raises(UserInputError, match=r"12 input features .* 8 4-bit codes per int32 word"):
        shard_quantized(f"{PREFIX}.qweight", tensors[f"{PREFIX}.qweight"], "row", 0, 4, qcfg)
    with pytest.raises(UserInputError, match=r"48 input features do not split into 5"):
        shard_quantized(f"{PREFIX}.qweight", tensors[f"{PREFIX}.qweight"], "row", 0, 5, qcfg)
    for case in ("awq", "gptq-asym", "ct-w4a16-asym"):         # packed along out: 20 outputs per rank
        tensors, qcfg, _ = build(case, out=40)
        for name, t in tensors.items():
            if not name.endswith(("g_idx",)):
                with pytest.raises(UserInputError, match=r"20 output features .* per int32 word"):
                    shard_quantized(name, t, "column", 1, 2, qcfg)
    tensors, qcfg, qt = build("ct-w4a16-sym", out=40)          # symmetric: no zero points, any out
    piece = dequant(load(module(qcfg, IN, 20), shard_all(tensors, qcfg, "column", 1, 2)))
    assert torch.equal(piece, qt.dequantize()[20:])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("permuted", [True, False])
def test_act_order_row_shards_keep_every_group(world, permuted):
    tensors, qcfg, qt = build("gptq-asym", act_order=True)
    assert qcfg["desc_act"] is True
    if permuted:   # column perm[i] in group i // 32, as GPTQ's desc_act writes g_idx
        perm = torch.randperm(IN, generator=torch.Generator().manual_seed(1))
        qt.g_idx = (torch.argsort(perm) // 32).to(torch.int32)
        tensors = pack_linear(PREFIX, qt, "gptq")
    full = load(module(qcfg, IN, OUT), tensors)
    width, groups = IN // world, row_groups(PREFIX, qcfg, IN, world)
    assert groups == IN // 32
    plain = quantization_config("gptq", method="gptq", group_size=32)
    assert row_groups(PREFIX, plain, IN, world) == IN // world // 32
    assert row_groups(PREFIX, dict(plain, group_size=-1), IN, world) == 1
    with pytest.raises(UserInputError, match="group size 32"):
        row_groups(PREFIX, plain, IN, 4 * world)
    x = torch.randn(5, IN, generator=torch.Generator().manual_seed(2))
    pieces, y = [], 0
    for r in range(world):
        shard = shard_all(tensors, qcfg, "row", r, world)
        assert torch.equal(shard[f"{PREFIX}.g_idx"], tensors[f"{PREFIX}.g_idx"][r * width:(r + 1) * width])
        assert torch.equal(shard[f"{PREFIX}.scales"], tensors[f"{PREFIX}.scales"])
        m = load(module(qcfg, width, OUT, n_groups=groups), shard)
        pieces.append(dequant(m))
        y = y + m(x[:, r * width:(r + 1) * width])
    assert torch.equal(torch.cat(pieces, 1), dequant(full))
    assert torch.allclose(y, full(x), rtol=1e-5, atol=1e-5)   # the row-parallel all-reduce


def test_out_of_order_g_idx_without_desc_act_is_refused():
    tensors, qcfg, qt = build("gptq-asym")
    qt.g_idx = torch.arange(IN - 1, -1, -1, dtype=torch.int32) // 32   # reversed groups
    tensors = pack_linear(PREFIX, qt, "gptq")
    with pytest.raises(UserInputError, match="desc_act"):
        shard_quantized(f"{PREFIX}.g_idx", tensors[f"{PREFIX}.g_idx"], "row", 0, 2, qcfg)


def test_bad_arguments_are_refused():
    tensors, qcfg, _ = build("gptq-asym")
    t = tensors[f"{PREFIX}.qweight"]
    for parallel, rank, match in (("diagonal", 0, "column"), ("row", 2, "rank 2")):
        with pytest.raises(UserInputError, match=match):
            shard_quantized(f"{PREFIX}.qweight", t, parallel, rank, 2, qcfg)
    qcfg["dynamic"] = {r"-:.*down_proj": {}}
    with pytest.raises(UserInputError, match="unquantized"):
        shard_quantized(f"{PREFIX}.qweight", t, "row", 0, 2, qcfg)


FLOAT = ("model.layers.0.input_layernorm.weight", "model.norm.weight", "model.embed_tokens.weight",
         "lm_head.weight", f"{PREFIX}.bias", "model.layers.0.self_attn.q_norm.weight")


@pytest.mark.parametrize("case,quantized", [
    ("awq", ("qweight", "qzeros", "scales")), ("gptq-asym", ("qweight", "qzeros", "scales", "g_idx")),
    ("ct-w4a16-asym", ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape")),
    ("ct-int8", ("weight", "weight_scale")), ("ct-fp8-tensor", ("weight", "weight_scale", "input_scale"))])
def test_is_quantized_tensor(case, quantized):
    _, qcfg, _ = build(case)
    for suffix in quantized:
        assert is_quantized_tensor(f"model.layers.1.self_attn.o_proj.{suffix}", qcfg), suffix
    for name in FLOAT:
        assert not is_quantized_tensor(name, qcfg), name
    assert not is_quantized_tensor(f"{PREFIX}.weight", None)
    if case.startswith("ct-w4"):
        assert not is_quantized_tensor(f"{PREFIX}.weight", qcfg)   # pack-quantized: weight is not stored
    if case == "ct-int8":   # the module decides, when given: compressed-tensors targets Linear by class
        assert not is_quantized_tensor(f"{PREFIX}.weight", qcfg, module=nn.LayerNorm(4))
        assert is_quantized_tensor("model.layers.0.norm_proj.weight", qcfg, module=nn.Linear(1, 1))
