"""GGUF (llama architecture) -> Hugging Face checkpoint folder: dequantized safetensors, config.json,
tokenizer files. The folder is cached, so converting happens once per file."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmopt.errors import ModelLoadError
from llmopt.models.config import gguf_hf_config

CONVERTER_VERSION = 2

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def hf_name(gguf_name: str) -> str:
    if gguf_name in _TENSOR_NAMES:
        return _TENSOR_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")


def unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores q/k rows interleaved for its RoPE; undo it for rotate-half RoPE."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reader_metadata(reader) -> dict:
    """A gguf.GGUFReader's metadata as key -> value, string arrays (the vocabulary) left out."""
    import gguf
    meta = {}
    for key, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] == gguf.GGUFValueType.STRING:
            continue
        meta[key] = f.contents()
    return meta


def gguf_config(reader) -> dict:
    """The config.json of the converted folder: models/config.py's gguf_hf_config, the mapping
    kv-estimate reads GGUF headers with too."""
    meta = reader_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported: llmopt reads llama-architecture GGUF files")
    return gguf_hf_config(meta, [(t.name, tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors])


def cache_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CONVERTER_VERSION}".encode())
    return f"{path.stem}-{h.hexdigest()[:12]}"


def convert_gguf(path: Path, out_dir: Path, progress=None) -> Path:
    """Write `out_dir` (atomically: a temp folder renamed into place) and return it."""
    import gguf
    from safetensors.torch import save_file

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises plain ValueErrors for bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file: {e}") from e
    cfg = gguf_config(reader)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        tensors = {}
        for t in reader.tensors:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(np.array(arr, dtype=np.float32))
            w = w.reshape([int(s) for s in reversed(t.shape)]) if w.numel() == int(np.prod(t.shape)) else w
            name = hf_name(t.name)
            if t.name.endswith("attn_q.weight"):
                w = unpermute_rope(w, cfg["num_attention_heads"])
            elif t.name.endswith("attn_k.weight"):
                w = unpermute_rope(w, cfg["num_key_value_heads"])
            tensors[name] = w.contiguous()
            if progress:
                progress(1)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2))
        _convert_tokenizer(path, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _convert_tokenizer(path: Path, dest: Path) -> None:
    from transformers import AutoTokenizer
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(dest))
