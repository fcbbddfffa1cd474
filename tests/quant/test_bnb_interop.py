"""bitsandbytes 4-bit checkpoints against bitsandbytes itself (0.50.2, whose CPU backend runs with
torch 2.13) and transformers' bitsandbytes integration: ours load in transformers, theirs in ours.
Needs bitsandbytes (`pip install bitsandbytes`): a missing package fails here at import, as the
interop extra's tests do.

Three models are compared on the same tokens:
  ref   transformers' float model with the dequantized weights (float32, an exact oracle),
  ours  llmopt.models.loader.load_model on the quantized folder (float32 on the CPU),
  hf    transformers loading the folder through bitsandbytes' Linear4bit.
"""

import json

import bitsandbytes  # noqa: F401  (fail, never skip, without it)
import bitsandbytes.functional as bnbF
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from bnb_util import write_bnb
from llmopt.layers.formats import bnb
from llmopt.layers.formats.fp4 import table
from llmopt.quant.formats.bnb import pack
from llmopt.quant.nf4 import dynamic_map, quantize
from quant_util import dequantized_reference, our_logits

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))
VARIANTS = [("nf4", True), ("nf4", False), ("fp4", True), ("fp4", False)]


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits.float()


def _state(t: dict, prefix: str = "m") -> bnbF.QuantState:
    """bitsandbytes' own QuantState from our tensors (what Params4bit.from_prequantized reads)."""
    stats = {k.removeprefix(f"{prefix}.weight."): v for k, v in t.items() if k.startswith(f"{prefix}.weight.")}
    return bnbF.QuantState.from_dict(stats, device=torch.device("cpu"))


def test_tables_and_maps_are_bitsandbytes():
    assert torch.equal(table("nf4"), bnbF.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(table("bnb_fp4"), bnbF.get_4bit_type("fp4", device="cpu"))
    assert torch.equal(dynamic_map(), bnbF.create_dynamic_map())


@pytest.mark.parametrize("quant_type,double_quant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitsandbytes_dequantizes_our_tensors_exactly(quant_type, double_quant, dtype):
    w = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.2
    q = quantize(w, 64, quant_type, double_quant)
    t = pack("m", q, dtype)
    theirs = bnbF.dequantize_4bit(t["m.weight"], _state(t))
    assert theirs.dtype == dtype and torch.equal(theirs, q.as_fp4().dequantize(dtype))


@pytest.mark.parametrize("quant_type,double_quant", VARIANTS)
def test_our_tensors_are_quantize_4bit_s(quant_type, double_quant):
    """Names, dtypes, shapes and the packed state of Linear4bit's state_dict; the same codes where
    both choose against the same scales (no double quantization; FP4's 0 and -0 aside)."""
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(2)) * 0.2
    lin = bitsandbytes.nn.Linear4bit(128, 64, bias=False, quant_type=quant_type, compress_statistics=double_quant)
    lin.weight = bitsandbytes.nn.Params4bit(w, requires_grad=False, quant_type=quant_type,
                                            compress_statistics=double_quant, module=lin)
    lin = lin.to("cpu")   # quantizes
    theirs = {f"m.{k}": v for k, v in lin.state_dict().items()}
    q = quantize(w, 64, quant_type, double_quant)
    ours = pack("m", q, torch.float32)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in ours.items()} == \
        {k: (v.dtype, tuple(v.shape)) for k, v in theirs.items()}
    key = f"m.weight.quant_state.bitsandbytes__{quant_type}"
    assert json.loads(bytes(ours[key].tolist())) == json.loads(bytes(theirs[key].tolist()))
    assert torch.equal(ours["m.weight.quant_map"], theirs["m.weight.quant_map"])
    assert torch.equal(ours["m.weight.absmax"], theirs["m.weight.absmax"])   # nested: their 8-bit codes too
    if double_quant:
        for k in ("m.weight.nested_absmax", "m.weight.nested_quant_map"):
            assert torch.equal(ours[k], theirs[k])
        return
    mine = bnb.unpack({k[2:]: v for k, v in ours.items()}).codes()
    their = bnb.unpack({k[2:]: v for k, v in theirs.items()}).codes()
    differ = mine != their
    values = table(q.table_name)
    assert (values[mine[differ].long()] == 0).all() and (values[their[differ].long()] == 0).all()


@pytest.fixture(scope="module")
def base(tiny_factory):
    return tiny_factory(weight_std=0.2, max_position_embeddings=64)


@pytest.mark.parametrize("quant_type,double_quant,block", [("nf4", True, 64), ("fp4", False, 32)])
def test_transformers_loads_our_checkpoint(base, tmp_path, quant_type, double_quant, block):
    canon = write_bnb(base, tmp_path, quant_type, double_quant, torch.float32, block)
    ref = _logits(dequantized_reference(base, canon, stored=torch.float32))
    assert (_logits(dequantized_reference(base, {}, stored=torch.float32)) - ref).abs().max() > 1e-2
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu", dtype=torch.float32).eval()
    lin = hf.get_submodule("model.layers.0.self_attn.q_proj")
    assert type(lin) is bitsandbytes.nn.Linear4bit and lin.weight.quant_state.blocksize == block
    for name, fp4 in canon.items():
        w = hf.get_submodule(name).weight
        assert torch.equal(bnbF.dequantize_4bit(w.data, w.quant_state), fp4.dequantize())
    assert (_logits(hf) - ref).abs().max() < 1e-4
    assert (our_logits(tmp_path, IDS) - ref).abs().max() < 1e-4


class _Weight:
    """A fixed float weight where dequantized_reference expects a quantized form."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.w.to(dtype)


@pytest.mark.parametrize("quant_type,double_quant,storage", [("nf4", True, "uint8"), ("fp4", True, "uint8"),
                                                            ("nf4", False, "uint8"), ("fp4", False, "bfloat16")])
def test_we_load_what_transformers_saves(base, tmp_path, quant_type, double_quant, storage):
    """transformers quantizes with bitsandbytes and saves; the oracle is bitsandbytes' own dequantization
    of the saved tensors in float32 (the values it casts to the state's float16: we keep them).
    bnb_4bit_quant_storage bfloat16 holds the same bytes as bfloat16 elements (FSDP's choice)."""
    from llmopt.layers.modules_bnb import Bnb4bitLinear
    from llmopt.models.loader import load_model
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant,
                             bnb_4bit_compute_dtype=torch.float32, bnb_4bit_quant_storage=storage)
    hf = AutoModelForCausalLM.from_pretrained(base, quantization_config=cfg, device_map="cpu", dtype=torch.float16)
    hf.save_pretrained(tmp_path)
    hf_logits = _logits(hf)
    state = load_file(str(tmp_path / "model.safetensors"))
    assert state["model.layers.0.mlp.up_proj.weight"].dtype == getattr(torch, storage)
    canon = {}
    for name, mod in hf.named_modules():
        if isinstance(mod, bitsandbytes.nn.Linear4bit):
            qs = _state(state, name)
            assert qs.dtype == torch.float16 and qs.nested == double_quant and qs.quant_type == quant_type
            qs.dtype = torch.float32   # its products before the cast
            canon[name] = _Weight(bnbF.dequantize_4bit(state[f"{name}.weight"], qs))
    assert len(canon) == 14 and "lm_head" not in canon
    lm = load_model(str(tmp_path), dtype="float32", device="cpu", tokenizer=False, lm_head_dtype="float")
    for name, w in canon.items():
        mod = lm.model.get_submodule(name)
        assert type(mod) is Bnb4bitLinear and torch.equal(mod.dequantized(), w.w)
    ref = _logits(dequantized_reference(base, canon, stored=torch.float16))
    assert (_logits(dequantized_reference(base, {}, stored=torch.float16)) - ref).abs().max() > 1e-2
    assert (our_logits(tmp_path, IDS) - ref).abs().max() < 1e-4
    assert (hf_logits - ref).abs().max() < 2e-2   # transformers runs the float16 model
