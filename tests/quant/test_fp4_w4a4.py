"""W4A4 NVFP4 / MXFP4 (`--activations dynamic`, compressed-tensors' NVFP4 and MXFP4 presets): the
activation fake quantization against compressed-tensors' own, bit for bit; the calibrated
input_global_scale against 448 * 6 / amax of the Linears' inputs hooked in a transformers float model
(compressed-tensors' generate_gparam); the checkpoint's config and tensors against the presets;
transformers (its compressed-tensors integration applying the activation quantization) against our
engine; the refusals.

transformers decompresses FP4 checkpoints in bfloat16 only, and FP4 activations turn bfloat16's
roundings into different codes: the comparison runs transformers' quantized model in float32 with
the checkpoint's float tensors (its modules' own activation quantization still applied).
"""

from __future__ import annotations

import json

import pytest
import torch

from llmopt.errors import ModelLoadError
from llmopt.layers.activations import fake_quantize_fp4
from llmopt.layers.runtime import ct_module
from llmopt.quant.config import QuantConfig
from llmopt.quant.formats import quantization_config
from quant_util import LINEARS, our_logits
from test_fp4 import IDS, dequantized_by_definition, float_model, quantize_cli, read_tensors, tiny  # noqa: F401

PRESETS = {"nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def theirs(x: torch.Tensor, method: str, g: torch.Tensor | None) -> torch.Tensor:
    """compressed-tensors' dynamic activation quantization (forward_quantize's path) of x."""
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp
    args = preset_name_to_scheme(PRESETS[method], ["Linear"]).input_activations
    scale, zp = compute_dynamic_scales_and_zp(x, args, None, global_scale=g)
    return fake_quantize(x, scale, zp, args, global_scale=g)


@pytest.mark.parametrize("dtype,span", [(torch.float32, 30), (torch.bfloat16, 30), (torch.float16, 4)])
@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_activation_fake_quantization_is_compressed_tensors_bit_for_bit(method, dtype, span):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 64, generator=g) * torch.logspace(-span, span, 64)   # tiny to huge blocks
    x[0] = 0                                                                      # all-zero rows
    x[1, 0, :32] = 1e-30 if dtype != torch.float16 else 1e-7                      # subnormal / underflowing
    x[2, 1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4) / 2   # ties after scaling
    x[3] = -x[3].abs() * 1e-3                                                     # negatives rounding to -0
    x = x.to(dtype)
    amax = float(x.float().abs().amax())
    for k in ((0.3, 1.0, 1e-3, 1e3) if method == "nvfp4" else (None,)):
        gs = None if k is None else torch.tensor([448 * 6 / amax * k])            # E4M3 saturating / underflowing
        ours, ref = fake_quantize_fp4(x, method, gs), theirs(x, method, gs)
        assert ours.dtype == ref.dtype == dtype
        assert torch.equal(_bits(ours), _bits(ref)), (k, int((_bits(ours) != _bits(ref)).sum()))
    assert not torch.equal(ours, x)


def test_w4a4_settings():
    s = QuantConfig(method="nvfp4", activations="dynamic").resolved()
    assert (s.activations, s.format, s.needs_calibration) == ("dynamic", "compressed-tensors", True)
    s = QuantConfig(method="mxfp4", activations="dynamic").resolved()
    assert (s.activations, s.needs_calibration) == ("dynamic", False)   # no static scale to calibrate
    assert QuantConfig(method="nvfp4").resolved().activations == "none"


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_w4a4_configs_are_the_presets_and_odd_activations_are_load_errors(method):
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    ours = quantization_config("compressed-tensors", method=method, activations="dynamic")
    scheme = preset_name_to_scheme(PRESETS[method], ["Linear"])
    scheme.format = ours["format"]
    theirs_ = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format=ours["format"],
                                 quantization_status="compressed").model_dump(exclude=["quant_method"])
    assert {k: v for k, v in ours.items() if k not in ("quant_method", "sparsity_config", "transform_config",
                                                       "version")} == json.loads(json.dumps(theirs_, default=str))
    group = ours["config_groups"]["group_0"]
    mod = ct_module(group, (64, 32, False), "x")
    assert mod.act_kind == method and ("input_global_scale" in dict(mod.named_buffers())) == (method == "nvfp4")
    acts = group["input_activations"]
    for odd in (dict(acts, num_bits=8), dict(acts, group_size=32 if method == "nvfp4" else 16),
                dict(acts, dynamic=False), dict(acts, strategy="token", group_size=None), dict(acts, type="int")):
        with pytest.raises(ModelLoadError) as e:
            ct_module(dict(group, input_activations=odd), (64, 32, False), "x")
        assert "input activations" in str(e.value) and "\n" not in str(e.value)


def _calibration_ids(folder, calib):
    from llmopt import defaults
    from llmopt.models.loader import load_tokenizer
    from llmopt.quant.calib import load_calibration
    return load_calibration(str(calib), load_tokenizer(folder), 4, 32, defaults.QUANT_SEED, defaults.TEXT_FIELD).ids


@pytest.mark.parametrize("method", ["nvfp4", "mxfp4"])
def test_w4a4_checkpoint_in_our_engine_and_transformers(tiny, tmp_path, method):  # noqa: F811
    from compressed_tensors.quantization.utils.helpers import generate_gparam
    from transformers import AutoModelForCausalLM
    folder, calib = tiny
    out = tmp_path / "out"
    summary = quantize_cli(folder, calib, out, "--method", method, "--activations", "dynamic")
    assert summary["method"] == method and (method == "mxfp4" or summary["calib_samples"] == 4)   # nvfp4 calibrates
    fmt = f"{method}-pack-quantized"
    group = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["input_activations"] == quantization_config("compressed-tensors", method=method, activations="dynamic"
                                                             )["config_groups"]["group_0"]["input_activations"]
    tensors = read_tensors(out)
    names = [f"model.layers.{i}.{lin}" for i in range(2) for lin in LINEARS]
    dense = {n: dequantized_by_definition(tensors, n, fmt) for n in names}
    gscale = {n: tensors.get(f"{n}.input_global_scale") for n in names}
    if method == "mxfp4":
        assert all(g is None for g in gscale.values())
    else:
        assert all(g.dtype == torch.float32 and g.shape == (1,) for g in gscale.values())
        for i in range(2):   # one input each: q/k/v share a scale, gate/up too
            p = f"model.layers.{i}."
            gs = [gscale[p + n] for n in LINEARS]
            assert torch.equal(gs[0], gs[1]) and torch.equal(gs[0], gs[2]) and torch.equal(gs[4], gs[5])
        # the inputs each Linear receives over the calibration windows, in transformers' float model of the
        # quantized one (dequantized weights, activations quantized by compressed-tensors with the stored scales)
        ref_model, amax = float_model(folder, dense), {}

        def hook(n):
            def pre(_m, a):
                amax[n] = torch.maximum(amax.get(n, torch.zeros(())), a[0].abs().amax())
                return (theirs(a[0], method, gscale[n]),)
            return pre

        for n in names:
            ref_model.get_submodule(n).register_forward_pre_hook(hook(n))
        with torch.no_grad():
            ref_model(_calibration_ids(folder, calib))
        for n in names:
            want = generate_gparam(-amax[n], amax[n])
            torch.testing.assert_close(gscale[n], want, rtol=1e-4, atol=0, msg=n)
        assert torch.equal(gscale[names[0]], generate_gparam(-amax[names[0]], amax[names[0]]))   # no arithmetic between
    # our engine against transformers with compressed-tensors' activation quantization, in float32
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, device_map="cpu").eval()
    with torch.no_grad():
        hf(IDS)                                                          # (decompresses on the first forward)
    for n in names:
        assert torch.equal(hf.get_submodule(n).weight, dense[n].float().bfloat16()), n
        if method == "nvfp4":
            assert torch.equal(hf.get_submodule(n).input_global_scale, gscale[n]), n
    torch.nn.Module.float(hf)   # (transformers refuses .float() on a quantized model)
    src = float_model(folder, dense).state_dict()
    hf.load_state_dict({k: v for k, v in src.items() if k in hf.state_dict()}, strict=False)
    with torch.no_grad():
        hf_logits = hf(IDS).logits.float()
        plain = float_model(folder, dense)(IDS).logits.float()           # the same weights, float activations
    ours = our_logits(out, IDS)
    assert (hf_logits - plain).abs().max() > 1e-2                        # the activation quantization is visible
    assert (ours - hf_logits).abs().max() < 1e-4


def test_cpu_decode_leaves_w4a4_layers_to_python():
    from llmopt.worker.cpu_decode import linear_spec
    group = quantization_config("compressed-tensors", method="nvfp4", activations="dynamic")["config_groups"]["group_0"]
    mod = ct_module(group, (64, 32, False), "x")
    mod.nibbles = True
    assert linear_spec(mod) is None
    mod.act_kind = None
    mod.register_buffer("codes", torch.zeros(32, 32, dtype=torch.uint8))
    mod.register_buffer("scales", torch.ones(32, 4))
    assert linear_spec(mod) is not None


def test_kv_estimate_counts_a_w4a4_checkpoint(tiny, tmp_path):  # noqa: F811
    """`auto` on a W4A4 NVFP4 checkpoint: its Linears' stored tensors (input_global_scale included),
    and on the CPU the engine's buffers, whether counted from the files or from the config."""
    from llmopt.estimate.sources import resolve_model_arch
    from llmopt.estimate.weights import weight_memory
    from test_fp4 import _held_linear_bytes
    folder, calib = tiny
    out = tmp_path / "out"
    quantize_cli(folder, calib, out, "--method", "nvfp4", "--activations", "dynamic")
    tensors = read_tensors(out)
    assert sum(k.endswith(".input_global_scale") for k in tensors) == 2 * len(LINEARS)
    stored = sum(v.numel() * v.element_size() for k, v in tensors.items() if k.rsplit(".", 1)[0].endswith(LINEARS))
    arch = resolve_model_arch(str(out))
    est = weight_memory(arch, "auto").by_group
    assert est["attn"] + est["mlp"] == stored
    cpu = weight_memory(arch, "auto", device="cpu").by_group
    assert cpu["attn"] + cpu["mlp"] == _held_linear_bytes(out)
    plain = weight_memory(resolve_model_arch(str(folder)), "nvfp4", device="cpu").by_group
    assert cpu["attn"] + cpu["mlp"] == plain["attn"] + plain["mlp"] + 4 * 2 * len(LINEARS)
