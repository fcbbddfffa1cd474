"""Quantized checkpoints over 2 ranks: a tiny AWQ and a tiny GPTQ model (written by the project's
packers, tests/quant_util.py) give the logits of one rank within float32 rounding; each rank's
packed codes, group scales and zeros are its shard (llmopt/layers/shard_quant.py), the int8 head its
vocabulary rows."""

from __future__ import annotations

import shutil

import pytest

from llmopt.quant.formats import quantization_config
from quant_util import rtn, write_quantized
from tp_util import rel_err, step_logits, tp_engine
from test_tp_engine import reference

FORMATS = {
    "awq": (lambda w: rtn(w, 4, 32, False), dict(method="awq", bits=4, group_size=32, sym=False)),
    "gptq": (lambda w: rtn(w, 4, 32, True), dict(method="gptq", bits=4, group_size=32, sym=True)),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantized_tp2_logits_equal_tp1(tiny_factory, tmp_path, fmt):
    base = tiny_factory(tokenizer=True, vocab_size=96, weight_std=0.2)
    quantize, kw = FORMATS[fmt]
    write_quantized(base, tmp_path, fmt, quantize, quantization_config(fmt, **kw))
    for f in base.iterdir():       # the tokenizer rank 0 loads
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(f, tmp_path / f.name)
    runner = reference(tmp_path)
    assert type(runner.model.model.layers[0].mlp.down_proj).__name__ != "Linear"
    ref = step_logits(runner)
    with tp_engine(tmp_path, 2) as engine:
        layer = engine.runner.model.model.layers[0]
        assert layer.mlp.down_proj.in_features == 64 and layer.self_attn.q_proj.out_features == 32
        got = step_logits(engine.runner)
    for a, b in zip(ref, got):
        assert rel_err(a, b) <= 1e-5
