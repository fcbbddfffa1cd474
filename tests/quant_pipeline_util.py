"""Checkpoints too big to build as a transformers model (the pipeline's peak-memory test): a
byte-level tokenizer built in code, a config.json, and random weights written as safetensors one
layer per shard, never all in memory. Small test checkpoints come from tests/conftest.py: make_tiny."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_byte_tokenizer(folder: Path) -> None:
    """A byte-level BPE tokenizer with no merges: 256 byte tokens + bos/eos (ids 256, 257)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}
    vocab.update({"<s>": 256, "</s>": 257})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(folder))


def write_checkpoint(folder: Path, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                     vocab: int = 258, dtype=torch.bfloat16, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    d = hidden // heads
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": d, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "tie_word_embeddings": False, "hidden_act": "silu",
           "bos_token_id": 256, "eos_token_id": 257, "torch_dtype": str(dtype).replace("torch.", "")}
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
    save_byte_tokenizer(folder)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=0.02: (torch.randn(*shape, generator=g) * std).to(dtype)  # noqa: E731
    weight_map = {}
    shard = f"model-00000-of-{layers:05d}.safetensors"
    rest = {"model.embed_tokens.weight": rnd(vocab, hidden, std=1.0), "lm_head.weight": rnd(vocab, hidden),
            "model.norm.weight": (1 + rnd(hidden, std=0.1).float()).to(dtype)}
    save_file(rest, str(folder / shard))
    weight_map.update({k: shard for k in rest})
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "self_attn.q_proj.weight": rnd(heads * d, hidden), p + "self_attn.k_proj.weight": rnd(kv_heads * d, hidden),
             p + "self_attn.v_proj.weight": rnd(kv_heads * d, hidden), p + "self_attn.o_proj.weight": rnd(hidden, heads * d),
             p + "mlp.gate_proj.weight": rnd(inter, hidden), p + "mlp.up_proj.weight": rnd(inter, hidden),
             p + "mlp.down_proj.weight": rnd(hidden, inter),
             p + "input_layernorm.weight": (1 + rnd(hidden, std=0.1).float()).to(dtype),
             p + "post_attention_layernorm.weight": (1 + rnd(hidden, std=0.1).float()).to(dtype)}
        shard = f"model-{i + 1:05d}-of-{layers:05d}.safetensors"
        save_file(t, str(folder / shard))
        weight_map.update({k: shard for k in t})
        del t
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder
