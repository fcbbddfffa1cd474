"""kv-estimate's weight figure on the CPU equals what the engine keeps resident for a W4 checkpoint:
packed codes with float32 scales and scaled zeros, and the int8 head (or the int8 table a tied
head shares with the embedding)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from llmopt.estimate import estimate, resolve_model_arch
from llmopt.estimate.weights import weight_memory
from llmopt.quant.formats import quantization_config
from quant_util import rtn, write_quantized


def _resident_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage among the model's parameters and buffers (RoPE's inv_freq,
    a derived table, left out)."""
    seen: dict[int, int] = {}
    tensors = [t for _, t in model.named_parameters(remove_duplicate=False)]
    tensors += [t for n, t in model.named_buffers(remove_duplicate=False) if t is not None and n != "inv_freq"]
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("fmt,sym", [("awq", False), ("gptq", True)])
def test_cpu_weight_figure_matches_the_engine(tiny_factory, tmp_path, tied, fmt, sym):
    from llmopt.models.loader import load_model
    base = tiny_factory(weight_std=0.2, tie_word_embeddings=tied)
    qcfg = quantization_config(fmt, method=fmt, bits=4, group_size=32, sym=sym)
    write_quantized(base, tmp_path, fmt, lambda w: rtn(w, 4, 32, sym), qcfg)
    arch = replace(resolve_model_arch(str(tmp_path)), dtype="float32")   # the engine's auto on the CPU
    cpu = weight_memory(arch, "auto", device="cpu")
    assert "int8 head" in cpu.format
    assert estimate(resolve_model_arch(str(tmp_path)), device="cpu").weights == cpu   # what kv-estimate shows
    model = load_model(str(tmp_path), "float32", "cpu", tokenizer=False).model
    assert type(model.lm_head).__name__ == "Int8Head"
    assert cpu.bytes_total == _resident_bytes(model)
    # with the head kept in float the figure grows by the float table less the int8 one, as the engine's
    floats = weight_memory(arch, "auto", device="cpu", lm_head_dtype="float")
    v, h = model.config.vocab_size, model.config.hidden_size
    assert floats.bytes_total - cpu.bytes_total == v * h * 4 - (v * h + v * 4)
    assert floats.bytes_total == _resident_bytes(load_model(str(tmp_path), "float32", "cpu", tokenizer=False,
                                                            lm_head_dtype="float").model)
