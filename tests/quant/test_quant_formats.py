"""Pack and unpack of the checkpoint formats against bit layouts written out independently here,
with plain Python loops over the bit fields of each int32 word."""

import pytest
import torch

from llmopt.errors import UserInputError
from llmopt.layers.formats import compressed_tensors as ct
from llmopt.layers.formats import unpack_linear
from llmopt.quant.formats import pack_linear, quantization_config
from llmopt.layers.types import FloatQuantized, Int8Quantized, IntQuantized

OUT, IN, GS = 16, 64, 32


def random_int(bits=4, out=OUT, n_in=IN, gs=GS, sym=False, seed=0, zero_min=1):
    g = torch.Generator().manual_seed(seed)
    groups = 1 if gs == -1 else n_in // gs
    q = torch.randint(0, 1 << bits, (out, n_in), generator=g, dtype=torch.int32)
    if sym:
        z = torch.full((out, groups), 1 << (bits - 1), dtype=torch.int32)
    else:
        z = torch.randint(zero_min, 1 << bits, (out, groups), generator=g, dtype=torch.int32)
    s = torch.rand(out, groups, generator=g) * 0.1 + 0.01
    return IntQuantized(qweight=q, scales=s, zeros=z, bits=bits, group_size=gs, sym=sym)


def word(values, bits):
    """The int32 (as PyTorch stores it, signed) whose bit field i holds values[i]."""
    w = 0
    for i, v in enumerate(values):
        assert 0 <= v < (1 << bits)
        w |= int(v) << (bits * i)
    return w - (1 << 32) if w >= 1 << 31 else w


def as_lists(t):
    return t.tolist()


def test_awq_layout_nibble_order():
    qt = random_int()
    t = pack_linear("m", qt, "awq")
    assert set(t) == {"m.qweight", "m.qzeros", "m.scales"}
    q, z = qt.qweight.tolist(), qt.zeros.tolist()
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    expect_w = [[word([q[c * 8 + order[i]][k] for i in range(8)], 4) for c in range(OUT // 8)] for k in range(IN)]
    expect_z = [[word([z[c * 8 + order[i]][g] for i in range(8)], 4) for c in range(OUT // 8)]
                for g in range(IN // GS)]
    assert t["m.qweight"].dtype == torch.int32 and t["m.qweight"].tolist() == expect_w
    assert t["m.qzeros"].tolist() == expect_z
    assert t["m.scales"].dtype == torch.float16 and t["m.scales"].shape == (IN // GS, OUT)
    assert torch.equal(t["m.scales"], qt.scales.t().half())


def test_gptq_layout_input_packed_zeros_minus_one():
    qt = random_int(seed=1)
    t = pack_linear("m", qt, "gptq")
    assert set(t) == {"m.qweight", "m.qzeros", "m.scales", "m.g_idx"}
    q, z = qt.qweight.tolist(), qt.zeros.tolist()
    expect_w = [[word([q[o][r * 8 + j] for j in range(8)], 4) for o in range(OUT)] for r in range(IN // 8)]
    expect_z = [[word([z[c * 8 + j][g] - 1 for j in range(8)], 4) for c in range(OUT // 8)] for g in range(IN // GS)]
    assert t["m.qweight"].tolist() == expect_w
    assert t["m.qzeros"].tolist() == expect_z
    assert t["m.g_idx"].dtype == torch.int32 and t["m.g_idx"].tolist() == [k // GS for k in range(IN)]
    assert t["m.scales"].dtype == torch.float16 and t["m.scales"].shape == (IN // GS, OUT)


def test_gptq_8bit_layout():
    qt = random_int(bits=8, seed=2)
    t = pack_linear("m", qt, "gptq")
    q = qt.qweight.tolist()
    expect_w = [[word([q[o][r * 4 + j] for j in range(4)], 8) for o in range(OUT)] for r in range(IN // 4)]
    assert t["m.qweight"].tolist() == expect_w


def test_ct_pack_quantized_layout_sym_and_asym():
    for sym in (True, False):
        qt = random_int(sym=sym, seed=3)
        t = pack_linear("m", qt, "compressed-tensors")
        q, z = qt.qweight.tolist(), qt.zeros.tolist()
        expect_w = [[word([q[o][c * 8 + j] for j in range(8)], 4) for c in range(IN // 8)] for o in range(OUT)]
        assert t["m.weight_packed"].tolist() == expect_w
        assert t["m.weight_shape"].dtype == torch.int64 and t["m.weight_shape"].tolist() == [OUT, IN]
        assert torch.equal(t["m.weight_scale"], qt.scales)
        if sym:
            assert "m.weight_zero_point" not in t
        else:
            expect_z = [[word([z[r * 8 + j][g] for j in range(8)], 4) for g in range(IN // GS)] for r in range(OUT // 8)]
            assert t["m.weight_zero_point"].tolist() == expect_z


def test_ct_pack_pads_a_ragged_input_dim():
    qt = random_int(n_in=36, gs=-1, sym=True, seed=4)
    t = pack_linear("m", qt, "compressed-tensors")
    q = qt.qweight.tolist()
    assert t["m.weight_packed"].shape == (OUT, 5)
    expect = [[word([q[o][c * 8 + j] if c * 8 + j < 36 else 0 for j in range(8)], 4) for c in range(5)]
              for o in range(OUT)]
    assert t["m.weight_packed"].tolist() == expect
    back = ct.unpack({k[2:]: v for k, v in t.items()}, quantization_config(
        "compressed-tensors", method="rtn", group_size=-1)["config_groups"]["group_0"])
    assert torch.equal(back.qweight, qt.qweight)


@pytest.mark.parametrize("fmt,sym,bits", [("awq", False, 4), ("gptq", True, 4), ("gptq", False, 4), ("gptq", True, 8),
                                          ("compressed-tensors", True, 4), ("compressed-tensors", False, 4),
                                          ("compressed-tensors", True, 8)])
def test_round_trip_to_canonical(fmt, sym, bits):
    qt = random_int(bits=bits, sym=sym, seed=5)
    qt.scales = qt.scales.half().float()   # exactly representable in the fp16 the formats store
    t = pack_linear("a.b", qt, fmt)
    qcfg = quantization_config(fmt, method="gptq", bits=bits, group_size=GS, sym=sym)
    group = qcfg.get("config_groups", {}).get("group_0")
    back = unpack_linear({k[len("a.b."):]: v for k, v in t.items()}, qcfg, group)
    assert torch.equal(back.qweight, qt.qweight) and torch.equal(back.zeros, qt.zeros)
    assert torch.equal(back.scales.float(), qt.scales)
    assert torch.equal(back.dequantize(), qt.dequantize())


def test_gptq_act_order_keeps_g_idx():
    qt = random_int(seed=6)
    perm = torch.randperm(IN, generator=torch.Generator().manual_seed(0))
    qt.g_idx = (torch.argsort(perm) // GS).to(torch.int32)   # column perm[i] belongs to group i // GS
    t = pack_linear("m", qt, "gptq")
    assert t["m.g_idx"].tolist() == qt.g_idx.tolist()
    back = unpack_linear({k[2:]: v for k, v in t.items()}, quantization_config("gptq", method="gptq", group_size=GS))
    assert torch.equal(back.g_idx, qt.g_idx)
    assert torch.allclose(back.dequantize(), qt.dequantize(), rtol=1e-3)
    with pytest.raises(UserInputError):
        pack_linear("m", qt, "awq")
    with pytest.raises(UserInputError):
        pack_linear("m", qt, "compressed-tensors")


def test_unrepresentable_inputs_are_refused():
    with pytest.raises(UserInputError, match="zero point of 0"):
        pack_linear("m", random_int(zero_min=0, seed=7), "gptq")
    with pytest.raises(UserInputError, match="group size"):
        pack_linear("m", random_int(gs=-1, seed=8), "awq")
    with pytest.raises(UserInputError):
        pack_linear("m", random_int(), "exl2")


def test_fp8_and_int8_tensors():
    g = torch.Generator().manual_seed(9)
    w = torch.randn(OUT, IN, generator=g)
    s = w.abs().amax(1, keepdim=True) / 448
    fq = FloatQuantized((w / s).to(torch.float8_e4m3fn), s, "dynamic")
    t = pack_linear("m", fq, "compressed-tensors", dtype=torch.bfloat16)
    assert t["m.weight"].dtype == torch.float8_e4m3fn and torch.equal(t["m.weight"].view(torch.uint8),
                                                                       fq.weight.view(torch.uint8))
    assert t["m.weight_scale"].dtype == torch.bfloat16 and t["m.weight_scale"].shape == (OUT, 1)
    s8 = w.abs().amax(1, keepdim=True) / 127
    iq = Int8Quantized(torch.round(w / s8).to(torch.int8), s8, "dynamic")
    t = pack_linear("m", iq, "compressed-tensors")
    assert t["m.weight"].dtype == torch.int8 and torch.equal(t["m.weight"], iq.weight)
    # weight-only int8 becomes 8-bit pack-quantized (W8A16): codes w + 128, four per word
    t = pack_linear("m", Int8Quantized(iq.weight, s8, "none"), "compressed-tensors")
    wl = iq.weight.tolist()
    expect = [[word([wl[o][c * 4 + j] + 128 for j in range(4)], 8) for c in range(IN // 4)] for o in range(OUT)]
    assert t["m.weight_packed"].tolist() == expect


def test_configs_match_the_peer_tools():
    assert quantization_config("awq", method="awq", bits=4, group_size=64, sym=False) == {
        "quant_method": "awq", "zero_point": True, "group_size": 64, "bits": 4, "version": "gemm",
        "modules_to_not_convert": None}
    g = quantization_config("gptq", method="gptq", bits=4, group_size=128, sym=True, act_order=True, damp=0.01)
    assert {k: g[k] for k in ("bits", "group_size", "desc_act", "sym", "quant_method", "checkpoint_format", "lm_head")} \
        == {"bits": 4, "group_size": 128, "desc_act": True, "sym": True, "quant_method": "gptq",
            "checkpoint_format": "gptq", "lm_head": False}
    c = quantization_config("compressed-tensors", method="fp8", activations="dynamic")
    grp = c["config_groups"]["group_0"]
    assert c["format"] == grp["format"] == "float-quantized" and c["ignore"] == ["lm_head"]
    assert grp["input_activations"]["strategy"] == "token" and grp["input_activations"]["dynamic"] is True
    assert c["quant_method"] == "compressed-tensors" and grp["targets"] == ["Linear"]


def _meta_model(tie=False):
    from llmopt.models.config import ModelConfig
    from llmopt.models.llama import LlamaForCausalLM
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_convert_for_runtime_targets():
    from llmopt.errors import ModelLoadError
    from llmopt.layers.modules import AWQLinear, CTPackedLinear, GPTQLinear
    from llmopt.layers.modules_w8a8 import W8Linear
    from llmopt.layers.runtime import convert_for_runtime
    kinds = lambda m: {n: type(x).__name__ for n, x in m.named_modules() if n.endswith(("proj", "lm_head"))}  # noqa
    m = _meta_model()
    assert convert_for_runtime(m, dict(quantization_config("awq", method="awq", group_size=32),
                                       modules_to_not_convert=["mlp.down_proj"])) == 12
    k = kinds(m)
    assert k["model.layers.0.mlp.down_proj"] == "Linear" and k["lm_head"] == "Linear"
    assert k["model.layers.1.self_attn.q_proj"] == AWQLinear.__name__
    m = _meta_model()
    g = dict(quantization_config("gptq", method="gptq", group_size=32), dynamic={
        r"-:model\.layers\.1\..*": {}, r"+:.*v_proj": {"bits": 8}})
    assert convert_for_runtime(m, g) == 7
    assert isinstance(m.model.layers[0].self_attn.v_proj, GPTQLinear) and m.model.layers[0].self_attn.v_proj.bits == 8
    assert m.model.layers[0].self_attn.q_proj.bits == 4 and type(m.model.layers[1].mlp.up_proj).__name__ == "Linear"
    m = _meta_model()
    c = quantization_config("compressed-tensors", method="int8", activations="dynamic")
    c["ignore"] = ["lm_head", "re:.*mlp\\.gate_proj$"]
    assert convert_for_runtime(m, c) == 12
    assert isinstance(m.model.layers[0].mlp.up_proj, W8Linear) and type(m.model.layers[0].mlp.gate_proj).__name__ == "Linear"
    m = _meta_model()
    c = quantization_config("compressed-tensors", method="rtn", group_size=32)
    c["config_groups"]["group_0"]["targets"] = ["re:.*self_attn\\..*"]
    assert convert_for_runtime(m, c) == 8 and isinstance(m.model.layers[1].self_attn.o_proj, CTPackedLinear)
    with pytest.raises(ModelLoadError, match="lm_head"):
        convert_for_runtime(_meta_model(tie=True), dict(quantization_config("gptq", method="gptq", group_size=32),
                                                         lm_head=True))
    with pytest.raises(ModelLoadError, match="not supported"):
        convert_for_runtime(_meta_model(), {"quant_method": "bitsandbytes"})
