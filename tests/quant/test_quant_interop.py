"""Our quantized checkpoints in the peer tools, and theirs in ours. Needs the `interop` extra
(gptqmodel, optimum, compressed-tensors): a missing package fails here at import.

Each test writes a tiny random Llama quantized with the plain RTN of quant_util in one format, then
checks three models against each other on the same tokens:
  ref   transformers' float model with the dequantized weights (float32, an exact oracle),
  ours  llmopt.models.loader.load_model on the quantized folder (float32 on the CPU),
  hf    transformers loading the quantized folder (gptqmodel kernels compute in fp16).
"""

import compressed_tensors  # noqa: F401  (the interop extra: fail, never skip, without it)
import gptqmodel  # noqa: F401
import optimum  # noqa: F401
import pytest
import torch
from transformers import AutoModelForCausalLM

from llmopt.errors import ModelLoadError
from llmopt.layers.formats import unpack_linear
from llmopt.quant.formats import quantization_config
from llmopt.layers.formats.packing import unpack_codes
from llmopt.layers.types import IntQuantized
from quant_util import FakeQuantActivations, dequantized_reference, fp8, int8, our_logits, rtn, write_quantized

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
FP16_TOL = 2e-2     # fp16 activations through two layers, logits of magnitude ~1


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _hf(folder, dtype):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu").eval()


@pytest.fixture(scope="module")
def base(tiny_factory):
    # weights N(0, 0.2): big enough that quantization matters, like a trained model's
    return tiny_factory(weight_std=0.2, max_position_embeddings=64)


def rtn_act_order(w: torch.Tensor, bits: int, gs: int, sym: bool, seed: int = 0) -> IntQuantized:
    """RTN over the columns in a random order (GPTQ act-order's layout): column perm[i] is in group i // gs."""
    perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    qt = rtn(w[:, perm], bits, gs, sym)
    codes = torch.empty_like(qt.qweight)
    codes[:, perm] = qt.qweight
    qt.qweight, qt.g_idx = codes, (torch.argsort(perm) // gs).to(torch.int32)
    return qt


def _check_three_ways(base, folder, canon, hf_dtype, stored=torch.float16, hf_tol=FP16_TOL):
    ref = _logits(dequantized_reference(base, canon, stored=stored))
    ours = our_logits(folder, IDS)
    hf = _logits(_hf(folder, hf_dtype))
    quant_effect = (_logits(dequantized_reference(base, {}, stored=stored)) - ref).abs().max()
    assert quant_effect > max(5 * hf_tol, 1e-3)    # the quantization is visible: the comparisons below can fail
    assert (ours - ref).abs().max() < 1e-4
    assert (hf - ours).abs().max() < hf_tol


@pytest.mark.parametrize("sym,act_order", [(True, False), (False, True)])
def test_gptq_checkpoint_in_transformers_and_ours(base, tmp_path, sym, act_order):
    quantize = (lambda w: rtn_act_order(w, 4, 32, sym)) if act_order else (lambda w: rtn(w, 4, 32, sym))
    qcfg = quantization_config("gptq", method="gptq", bits=4, group_size=32, sym=sym, act_order=act_order)
    canon = write_quantized(base, tmp_path, "gptq", quantize, qcfg)
    if act_order:
        assert any(qt.g_idx is not None for qt in canon.values())
    _check_three_ways(base, tmp_path, canon, torch.float16)


def test_awq_checkpoint_in_transformers_and_ours(base, tmp_path):
    qcfg = quantization_config("awq", method="awq", bits=4, group_size=32, sym=False)
    canon = write_quantized(base, tmp_path, "awq", lambda w: rtn(w, 4, 32, False), qcfg)
    _check_three_ways(base, tmp_path, canon, torch.float16)


def test_ct_w4a16_in_transformers_and_ours(base, tmp_path):
    qcfg = quantization_config("compressed-tensors", method="rtn", bits=4, group_size=32, sym=True)
    canon = write_quantized(base, tmp_path, "compressed-tensors", lambda w: rtn(w, 4, 32, True), qcfg,
                            dtype=torch.bfloat16, scale_dtype=torch.bfloat16)
    # transformers decompresses into float Linears: run it in float32, tight against the oracle
    _check_three_ways(base, tmp_path, canon, torch.float32, stored=torch.bfloat16, hf_tol=1e-4)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_ct_w8a8_in_transformers_and_ours(base, tmp_path, kind):
    quantize = fp8 if kind == "fp8" else int8
    qcfg = quantization_config("compressed-tensors", method=kind, activations="dynamic")
    canon = write_quantized(base, tmp_path, "compressed-tensors", quantize, qcfg, dtype=torch.bfloat16,
                            scale_dtype=torch.bfloat16)
    ref_model = dequantized_reference(base, canon, stored=torch.bfloat16)
    weights_only = _logits(ref_model)
    # the oracle quantizes each Linear's input per token, as vLLM does
    hooks = FakeQuantActivations(ref_model, canon, kind)
    w8a8 = _logits(ref_model)
    hooks.remove()
    assert (w8a8 - weights_only).abs().max() > 1e-3      # activation rounding is visible
    assert (our_logits(tmp_path, IDS) - w8a8).abs().max() < 1e-4
    # transformers on the CPU decompresses the weights and fake-quantizes the activations with
    # compressed-tensors' own rule (int8: amax / 127.5 where vLLM and we use amax / 127)
    hf = _hf(tmp_path, torch.float32)
    hf_logits = _logits(hf)
    for name, qt in canon.items():   # decompressed by the first forward
        assert torch.equal(hf.get_submodule(name).weight.float(), qt.dequantize(torch.float32))
    FakeQuantActivations(ref_model, canon, kind, int8_divisor=127.5)
    assert (hf_logits - _logits(ref_model)).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_ct_weight_only_8bit_in_transformers_and_ours(base, tmp_path, kind):
    """FP8 weight-only is naive-quantized; INT8 weight-only is 8-bit pack-quantized (W8A16)."""
    quantize = (lambda w: fp8(w, "none")) if kind == "fp8" else (lambda w: int8(w, "none"))
    qcfg = quantization_config("compressed-tensors", method=kind, activations="none")
    assert qcfg["format"] == ("naive-quantized" if kind == "fp8" else "pack-quantized")
    canon = write_quantized(base, tmp_path, "compressed-tensors", quantize, qcfg, dtype=torch.bfloat16,
                            scale_dtype=torch.bfloat16)
    _check_three_ways(base, tmp_path, canon, torch.float32, stored=torch.bfloat16, hf_tol=1e-4)


def test_ct_asymmetric_w4a16_decompressed_by_compressed_tensors(base):
    """transformers + compressed-tensors 0.20.1 cannot allocate asymmetric pack-quantized modules
    (its meta path leaves weight_zero_point unpacked), so check the tensors with the library's own
    decompressor, as vLLM reads the same layout."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from llmopt.quant.formats import pack_linear
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1))
    qt = rtn(w, 4, 32, sym=False)
    qt.scales = qt.scales.bfloat16()
    t = {k[2:]: v for k, v in pack_linear("m", qt, "compressed-tensors").items()}
    group = quantization_config("compressed-tensors", method="rtn", group_size=32, sym=False)["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    dense = PackedQuantizationCompressor.decompress(t, scheme)["weight"]
    assert torch.equal(dense.float(), qt.dequantize(torch.float32).bfloat16().float())


@pytest.mark.parametrize("sym", [True, False])
def test_our_writers_equal_the_peer_writers(sym):
    """Bit-identical tensors to GPTQModel's GPTQ v1 writer (pack, then v2 -> v1), its AutoAWQ GEMM
    writer, and compressed-tensors' pack-quantized compressor, for the same codes."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from gptqmodel import QuantizeConfig
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    from gptqmodel.utils.model import convert_gptq_v2_to_v1_format_module
    from llmopt.quant.formats import pack_linear
    qt = rtn(torch.randn(64, 128, generator=torch.Generator().manual_seed(3)), 4, 32, sym)
    lin = torch.nn.Linear(128, 64, bias=False)
    lin.weight.data = qt.dequantize(torch.float32)       # their writers re-round W: the same codes
    m = TorchLinear(bits=4, group_size=32, sym=sym, desc_act=False, in_features=128, out_features=64, bias=False,
                    register_buffers=True)
    m.pack_original(lin, qt.scales, qt.zeros, qt.group_index().int())
    convert_gptq_v2_to_v1_format_module(m, QuantizeConfig(bits=4, group_size=32, sym=sym))
    ours = pack_linear("m", qt, "gptq")
    for k in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(getattr(m, k), ours[f"m.{k}"]), k
    a = AwqTorchLinear(bits=4, group_size=32, sym=sym, desc_act=False, in_features=128, out_features=64, bias=False,
                       register_buffers=True)
    a.pack(lin, qt.scales, qt.zeros)
    ours = pack_linear("m", qt, "awq")
    for k in ("qweight", "qzeros", "scales"):
        assert torch.equal(getattr(a, k), ours[f"m.{k}"]), k
    qcfg = quantization_config("compressed-tensors", method="rtn", group_size=32, sym=sym)
    state = {"weight": lin.weight.data, "weight_scale": qt.scales}
    if not sym:
        state["weight_zero_point"] = (qt.zeros - 8).to(torch.int8)
    theirs = PackedQuantizationCompressor.compress(state, QuantizationScheme.model_validate(
        qcfg["config_groups"]["group_0"]))
    ours = pack_linear("m", qt, "compressed-tensors")
    assert set(theirs) == {k[2:] for k in ours}
    for k, v in theirs.items():
        assert torch.equal(v, ours[f"m.{k}"]), k


def test_peer_packers_read_by_our_unpackers():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from gptqmodel.quantization.awq.utils.packing_utils import pack_awq
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (48, 64), generator=g, dtype=torch.int32)        # [in, out] as AWQ holds it
    zeros = torch.randint(0, 16, (3, 64), generator=g, dtype=torch.int32)
    qweight, qzeros = pack_awq(codes, zeros, 4)
    back = unpack_linear({"qweight": qweight, "qzeros": qzeros, "scales": torch.ones(3, 64, dtype=torch.float16)},
                         quantization_config("awq", method="awq", group_size=16))
    assert torch.equal(back.qweight, codes.t()) and torch.equal(back.zeros, zeros.t())
    signed = (codes - 8).to(torch.int8)
    assert torch.equal(unpack_codes(pack_to_int32(signed, 4), 4, dim=1), codes)
    assert torch.equal(unpack_codes(pack_to_int32(signed, 4, packed_dim=0), 4, dim=0), codes)


def test_configs_validate_in_compressed_tensors():
    """Our compressed-tensors configs equal what llm-compressor writes for its preset schemes."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    cases = [("W4A16", dict(method="rtn", bits=4, group_size=128, sym=True)),
             ("W4A16_ASYM", dict(method="rtn", bits=4, group_size=128, sym=False)),
             ("FP8_DYNAMIC", dict(method="fp8", activations="dynamic")),
             ("W8A8", dict(method="int8", activations="dynamic"))]
    for preset, kw in cases:
        ours = quantization_config("compressed-tensors", **kw)
        scheme = preset_name_to_scheme(preset, ["Linear"])
        scheme.format = ours["format"]
        theirs = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=ours["format"],
                                    quantization_status="compressed").model_dump(exclude=["quant_method"])
        assert {k: v for k, v in ours.items() if k not in ("quant_method", "sparsity_config", "transform_config",
                                                           "version")} == theirs, preset
        QuantizationConfig.model_validate(ours)


def test_missing_quantized_tensor_is_a_load_error(base, tmp_path):
    from safetensors.torch import load_file, save_file
    qcfg = quantization_config("gptq", method="gptq", bits=4, group_size=32, sym=True)
    write_quantized(base, tmp_path, "gptq", lambda w: rtn(w, 4, 32, True), qcfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.qzeros"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="qzeros"):
        our_logits(tmp_path, IDS)
