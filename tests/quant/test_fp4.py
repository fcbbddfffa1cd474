"""NVFP4 and MXFP4 (#33): the quantizers against float64 formulas written here from the formats'
definitions and against the reference implementations (compressed-tensors' quantization and
compressors, gguf's MXFP4 quantizer and dequantizer); the packers against unpackers written here (E2M1
from its bits, E4M3 and E8M0 scales from theirs); `llmopt quantize` end to end into our engine (the
logits of the float model made from the dequantized weights, within float rounding), transformers
(its compressed-tensors and GGUF integrations) and kv-estimate's byte counts.

transformers 5.25 + compressed-tensors 0.20.1 load and decompress nvfp4- and mxfp4-pack-quantized on
the CPU, but only in bfloat16 (the FP4 decompressor yields bfloat16 weights, which a float32 model's
Linears refuse): those checks run transformers in bfloat16 and compare its decompressed weights exactly.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

from llmopt.cli.app import app
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.layers.formats.fp4 import Mxfp4Quantized, Nvfp4Quantized
from llmopt.layers.runtime import ct_module
from llmopt.quant import fp4
from llmopt.quant.config import QuantConfig
from llmopt.quant.formats import pack_linear, quantization_config
from quant_util import LINEARS, our_logits

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))


# -- the formats' definitions, written here -----------------------------------------------------------
def e2m1_value(c: int) -> float:
    """E2M1: bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; exponent 0 is subnormal (m * 0.5)."""
    s, e, m = c >> 3, (c >> 1) & 3, c & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def e4m3_value(b: int) -> float:
    """E4M3 (fn): bit 7 sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN, no infinities."""
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    if e == 15 and m == 7:
        return float("nan")
    mag = m / 8 * 2.0 ** -6 if e == 0 else 2.0 ** (e - 7) * (1 + m / 8)
    return -mag if s else mag


E2M1 = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float64)
E4M3 = torch.tensor([e4m3_value(b) for b in range(256)], dtype=torch.float64)


def e8m0(e: torch.Tensor) -> torch.Tensor:
    return torch.pow(2.0, e.to(torch.float64) - 127)


def nibbles_low_first(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, n / 2] -> codes [rows, n]: byte j = column 2j (low nibble), 2j + 1 (high)."""
    p = packed.to(torch.int64)
    return torch.stack((p & 15, p >> 4), -1).reshape(p.shape[0], -1)


def nearest_e2m1(y: torch.Tensor, ties: str) -> torch.Tensor:
    """float64 reference: the code of the E2M1 value nearest to clamp(y, -6, 6); `even`: a tie to the
    value whose mantissa bit is 0, the sign from y's sign bit; `down`: a tie to the smaller magnitude,
    0 as code 0."""
    y = y.to(torch.float64).reshape(-1)
    mags = E2M1[:8]
    a = y.abs().clamp(max=6)
    d = (a[:, None] - mags[None, :]).abs()
    best = d.min(1, keepdim=True).values
    cand = d == best
    if ties == "even":
        even = cand & (torch.arange(8) % 2 == 0)
        idx = torch.where(even.any(1), even.float().argmax(1), cand.float().argmax(1))
        neg = torch.signbit(y)
    else:
        idx = cand.float().argmax(1)                 # the first: the smaller magnitude
        neg = (y < 0) & (idx > 0)
    return (idx + 8 * neg.long()).to(torch.uint8)


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 reference: x >= 0 rounded to the nearest finite E4M3 value (ties to an even mantissa),
    saturating at 448."""
    vals = E4M3[:127]                                 # +0 .. 448, ascending
    x = x.to(torch.float64).reshape(-1).clamp(max=448)
    d = (x[:, None] - vals[None, :]).abs()
    cand = d == d.min(1, keepdim=True).values
    even = cand & (torch.arange(127) % 2 == 0)
    return vals[torch.where(even.any(1), even.float().argmax(1), cand.float().argmax(1))]


def test_definitions_are_the_tables():
    from llmopt.layers.formats.fp4 import E2M1 as OURS
    assert torch.equal(E2M1.float(), torch.tensor(OURS))
    assert torch.equal(E4M3[:127].float(), torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float())


def weight(out=48, n_in=128, seed=0) -> torch.Tensor:
    """Rows of different magnitudes, an all-zero block, exact E2M1 ties and an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, n_in, generator=g) * torch.logspace(-3, 0, out)[:, None]
    w[1, :32] = 0
    w[2, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 4.0] + [0.0] * 21)
    w[3, 5] = 40.0
    return w


# -- rounding and scales against float64 formulas --------------------------------------------------
@pytest.mark.parametrize("ties", ["even", "down"])
def test_e2m1_rounding_is_the_nearest_value_with_the_reference_ties(ties):
    grid = torch.arange(-7 * 64, 7 * 64 + 1, dtype=torch.float32) / 64      # every midpoint, exactly
    y = torch.cat([grid, torch.randn(4000) * 3, torch.tensor([-0.0, 0.0, 1e-30, -1e-30, 100.0, -100.0])])
    ours = fp4.e2m1_codes(y, ties)
    assert torch.equal(ours, nearest_e2m1(y, ties))
    assert torch.equal(E2M1[ours.long()], E2M1[nearest_e2m1(y, ties).long()])
    assert E2M1[fp4.e2m1_codes(torch.tensor([0.75, 1.75, 3.5, 0.25, 1.25, 2.5, 5.0]), ties).long()].tolist() == (
        [1.0, 2.0, 4.0, 0.0, 1.0, 2.0, 4.0] if ties == "even" else [0.5, 1.5, 3.0, 0.0, 1.0, 2.0, 4.0])


def test_nvfp4_scales_and_codes_follow_the_definition():
    w = weight()
    q = fp4.quantize_nvfp4(w)
    amax = w.abs().max().double()
    g = q.global_scale.double().item()
    assert abs(g - 448 * 6 / amax.item()) <= 2 * np.spacing(np.float32(g))   # two float32 roundings
    blocks = w.double().reshape(48, -1, 16)
    want = nearest_e4m3(g * blocks.abs().amax(-1) / 6).reshape(48, -1)
    want = torch.where(want == 0, 0.125, want)                 # compressed-tensors: a zero scale becomes eps
    assert torch.equal(q.weight_scale.float().double(), want)
    assert q.weight_scale.float()[1, 0] == 0.125 and q.weight_scale.float().max() == 448
    s = (want / g).float().double()                            # the effective scale, a float32 quotient
    codes = nearest_e2m1(blocks / s[..., None], "even").reshape(w.shape)
    assert torch.equal(q.codes, codes)


@pytest.mark.parametrize("rule", ["ocp", "round"])
def test_mxfp4_scales_and_codes_follow_the_definition(rule):
    w = weight()
    q = fp4.quantize_mxfp4(w, rule)
    blocks = w.double().reshape(48, -1, 32)
    amax = blocks.abs().amax(-1)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, 1.0)))
    if rule == "round":       # compressed-tensors: amax to the nearer power of two when its significand >= 1.75
        e = e + (amax / torch.pow(2.0, e) >= 1.75).double()
    want = torch.where(amax > 0, e - 2 + 127, 0.0)
    assert torch.equal(q.exponents.double(), want)
    codes = nearest_e2m1(blocks / e8m0(q.exponents)[..., None], "down" if rule == "ocp" else "even")
    assert torch.equal(q.codes, codes.reshape(w.shape))


# -- the reference implementations ----------------------------------------------------------------
def test_quantizers_equal_compressed_tensors_quantization():
    """calculate_qparams + quantize of compressed-tensors' NVFP4A16 / MXFP4A16 presets (llm-compressor's
    RTN path): the same scales and the same E2M1 values."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
    w = weight(seed=3)
    args = preset_name_to_scheme("NVFP4A16", ["Linear"]).weights
    g = generate_gparam(w.amin(), w.amax())
    b = w.reshape(48, -1, 16)
    scale, zp = calculate_qparams(b.amin(-1), b.amax(-1), args, global_scale=g)
    q = fp4.quantize_nvfp4(w)
    assert torch.equal(g, q.global_scale) and torch.equal(scale.float(), q.weight_scale.float())
    assert torch.equal(quantize(w, scale, zp, args, global_scale=g), E2M1[q.codes.long()].float())
    args = preset_name_to_scheme("MXFP4A16", ["Linear"]).weights
    b = w.reshape(48, -1, 32)
    scale, zp = calculate_qparams(b.amin(-1), b.amax(-1), args)
    q = fp4.quantize_mxfp4(w, "round")
    assert torch.equal(scale.double(), e8m0(q.exponents))
    assert torch.equal(quantize(w, scale, zp, args), E2M1[q.codes.long()].float())


def test_compressed_tensors_compressors_write_and_read_our_tensors():
    """Their compressors, given our scales, write our tensors bit for bit; their decompressors read
    ours to our weights (rounded to bfloat16, the dtype they decompress to)."""
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    w = weight(seed=4)
    for method, comp, q in (("nvfp4", NVFP4PackedCompressor, fp4.quantize_nvfp4(w)),
                            ("mxfp4", MXFP4PackedCompressor, fp4.quantize_mxfp4(w, "round"))):
        group = quantization_config("compressed-tensors", method=method)["config_groups"]["group_0"]
        scheme = QuantizationScheme.model_validate(group)
        ours = {k[2:]: v for k, v in pack_linear("m", q, "compressed-tensors").items()}
        state = {"weight": w, "weight_scale": q.as_fp4().scales * (q.global_scale if method == "nvfp4" else 1)}
        if method == "nvfp4":
            state["weight_global_scale"] = q.global_scale
        theirs = comp.compress(state, scheme)
        assert set(theirs) == set(ours), method
        for k, v in theirs.items():
            assert v.dtype == ours[k].dtype and torch.equal(_bits(v), _bits(ours[k])), (method, k)
        dense = comp.decompress(ours, scheme)["weight"]
        assert torch.equal(dense, q.dequantize(torch.float32).bfloat16()), method


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_configs_are_compressed_tensors_presets():
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    for method, preset in (("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")):
        ours = quantization_config("compressed-tensors", method=method)
        scheme = preset_name_to_scheme(preset, ["Linear"])
        scheme.format = ours["format"]
        theirs = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=ours["format"],
                                    quantization_status="compressed").model_dump(exclude=["quant_method"])
        assert {k: v for k, v in ours.items() if k not in ("quant_method", "sparsity_config", "transform_config",
                                                           "version")} == json.loads(json.dumps(theirs, default=str))
        assert ours["format"] == f"{method}-pack-quantized"
        QuantizationConfig.model_validate(ours)


def test_gguf_mxfp4_blocks_are_ggml_s():
    import gguf
    w = weight(seed=5)
    q = fp4.quantize_mxfp4(w, "ocp")
    raw = pack_linear("m", q, "gguf")["m.weight"]
    assert raw.dtype == torch.uint8 and raw.shape == (48, 128 // 32 * 17)
    assert np.array_equal(raw.numpy(), gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4))
    theirs = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.MXFP4)
    assert np.array_equal(theirs, q.dequantize().numpy())
    # the block from its definition: an E8M0 byte, then 16 bytes: value j low nibble, value 16 + j high
    b = raw.reshape(48, -1, 17).to(torch.int64)
    codes = torch.cat((b[..., 1:] & 15, b[..., 1:] >> 4), -1)
    ref = E2M1[codes] * e8m0(b[..., 0])[..., None]
    assert torch.equal(ref.reshape(48, -1), q.dequantize().double())


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_compressed_tensors_tensors_unpacked_from_the_definition(method):
    w = weight(seed=6)
    q = fp4.quantize_nvfp4(w) if method == "nvfp4" else fp4.quantize_mxfp4(w, "round")
    t = pack_linear("m", q, "compressed-tensors")
    codes = nibbles_low_first(t["m.weight_packed"])
    block = 16 if method == "nvfp4" else 32
    if method == "nvfp4":
        assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
            "m.weight_packed": (torch.uint8, (48, 64)), "m.weight_scale": (torch.float8_e4m3fn, (48, 8)),
            "m.weight_global_scale": (torch.float32, (1,))}
        scale = E4M3[t["m.weight_scale"].view(torch.uint8).long()] / t["m.weight_global_scale"].double()
    else:
        assert {k: (v.dtype, tuple(v.shape)) for k, v in t.items()} == {
            "m.weight_packed": (torch.uint8, (48, 64)), "m.weight_scale": (torch.uint8, (48, 4))}
        scale = e8m0(t["m.weight_scale"])
    ref = (E2M1[codes].view(48, -1, block) * scale[..., None]).reshape(48, -1)
    torch.testing.assert_close(q.dequantize(), ref.float(), rtol=2 ** -23, atol=0)   # one float32 rounding
    assert torch.equal(q.codes, codes.to(torch.uint8))


# -- GPTQ on FP4 grids ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind,act_order", [("nvfp4", "static"), ("nvfp4", "none"), ("mxfp4", "none"),
                                            ("mxfp4", "static")])
def test_gptq_fp4(kind, act_order):
    """A diagonal Hessian leaves nothing to feed back: GPTQ is round to nearest. With correlated
    inputs it lowers the output error ||X (W - Q)^T|| below round to nearest's."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 128, generator=g) * 0.1
    grid = fp4.Fp4Grid(kind, "round", fp4.nvfp4_global_scale(w) if kind == "nvfp4" else None)
    rtn = fp4.quantize_rtn(w, grid)
    diag = fp4.gptq_fp4(w, torch.diag(torch.rand(128, generator=g) + 0.5), grid, act_order=act_order)
    assert torch.equal(diag.codes, rtn.codes) and torch.equal(diag.dequantize(), rtn.dequantize())
    x = torch.randn(512, 16, generator=g) @ torch.randn(16, 128, generator=g) + 0.1 * torch.randn(512, 128, generator=g)
    res = fp4.gptq_fp4(w, 2 * x.T @ x / 512, grid, act_order=act_order)
    assert type(res) is (Nvfp4Quantized if kind == "nvfp4" else Mxfp4Quantized)
    err = lambda q: float((x @ (w - q.dequantize()).T).pow(2).sum())  # noqa: E731
    assert err(res) < 0.8 * err(rtn)


# -- refusals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,fragment", [
    (dict(method="nvfp4", format="gguf"), "compressed-tensors or dequantized, not gguf"),
    (dict(method="nf4", activations="dynamic"), "weights only"),
    (dict(method="nvfp4", bits=8), "4-bit"),
    (dict(method="mxfp4", group_size=16), "blocks of 32"),
    (dict(method="mxfp4", sym=False), "symmetric"),
    (dict(method="rtn", fp4_algorithm="gptq"), "--fp4-algorithm applies"),
    (dict(method="nvfp4", fp4_algorithm="awq"), "--fp4-algorithm 'awq'"),
    (dict(method="nf4", fp4_algorithm="gptq"), "--fp4-algorithm applies"),
    (dict(method="mxfp4", fp4_algorithm="gptq", act_order="group"), "g_idx"),
    (dict(method="rtn", format="bitsandbytes"), "holds --method nf4"),
    (dict(method="nf4", activations="dynamic"), "weights only"),     # W4A4: nvfp4 / mxfp4 in compressed-tensors
    (dict(method="mxfp4", format="gguf", activations="dynamic"), "--format gguf holds MXFP4 weights only"),
    (dict(method="nvfp4", activations="static"), "--activations 'static'"),
])
def test_bad_fp4_settings_are_one_line_errors(kw, fragment):
    with pytest.raises(UserInputError) as e:
        QuantConfig(**kw).resolved()
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_fp4_defaults():
    s = QuantConfig(method="nvfp4").resolved()
    assert (s.format, s.group_size, s.bits, s.sym, s.activations, s.fp4_algorithm) == (
        "compressed-tensors", 16, 4, True, "none", "rtn")
    assert not s.needs_calibration
    s = QuantConfig(method="mxfp4", fp4_algorithm="gptq").resolved()
    assert (s.group_size, s.act_order, s.needs_calibration) == (32, "static", True)
    s = QuantConfig(method="nf4").resolved()
    assert (s.format, s.group_size) == ("bitsandbytes", 64)
    assert QuantConfig(method="fp8").resolved().activations == "dynamic"


def test_odd_activations_and_groups_are_load_errors():
    """(W4A4's accepted activations: tests/quant/test_fp4_w4a4.py.)"""
    group = quantization_config("compressed-tensors", method="nvfp4")["config_groups"]["group_0"]
    assert type(ct_module(group, (64, 32, False), "x")).__name__ == "CTFp4Linear"
    acts = dict(group, input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True,
                                          "symmetric": True})
    with pytest.raises(ModelLoadError, match="input activations"):
        ct_module(acts, (64, 32, False), "x")
    with pytest.raises(ModelLoadError, match="group_size"):
        ct_module(dict(group, weights=dict(group["weights"], group_size=32)), (64, 32, False), "x")


# -- end to end -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_factory, tmp_path_factory):
    folder = tiny_factory(tokenizer=True, dtype=torch.float16, weight_std=0.2)
    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog. " * 40
                     + "Pack my box with five dozen liquor jugs. " * 40)
    return folder, calib


def quantize_cli(folder, calib, out, *flags):
    res = CliRunner().invoke(app, ["quantize", "--model", str(folder), "--output", str(out), "--calib-data", str(calib),
                                   "--num-samples", "4", "--seq-len", "32", "--quiet", "--json", *flags])
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def read_tensors(folder: Path) -> dict:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def dequantized_by_definition(tensors: dict, prefix: str, fmt: str) -> torch.Tensor:
    codes = nibbles_low_first(tensors[f"{prefix}.weight_packed"])
    if fmt == "nvfp4-pack-quantized":
        scale = E4M3[tensors[f"{prefix}.weight_scale"].view(torch.uint8).long()] / \
            tensors[f"{prefix}.weight_global_scale"].double()
        block = 16
    else:
        scale, block = e8m0(tensors[f"{prefix}.weight_scale"]), 32
    return (E2M1[codes].view(codes.shape[0], -1, block) * scale[..., None]).reshape(codes.shape)


def float_model(src: Path, weights: dict):
    """transformers' float32 model of `src` (fp16 weights) with `weights` (name -> float) replacing its own."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    for name, w in weights.items():
        model.get_submodule(name).weight.data = w.float()
    return model


def logits(model, dtype=torch.float32) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


@pytest.mark.parametrize("method,flags", [("nvfp4", []), ("nvfp4", ["--fp4-algorithm", "gptq"]), ("mxfp4", [])])
def test_compressed_tensors_checkpoint_in_our_engine_and_transformers(tiny, tmp_path, method, flags):
    from transformers import AutoModelForCausalLM
    folder, calib = tiny
    out = tmp_path / "out"
    summary = quantize_cli(folder, calib, out, "--method", method, *flags)
    assert (summary["method"], summary["format"], summary["bits"]) == (method, "compressed-tensors", 4)
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    fmt = f"{method}-pack-quantized"
    assert qcfg["format"] == fmt and qcfg["config_groups"]["group_0"]["input_activations"] is None
    tensors = read_tensors(out)
    names = [f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS]
    dense = {n: dequantized_by_definition(tensors, n, fmt) for n in names}
    src = read_tensors(folder)
    for n in names:   # each weight is its quantization (relative error of 4-bit codes, not of misplaced ones)
        w = src[n + ".weight"].double()
        assert 0 < (dense[n] - w).norm() / w.norm() < 0.4, n   # (misplaced codes: ~1.4)
    if method == "nvfp4":   # q/k/v and gate/up share a global scale (vLLM's fused layers need one)
        for i in range(2):
            p = f"model.layers.{i}."
            gs = [tensors[p + n + ".weight_global_scale"] for n in LINEARS]
            assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2]) and torch.equal(gs[4], gs[5])
    ref = logits(float_model(folder, dense))
    assert (ref - logits(float_model(folder, {}))).abs().max() > 1e-2     # the quantization is visible
    assert (our_logits(out, IDS) - ref).abs().max() < 1e-4
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map="cpu").eval()
    hf_logits = logits(hf)                                                    # (decompresses on the first forward)
    for n in names:
        assert torch.equal(hf.get_submodule(n).weight, dense[n].float().bfloat16()), n
    assert (hf_logits - ref).abs().max() < 0.1 * ref.abs().max()             # bfloat16 activations


def test_gguf_mxfp4_in_our_engine_and_transformers(tiny, tmp_path):
    import gguf
    from transformers import AutoModelForCausalLM
    folder, calib = tiny
    out = tmp_path / "model-mxfp4.gguf"
    summary = quantize_cli(folder, calib, out, "--method", "mxfp4", "--format", "gguf")
    assert summary["format"] == "gguf"
    reader = gguf.GGUFReader(str(out))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "MXFP4" and types["blk.1.ffn_down.weight"] == "MXFP4"
    assert types["token_embd.weight"] == "F16"
    hf = AutoModelForCausalLM.from_pretrained(str(out.parent), gguf_file=out.name, dtype=torch.float32).eval()
    ref = logits(hf)                       # transformers' GGUF integration: gguf's own dequantizer
    assert (ref - logits(float_model(folder, {}))).abs().max() > 1e-2
    assert (our_logits(out, IDS) - ref).abs().max() < 1e-4
    from llmopt.models.loader import load_model
    lm = load_model(str(out), dtype="float32", device="cpu", tokenizer=False)
    q = lm.model.model.layers[0].mlp.down_proj
    assert type(q).__name__ == "GGUFMxfp4Linear" and set(dict(q.named_buffers())) == {"codes", "scales"}


def test_nf4_pipeline_writes_bitsandbytes_our_engine_runs(tiny, tmp_path):
    from llmopt.layers.formats import bnb
    folder, calib = tiny
    out = tmp_path / "nf4"
    quantize_cli(folder, calib, out, "--method", "nf4")
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "bitsandbytes" and qcfg["bnb_4bit_quant_type"] == "nf4"
    assert qcfg["bnb_4bit_use_double_quant"] is True
    tensors = read_tensors(out)
    dense = {}
    for n in [f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS]:
        local = {k[len(n) + 1:]: v for k, v in tensors.items() if k.startswith(n + ".")}
        dense[n] = bnb.unpack(local).as_fp4().dequantize()
    assert (our_logits(out, IDS) - logits(float_model(folder, dense))).abs().max() < 1e-4


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4", "nf4"])
def test_kv_estimate_counts_the_checkpoint_bytes(tiny, tmp_path, method):
    """--weight-format nvfp4 / mxfp4 / nf4 (from shapes) counts the bytes the written checkpoint's
    Linears hold (nf4: but its quant_state JSON); on the CPU, the runtime's buffers; `auto` on the
    checkpoint's config the same."""
    from llmopt.estimate.sources import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    folder, calib = tiny
    out = tmp_path / "out"
    quantize_cli(folder, calib, out, "--method", method)
    stored = sum(v.numel() * v.element_size() for k, v in read_tensors(out).items()
                 if k.split(".weight")[0].endswith(LINEARS) and ".quant_state." not in k)
    arch = resolve_model_arch(str(folder))
    est = weight_memory(arch, method).by_group
    assert est["attn"] + est["mlp"] == stored
    cpu = weight_memory(arch, method, device="cpu").by_group
    assert cpu["attn"] + cpu["mlp"] == _held_linear_bytes(out)
    assert weight_memory(resolve_model_arch(str(out)), "auto", device="cpu").by_group == cpu


def test_kv_estimate_counts_a_gguf_mxfp4_as_held(tiny, tmp_path):
    from llmopt.estimate.sources import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    folder, calib = tiny
    out = tmp_path / "m.gguf"
    quantize_cli(folder, calib, out, "--method", "mxfp4", "--format", "gguf")
    auto = weight_memory(resolve_model_arch(str(out)), "auto", device="cpu").by_group
    assert auto["attn"] + auto["mlp"] == _held_linear_bytes(out)


def _held_linear_bytes(out: Path) -> int:
    from llmopt.models.loader import load_model
    lm = load_model(str(out), dtype="float32", device="cpu", tokenizer=False, lm_head_dtype="float")
    return sum(b.numel() * b.element_size() for n, m in lm.model.named_modules() if n.endswith(LINEARS)
               for b in m.buffers(recurse=False))


def test_tensor_parallelism_refuses_fp4_checkpoints():
    from llmopt.layers.shard_quant import is_quantized_tensor
    for method in ("nvfp4", "mxfp4"):
        with pytest.raises(UserInputError, match="tensor-parallel-size 1"):
            is_quantized_tensor("model.layers.0.mlp.down_proj.weight_packed", quantization_config(
                "compressed-tensors", method=method))


@pytest.mark.parametrize("method,fmt", [("nvfp4", "compressed-tensors"), ("mxfp4", "gguf")])
def test_llm_generates_as_the_dequantized_model(tiny, tmp_path, method, fmt):
    """The engine (paged KV cache, its CPU decode step) greedy-decodes the dequantized float model's tokens."""
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.engine.llm import LLM
    from llmopt.models.loader import load_model
    folder, calib = tiny
    out = tmp_path / ("m.gguf" if fmt == "gguf" else "m")
    quantize_cli(folder, calib, out, "--method", method, "--format", fmt)
    loaded = load_model(str(out), dtype="float32", device="cpu", tokenizer=False, lm_head_dtype="float")
    dense = {n: m.dequantized() for n, m in loaded.model.named_modules() if n.endswith(LINEARS)}
    assert len(dense) == 14
    prompt = IDS[0, :6].tolist()
    with torch.no_grad():
        want = float_model(folder, dense).generate(torch.tensor([prompt]), max_new_tokens=8,
                                                   do_sample=False)[0, 6:].tolist()
    llm = LLM(str(out), loaded=loaded, detokenize=False, kv_cache_memory=1 << 22)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert list(got.outputs[0].token_ids) == want
