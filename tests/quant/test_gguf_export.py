"""`llmopt quantize --format gguf`: integer groups written as GGUF blocks (Q4_1 asymmetric, Q4_0
symmetric, Q8_0 8-bit symmetric) read back by the gguf package's own dequantizers as the same
checkpoint's weights written as compressed-tensors (exact, but for Q4_1's m rounded to fp16), with
the tokenizer and hyperparameters llama.cpp reads, and loaded by our loader as stored; bad
combinations refused before any work."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from llmopt.errors import UserInputError
from llmopt.layers.types import IntQuantized
from llmopt.models.gguf_weights import unpermute_rope
from llmopt.models.loader import load_model
from llmopt.quant.config import QuantConfig
from llmopt.quant.formats import gguf as gguf_format
from llmopt.quant.pipeline import quantize_model

CASES = {"Q4_1": dict(bits=4, sym=False, group_size=64), "Q4_0": dict(bits=4, sym=True, group_size=32),
         "Q8_0": dict(bits=8, sym=True, group_size=64)}


def _int_quantized(kind: str, n: int = 24, k: int = 128, seed: int = 0) -> IntQuantized:
    c = CASES[kind]
    g = torch.Generator().manual_seed(seed)
    groups = k // c["group_size"]
    codes = torch.randint(0, 2 ** c["bits"], (n, k), generator=g)
    zeros = torch.full((n, groups), 2 ** (c["bits"] - 1)) if c["sym"] else torch.randint(0, 16, (n, groups), generator=g)
    scales = (torch.rand(n, groups, generator=g) * 0.05 + 0.001).half().float()   # fp16 scales, as the pipeline picks
    return IntQuantized(codes, scales, zeros, c["bits"], c["group_size"], c["sym"])


@pytest.mark.parametrize("kind", list(CASES))
def test_blocks_dequantize_to_the_groups_weights(kind):
    qt = _int_quantized(kind)
    raw = gguf_format.pack("w", qt)["w.weight"].numpy()
    got = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]), np.float64))
    want = qt.dequantize().double()
    if kind == "Q4_1":   # m = -z * s in fp16: within half an fp16 ulp of m
        m = (qt.zeros * qt.scales).double().repeat_interleave(qt.group_size, 1)
        assert float((got - want).abs().max()) <= float((m * 2 ** -11).max()) + 1e-12
        assert not torch.equal(got, want)                                 # the rounding is real
    else:
        assert torch.equal(got, want)


def test_refused_before_any_work(tiny_factory, tmp_path):
    folder = tiny_factory(tokenizer=True)
    for kw, match in [(dict(bits=8, sym=False), "8-bit symmetric"), (dict(bits=4, group_size=-1), "32 or a multiple"),
                      (dict(bits=3), "4-bit groups")]:
        with pytest.raises(UserInputError, match=match):
            quantize_model(str(folder), tmp_path / "x.gguf", QuantConfig(method="rtn", format="gguf", **kw))
    with pytest.raises(UserInputError, match="FILE.gguf"):
        quantize_model(str(folder), tmp_path / "x", QuantConfig(method="rtn", format="gguf"))
    with pytest.raises(UserInputError, match="compressed-tensors only"):
        quantize_model(str(folder), tmp_path / "x.gguf", QuantConfig(method="fp8", format="gguf"))
    (tmp_path / "x.gguf").write_bytes(b"mine")
    with pytest.raises(UserInputError, match="--overwrite"):
        quantize_model(str(folder), tmp_path / "x.gguf", QuantConfig(method="rtn", format="gguf"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.gguf"]


@pytest.mark.parametrize("kind", list(CASES))
def test_the_file_holds_the_checkpoints_weights_and_loads(tiny_factory, tmp_path, kind, monkeypatch):
    from llmopt import defaults
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    folder = tiny_factory(tokenizer=True, weight_std=0.05)
    c = dict(CASES[kind], method="rtn")
    quantize_model(str(folder), tmp_path / "m.gguf", QuantConfig(format="gguf", **c))
    quantize_model(str(folder), tmp_path / "ct", QuantConfig(format="compressed-tensors", **c))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "cache") == ["ct", "m.gguf"]   # no work folder left
    ref = load_model(str(tmp_path / "ct"), dtype="float32", device="cpu", tokenizer=False)
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    cfg = ref.config
    tensors = {t.name: t for t in reader.tensors}
    assert {tensors[n].tensor_type.name for n in tensors if ".attn_" in n or ".ffn_" in n and "norm" not in n} \
        >= {kind}
    assert reader.fields["general.architecture"].contents() == "llama"
    assert reader.fields["llama.block_count"].contents() == cfg.num_hidden_layers
    assert reader.fields["llama.attention.head_count_kv"].contents() == cfg.num_key_value_heads
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == cfg.vocab_size
    for i in range(cfg.num_hidden_layers):
        for gname, hname, heads in [("attn_q", "self_attn.q_proj", cfg.num_attention_heads),
                                    ("attn_k", "self_attn.k_proj", cfg.num_key_value_heads),
                                    ("attn_v", "self_attn.v_proj", None), ("ffn_down", "mlp.down_proj", None)]:
            t = tensors[f"blk.{i}.{gname}.weight"]
            assert t.tensor_type.name == kind
            w = torch.from_numpy(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32))
            w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
            w = unpermute_rope(w, heads) if heads else w
            want = ref.model.get_submodule(f"model.layers.{i}.{hname}").dequantized()
            tol = 0.0 if kind != "Q4_1" else float(want.abs().max()) * 2 ** -10
            assert float((w - want).abs().max()) <= tol
    lm = load_model(str(tmp_path / "m.gguf"), dtype="float32", device="cpu")
    ids = torch.tensor([lm.tokenizer("The quick brown fox jumps over").input_ids])
    assert lm.tokenizer.decode(ids[0], skip_special_tokens=True).strip() == "The quick brown fox jumps over"
    from llmopt.models.attention import DenseCausalAttention
    pos = torch.arange(ids.shape[1])
    with torch.no_grad():
        got = lm.model.compute_logits(lm.model(ids, pos, DenseCausalAttention()))
        want = ref.model.compute_logits(ref.model(ids, pos, DenseCausalAttention()))
    assert float((got - want).abs().max() / want.abs().max()) <= (2e-2 if kind == "Q4_1" else 2e-3)


def test_a_gguf_source_keeps_its_metadata(tmp_path, monkeypatch):
    """From a GGUF source (a tiny float file), the export copies its metadata, the tokenizer's string
    arrays included, with the new file type; the q/k row order round-trips through both permutations."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from gguf_util import write_tiny_gguf
    from llmopt import defaults
    monkeypatch.setattr(defaults, "CACHE_DIR", tmp_path / "cache")
    torch.manual_seed(0)
    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=95, eos_token_id=96)
    write_tiny_gguf(tmp_path / "src.gguf", AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).eval())
    quantize_model(str(tmp_path / "src.gguf"), tmp_path / "q.gguf", QuantConfig(method="rtn", format="gguf",
                                                                                  group_size=32, seq_len=128))
    src, out = (gguf.GGUFReader(str(tmp_path / n)) for n in ("src.gguf", "q.gguf"))
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.attention.head_count_kv",
                "tokenizer.ggml.bos_token_id"):
        assert out.fields[key].contents() == src.fields[key].contents()
    assert out.fields["general.file_type"].contents() == gguf_format.FILE_TYPES["Q4_0"]
    q = load_model(str(tmp_path / "q.gguf"), dtype="float32", device="cpu", tokenizer=False).model
    f = load_model(str(tmp_path / "src.gguf"), dtype="float32", device="cpu", tokenizer=False).model
    w, want = q.model.layers[0].self_attn.q_proj.dequantized(), f.model.layers[0].self_attn.q_proj.weight
    assert float((w - want).abs().max()) <= float(want.abs().max()) / 7 * 0.51 + 1e-6   # half a step of sym 4-bit
