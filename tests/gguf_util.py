"""A tiny llama GGUF written with the gguf package's GGUFWriter from a transformers model (q/k rows
permuted as llama.cpp's converter does, a byte-level BPE vocabulary of 97 tokens, BOS 95, EOS 96),
for the loader and GGUF-cache tests."""

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


def write_tiny_gguf(path, hf):
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    c = hf.config
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
    for name, t in hf.state_dict().items():
        a = t.float().numpy().copy()
        if name.endswith("q_proj.weight"):
            a = _llama_cpp_permute(a, c.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = _llama_cpp_permute(a, c.num_key_value_heads)
        w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
