"""bitsandbytes 4-bit (NF4, FP4, double quantized or not): llmopt.quant.nf4 + llmopt.quant.formats.bnb
write it, llmopt.layers.formats.bnb + modules_bnb read and run it.

The references here need no bitsandbytes: an unpacker in tests/bnb_util.py written from the definition
(bitsandbytes' QuantState layout, its NF4 quantiles of N(0, 1), its FP4 bit layout and its 8-bit
dynamic map, all computed in float64), and transformers' float model with the dequantized weights.
tests/quant/test_bnb_interop.py checks the same tensors with bitsandbytes and transformers' own
bitsandbytes integration.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmopt.errors import ModelLoadError, UserInputError
from llmopt.layers.formats import bnb, format_of, unpack_linear
from llmopt.layers.formats.fp4 import table
from llmopt.layers.modules_bnb import Bnb4bitLinear
from llmopt.quant.formats.bnb import pack, quantization_config
from llmopt.quant.nf4 import quantize
from bnb_util import LEVELS, dynamic_levels, fp4_levels, nf4_levels, reference_dequantize, write_bnb
from quant_util import dequantized_reference, our_logits

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
VARIANTS = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


# -- the tables and maps -------------------------------------------------------------------------
def test_tables_are_the_definitions():
    assert torch.allclose(table("nf4").double(), nf4_levels(), atol=1e-7, rtol=0)
    assert torch.equal(table("bnb_fp4").double(), fp4_levels().float().double())   # v / 12 rounded once
    from llmopt.quant.nf4 import dynamic_map
    assert torch.allclose(dynamic_map().double(), dynamic_levels(), rtol=2e-7, atol=0)
    assert dynamic_map().unique().numel() == 256


# -- one Linear: pack against the independent unpacker ---------------------------------------------
@pytest.mark.parametrize("quant_type,double_quant", VARIANTS)
@pytest.mark.parametrize("block", [64, 128])
def test_pack_matches_the_definition(quant_type, double_quant, block):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(3)) * 0.3
    w[5, :block] = 0   # an all-zero block
    q = quantize(w, block, quant_type, double_quant)
    q.bias = torch.randn(48)
    t = pack("m", q, torch.bfloat16)
    names = {"m.weight", "m.weight.absmax", "m.weight.quant_map", f"m.weight.quant_state.bitsandbytes__{quant_type}",
             "m.bias"}
    if double_quant:
        names |= {"m.weight.nested_absmax", "m.weight.nested_quant_map"}
        assert t["m.weight.absmax"].dtype == torch.uint8 and t["m.weight.nested_absmax"].shape == (1,)
        assert torch.allclose(t["m.weight.nested_quant_map"].double(), dynamic_levels(), rtol=2e-7, atol=0)
    else:
        assert t["m.weight.absmax"].dtype == torch.float32
    assert set(t) == names
    assert t["m.weight"].shape == (48 * 256 // 2, 1) and t["m.weight"].dtype == torch.uint8
    assert t["m.weight.absmax"].shape == (48 * 256 // block,) and t["m.bias"].dtype == torch.bfloat16
    state = json.loads(bytes(t[f"m.weight.quant_state.bitsandbytes__{quant_type}"].tolist()).decode())
    assert state["quant_type"] == quant_type and state["blocksize"] == block and state["shape"] == [48, 256]
    assert state["dtype"] == "bfloat16" and ("nested_offset" in state) == double_quant
    ref = reference_dequantize(t, "m")
    ours = q.as_fp4().dequantize(torch.float32)
    assert torch.allclose(ours.double(), ref, rtol=1e-6, atol=1e-7)
    err = (ours - w).abs().max()
    assert 1e-3 < err < 0.3 * w.abs().max()   # 4-bit: visible, and bounded by half a step of the widest gap
    # the runtime reads back exactly what was quantized
    local = {k[2:]: v for k, v in t.items()}
    back = unpack_linear(local, quantization_config(quant_type, block, double_quant, "float32"))
    assert torch.equal(back.codes, q.as_fp4().codes) and torch.equal(back.scales, q.as_fp4().scales)
    assert torch.equal(back.bias, q.bias.bfloat16())


@pytest.mark.parametrize("quant_type,double_quant", VARIANTS)
def test_codes_are_nearest_against_the_stored_scales(quant_type, double_quant):
    w = torch.randn(16, 512, generator=torch.Generator().manual_seed(4)).double() ** 3   # heavy tails
    q = quantize(w.float(), 64, quant_type, double_quant)
    fp4 = q.as_fp4()
    levels = LEVELS[quant_type]().float().double()
    s = fp4.scales.double().repeat_interleave(64, dim=1)
    candidates = (levels[None, None, :] * s[..., None] - w.float().double()[..., None]).abs()
    chosen = candidates.gather(-1, fp4.codes.long()[..., None])[..., 0]
    assert (chosen <= candidates.min(-1).values * (1 + 1e-6) + 1e-12).all()
    if double_quant:   # the stored scales differ from the absmax: choosing against the absmax would be off
        assert not torch.equal(fp4.scales, w.float().abs().reshape(16, -1, 64).amax(-1))


def test_odd_sizes_and_bad_input():
    q = quantize(torch.randn(3, 64), 64, "nf4", True)
    assert q.weight.shape == (96, 1)
    w = torch.randn(8, 96)
    with pytest.raises(UserInputError, match="does not divide"):
        quantize(w, 64)
    with pytest.raises(UserInputError, match="quant_type"):
        quantize(torch.randn(8, 64), 64, "int4")
    with pytest.raises(UserInputError, match="block size"):
        quantize(torch.randn(8, 64), 48)
    with pytest.raises(UserInputError, match="quant_type"):
        quantization_config("af4")


def _tensors(quant_type="nf4", double_quant=True):
    q = quantize(torch.randn(8, 128, generator=torch.Generator().manual_seed(5)), 64, quant_type, double_quant)
    return {k[2:]: v for k, v in pack("m", q, torch.float16).items()}


def _with_state(t, **changes):
    (name,) = [k for k in t if "quant_state" in k]
    state = dict(json.loads(bytes(t[name].tolist()).decode()), **changes)
    return dict(t, **{name: torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)})


@pytest.mark.parametrize("qcfg,message", [
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "8-bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"}, "int4"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_storage": "int32"}, "int32"),
    ({"quant_method": "bitsandbytes"}, "without load_in_4bit"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": "lm_head"}, "list"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": ["mlp("]}, "regular"),
])
def test_unsupported_configs_are_one_line_errors(qcfg, message):
    with pytest.raises(ModelLoadError, match=message) as e:
        format_of(qcfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("change,message", [
    (lambda t: _with_state(t, shape=[8, 96]), "expected"),
    (lambda t: _with_state(t, quant_type="fp4"), "holds quant_type"),
    (lambda t: _with_state(t, dtype="int8"), "dtype"),
    (lambda t: _with_state(t, nested_dtype="float16"), "double quantization"),
    (lambda t: {k: v for k, v in t.items() if k != "weight.nested_absmax"}, "nested_absmax"),
    (lambda t: dict(t, **{"weight.quant_map": table("bnb_fp4")}), "custom maps"),
    (lambda t: dict(t, extra=torch.zeros(1)), "does not use"),
])
def test_bad_tensors_are_one_line_errors(change, message):
    with pytest.raises(ModelLoadError, match=message) as e:
        bnb.unpack(change(_tensors())).as_fp4()
    assert "\n" not in str(e.value)


def test_blocks_across_rows_are_refused():
    t = _tensors()
    q = bnb.unpack(_with_state(t, shape=[32, 32]))   # the same bytes and blocks of 64, two rows a block
    with pytest.raises(ModelLoadError, match="span rows"):
        q.as_fp4()


def test_which_modules_convert_is_transformers_rule():
    from transformers.quantizers.quantizers_utils import should_convert_module
    names = ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.11.mlp.down_proj",
             "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate_proj"]
    for skip in (["lm_head"], ["model.layers.1"], ["down_proj"], [r"model.layers.\d+.self_attn"], ["mlp.gate"]):
        cfg = bnb.config_of({"quant_method": "bitsandbytes", "load_in_4bit": True, "llm_int8_skip_modules": skip})
        assert [bnb.converts(n, cfg) for n in names] == [should_convert_module(n, skip) for n in names], skip
    cfg = bnb.config_of({"quant_method": "bitsandbytes", "load_in_4bit": True})
    assert [bnb.converts(n, cfg) for n in names] == [False, True, True, True, True]


# -- a whole checkpoint in our engine --------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tiny_factory):
    return tiny_factory(weight_std=0.2, max_position_embeddings=64)


@pytest.mark.parametrize("quant_type,double_quant,dtype,block", [
    ("nf4", True, torch.float16, 64), ("fp4", False, torch.bfloat16, 32), ("nf4", False, torch.float32, 64)])
def test_engine_runs_the_dequantized_model(base, tmp_path, quant_type, double_quant, dtype, block):
    canon = write_bnb(base, tmp_path, quant_type, double_quant, dtype, block)
    ref = dequantized_reference(base, canon, stored=dtype)
    with torch.no_grad():
        ref_logits = ref(IDS).logits.float()
        float_logits = dequantized_reference(base, {}, stored=dtype)(IDS).logits.float()
    assert (float_logits - ref_logits).abs().max() > 1e-2        # the quantization is visible
    ours = our_logits(tmp_path, IDS)
    assert (ours - ref_logits).abs().max() < 1e-4


def test_loaded_modules_and_skipped_ones(base, tmp_path):
    from llmopt.models.loader import load_model
    canon = write_bnb(base, tmp_path, "nf4", True, torch.float16, skip=("mlp.down_proj",))
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False, lm_head_dtype="float")
    for name in canon:
        mod = lm.model.get_submodule(name)
        assert type(mod) is Bnb4bitLinear and mod.block == 64 and mod.table_name == "nf4"
        assert set(mod._buffers) == {"codes", "scales"}
        assert torch.equal(mod.dequantized(), canon[name].dequantize())
    down = lm.model.get_submodule("model.layers.0.mlp.down_proj")
    assert type(down) is not Bnb4bitLinear and down.weight.dtype == torch.float32
    assert (our_logits(tmp_path, IDS) - dequantized_reference(base, canon)(IDS).logits).abs().max() < 1e-4


def test_llm_generates_as_the_dequantized_model(base, tmp_path):
    from llmopt.core.sampling_params import SamplingParams
    from llmopt.engine.llm import LLM
    from llmopt.models.loader import load_model
    canon = write_bnb(base, tmp_path, "fp4", True, torch.float32)
    ref = dequantized_reference(base, canon, stored=torch.float32)
    prompt = IDS[0, :6].tolist()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    loaded = load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False, lm_head_dtype="float")
    llm = LLM(str(tmp_path), loaded=loaded, detokenize=False, kv_cache_memory=1 << 22)
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert list(got.outputs[0].token_ids) == want


def test_checkpoint_tensors_missing_or_of_another_type(base, tmp_path):
    write_bnb(base, tmp_path, "nf4", True, torch.float16)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["bnb_4bit_quant_type"] = "fp4"   # the tensors say nf4
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="differs from config.json"):
        our_logits(tmp_path, IDS)
    config["quantization_config"]["bnb_4bit_quant_type"] = "nf4"
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight.nested_absmax"]
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="weight_nested_absmax"):
        our_logits(tmp_path, IDS)


def test_tensor_parallel_refuses_bitsandbytes():
    from llmopt.layers.shard_quant import is_quantized_tensor
    qcfg = quantization_config("nf4", 64, True, "bfloat16")
    with pytest.raises(UserInputError, match="tensor parallelism does not split bitsandbytes"):
        is_quantized_tensor("model.layers.0.mlp.up_proj.weight", qcfg)
