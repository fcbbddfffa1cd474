"""A tiny llama GGUF written with the gguf package's GGUFWriter from a transformers model (q/k rows
permuted as llama.cpp's converter does, a byte-level BPE vocabulary of 97 tokens, BOS 95, EOS 96),
for the loader and GGUF-cache tests; its 2-D weights optionally in a GGML block type: the gguf
package's reference quantizers where it has one, else (K-quants) random blocks of sane scales."""

from __future__ import annotations

import numpy as np


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (interleaved RoPE layout)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    inverse = {v: k for k, v in {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm"}.items()}
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, layer, *mod, param = hf_name.split(".")
    return f"blk.{layer}.{inverse['.'.join(mod)]}.{param}"


# block scales that keep random K-quant weights at |w| ~ 0.1-1: (d, dmin) ranges per type
_K_SCALES = {"Q4_K": (4e-4, 4e-4), "Q5_K": (2e-4, 2e-4), "Q6_K": (6e-5, None)}
_RANDOM_SCALES = {**_K_SCALES, "Q4_0": (3e-3, None)}   # Q4_0: |w| = |d (q - 8)| up to ~0.02


def random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes a row] of valid K-quant (or Q4_0) blocks: random codes and sub-block
    scales, the fp16 super-block scales drawn in a range that gives weights of order 0.1 (Q4_0's:
    0.02)."""
    import gguf
    from llmopt.layers.formats.ggml import BLOCKS
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
    b = raw.view(BLOCKS[type_name])
    d, dmin = _RANDOM_SCALES[type_name]
    b["d"] = rng.uniform(-d, d, b["d"].shape).astype(np.float16)
    if dmin is not None:
        b["dmin"] = rng.uniform(0, dmin, b["dmin"].shape).astype(np.float16)
    return b.view(np.uint8).reshape(rows, -1)


def ggml_bytes(a: np.ndarray, type_name: str, seed: int = 0) -> np.ndarray:
    """A float matrix in a GGML block type: quantized by the gguf package, or random K-quant blocks
    of its shape."""
    import gguf
    if type_name in _K_SCALES:
        return random_blocks(type_name, a.shape[0], a.shape[1], seed)
    return gguf.quants.quantize(a, gguf.GGMLQuantizationType[type_name])


def _metadata(path, c):
    """A GGUFWriter with the llama hyperparameters of config `c` and the 97-token vocabulary."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    # a byte-level BPE vocabulary: printable ASCII but '~' (94), one merge (" t"), BOS, EOS = 97
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(32, 126)] + [b2u[32] + "t", "<s>", "</s>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 95 + [3, 3])
    w.add_token_merges([f"{b2u[32]} t"])
    w.add_bos_token_id(95)
    w.add_eos_token_id(96)
    return w


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_random_gguf(path, c, qtype: str) -> int:
    """A llama GGUF of config `c` (a SimpleNamespace; vocabulary 97) whose 2-D weights are random
    `qtype` blocks (random_blocks where it has the type, else ggml_bytes of random floats, a tensor
    at a time: the file is written without the model ever existing in float); returns the file's
    tensor bytes."""
    import gguf
    rng = np.random.default_rng(0)
    w = _metadata(path, c)
    h, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"token_embd.weight": (c.vocab_size, c.hidden_size), "output_norm.weight": (c.hidden_size,),
              "output.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (c.hidden_size,), f"blk.{i}.ffn_norm.weight": (c.hidden_size,),
                       f"blk.{i}.attn_q.weight": (h, c.hidden_size), f"blk.{i}.attn_k.weight": (kv, c.hidden_size),
                       f"blk.{i}.attn_v.weight": (kv, c.hidden_size), f"blk.{i}.attn_output.weight": (c.hidden_size, h),
                       f"blk.{i}.ffn_gate.weight": (c.intermediate_size, c.hidden_size),
                       f"blk.{i}.ffn_up.weight": (c.intermediate_size, c.hidden_size),
                       f"blk.{i}.ffn_down.weight": (c.hidden_size, c.intermediate_size)})
    total = 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            a = np.ones(shape, np.float32)
            w.add_tensor(name, a)
        else:
            a = (random_blocks(qtype, *shape, seed=int(rng.integers(1 << 31))) if qtype in _RANDOM_SCALES
                 else ggml_bytes((rng.standard_normal(shape, dtype=np.float32) * 0.02), qtype))
            w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType[qtype])
        total += a.nbytes
    _finish(w)
    return total


def write_tiny_gguf(path, hf, qtype: str | None = None, extra: dict | None = None):
    """`hf` as a GGUF (2-D weights as `qtype` blocks, else float); `extra`: more tensors by GGUF name."""
    import gguf
    c = hf.config
    w = _metadata(path, c)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    for i, (name, t) in enumerate(hf.state_dict().items()):
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        a = t.float().numpy().copy()
        if name.endswith("q_proj.weight"):
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(_gguf_name(name), ggml_bytes(a, qtype, seed=i), raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(_gguf_name(name), a)
    _finish(w)
