"""A rank's shard, loaded in this process (no other rank needed: loading runs no collective): each
parameter is the right slice of the whole model's, and from the memory-mapped safetensors a rank
reads only its part of every split tensor (norms, replicated, whole)."""

from __future__ import annotations

import pytest
import torch

from llmopt.distributed.parallel import TPGroup
from llmopt.distributed.plan import plan_for_config
from llmopt.layers.tp import layout
from llmopt.models import loader
from llmopt.models.config import ModelConfig


class Recorder:
    """A safetensors slice that counts the elements read through it."""

    def __init__(self, name, inner, reads):
        self.name, self.inner, self.reads = name, inner, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, key):
        t = self.inner[key]
        self.reads[self.name] = self.reads.get(self.name, 0) + t.numel()
        return t


def load_shard(folder, rank, world, monkeypatch):
    cfg = ModelConfig.from_path(folder)
    tp = TPGroup(plan_for_config(cfg, world), rank, torch.device("cpu"))
    reads: dict[str, int] = {}
    real = loader.iter_safetensors

    def recording(folder, lazy=False):
        assert lazy, "a rank reads slices, never whole tensors"
        for name, s in real(folder, lazy=True):
            yield name, Recorder(name, s, reads)

    monkeypatch.setattr(loader, "iter_safetensors", recording)
    model = loader.build_model(cfg, folder, torch.float32, torch.device("cpu"), tp=tp)
    return model, tp, reads


@pytest.mark.parametrize("kw,world", [
    (dict(model_type="llama", attention_bias=True, mlp_bias=True, vocab_size=97), 2),
    (dict(model_type="qwen2", num_key_value_heads=1, tie_word_embeddings=True), 2),
    (dict(model_type="llama", hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
          intermediate_size=96,
          vocab_size=100), 3),
])
def test_each_rank_holds_its_slice_and_reads_only_it(tiny_factory, monkeypatch, kw, world):
    folder = tiny_factory(**kw)
    full = loader.load_model(str(folder), "float32", "cpu", tokenizer=False).model
    whole = {n: p for n, p in full.named_parameters(remove_duplicate=False)}
    sizes = {n: p.numel() for n, p in whole.items()}
    for rank in range(world):
        model, tp, reads = load_shard(folder, rank, world, monkeypatch)
        plan = tp.plan
        hd = full.config.head_dim
        for name, p in model.named_parameters(remove_duplicate=False):
            w = whole[name]
            mod = name.split(".")[-2]
            if mod == "q_proj":
                want = w[rank * plan.heads_per_rank * hd:(rank + 1) * plan.heads_per_rank * hd]
            elif mod in ("k_proj", "v_proj"):
                k0 = plan.kv_head_start(rank) * hd
                want = w[k0:k0 + plan.kv_heads_per_rank * hd]
            elif mod in ("gate_proj", "up_proj"):
                n = plan.intermediate_per_rank
                want = w[rank * n:(rank + 1) * n]
            elif mod in ("o_proj", "down_proj") and name.endswith("weight"):
                n = w.shape[1] // world
                want = w[:, rank * n:(rank + 1) * n]
            elif mod in ("o_proj", "down_proj"):       # the bias: added once
                want = w if rank == 0 else torch.zeros_like(w)
            elif mod in ("embed_tokens", "lm_head"):
                a, b = plan.vocab_range(rank)
                want = torch.cat([w[a:b], w.new_zeros(plan.vocab_per_rank - (b - a), w.shape[1])])
            else:
                want = w
            assert torch.equal(p, want), name
        held = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
        for name, n in reads.items():
            if name not in sizes:
                continue
            if layout(name) == "replicated":
                assert n == sizes[name], name
            elif not name.endswith("bias"):    # a split tensor: no more than the rank holds
                assert n <= held[name], f"{name}: read {n} of {sizes[name]}, holds {held[name]}"
        kv_rows = model.model.layers[0].self_attn.k_proj.weight.shape[0]
        assert kv_rows == plan.kv_heads_per_rank * hd


@pytest.mark.parametrize("world,kv_heads", [(2, 2), (3, 3), (4, 2)])
def test_gguf_grouped_codes_cut_as_the_float_weight(world, kv_heads):
    """A GGUF tensor run as stored: each rank's slice of its codes, group scales and scale * zero
    dequantizes to the slice the float path cuts from the dequantized whole weight (vocabulary rows
    padded with zero rows); a row shard that would split a block is refused."""
    from llmopt.distributed.shard import shard_grouped, shard_tensor
    from llmopt.errors import ModelLoadError
    from llmopt.layers.formats.ggml import GroupedCodes
    cfg = ModelConfig(model_type="llama", vocab_size=50, hidden_size=384, intermediate_size=768, num_hidden_layers=1,
                      num_attention_heads=12, num_key_value_heads=kv_heads, head_dim=32)
    plan = plan_for_config(cfg, world)
    gen = torch.Generator().manual_seed(world)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (384, 384), "model.layers.0.self_attn.k_proj.weight":
              (32 * kv_heads, 384), "model.layers.0.mlp.down_proj.weight": (384, 768),
              "model.layers.0.self_attn.o_proj.weight": (384, 384), "model.embed_tokens.weight": (50, 384)}
    for name, (n, k) in shapes.items():
        for szero in (True, False):
            g = GroupedCodes(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
                             torch.rand(n, k // 32, generator=gen), torch.rand(n, k // 32, generator=gen)
                             if szero else torch.empty(0), 4, 32)
            whole = g.dequantize()
            for rank in range(world):
                part = shard_grouped(name, g, plan, rank)
                assert torch.equal(part.dequantize(), shard_tensor(name, whole, plan, rank)), (name, rank)
    k = 32 * (world + 1)     # K / world is no multiple of 32
    g = GroupedCodes(torch.zeros(8, k, dtype=torch.uint8), torch.ones(8, k // 32), torch.empty(0), 4, 32)
    with pytest.raises(ModelLoadError, match="whole 32-column blocks"):
        shard_grouped("model.layers.0.mlp.down_proj.weight", g, plan, 0)
    # as a GGUF holds them: Q4_0 and Q4_K nibbles packed as loaded, Q4_0's and Q6_K's implied zero,
    # a K-quant's sub-scales with their super-block scales (input columns cut in whole 256s)
    from gguf_util import ggml_bytes
    from llmopt.layers.formats.ggml import decode
    for type_name in ("Q4_0", "Q4_K", "Q6_K"):
        for name, (n, k) in {"model.layers.0.mlp.gate_proj.weight": (24, 768),
                             "model.layers.0.mlp.down_proj.weight": (24, 768),
                             "model.embed_tokens.weight": (50, 768)}.items():
            w = torch.randn(n, k, generator=gen).numpy() * 0.2
            g = decode(type_name, ggml_bytes(w, type_name), k, pack=True)
            whole = g.dequantize()
            for rank in range(world):
                if name.endswith("down_proj.weight") and type_name.endswith("_K") and (k // world) % 256:
                    with pytest.raises(ModelLoadError, match="whole 256-column super-blocks"):
                        shard_grouped(name, g, plan, rank)
                    continue
                part = shard_grouped(name, g, plan, rank)
                assert torch.equal(part.dequantize(), shard_tensor(name, whole, plan, rank)), (type_name, name, rank)
