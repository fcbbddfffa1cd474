"""Writing a quantized model as one GGUF file, as llama.cpp's tools write it, that llama.cpp,
llama-cpp-python and Ollama load.

Each group of the integer quantization maps exactly onto GGML blocks of 32 (a group of 64 spans
two blocks with the same numbers): 4-bit asymmetric as Q4_1 (w = q * d + m with d = s, m = -z * s),
4-bit symmetric as Q4_0 (w = (q - 8) * d), 8-bit symmetric as Q8_0 (w = (q - 128) * d). The scales
are chosen in fp16 (SCALE_DTYPE), so d is exact; Q4_1's m is -z * s rounded to fp16, the one rounding
of the export (|error| <= 2^-11 |m|, at most 15 * 2^-11 of a quantization step).

MXFP4 (`--method mxfp4`) is written as GGML's MXFP4 blocks, the same numbers (llmopt.layers.formats.fp4:
mxfp4_to_ggml); its scale rule and rounding are ggml's own (llmopt.quant.fp4, rule `ocp`).

Embeddings and the head are written F16, norms F32, q/k rows in llama.cpp's interleaved RoPE order.
The metadata: a GGUF source's own (its tokenizer included, file type updated), or for a Hugging Face
source the config's hyperparameters and its tokenizer (the gguf package's vocabulary readers).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from llmopt.errors import UserInputError
from llmopt.fsutil import apply_umask, temp_path
from llmopt.layers.formats.fp4 import MXFP4_BLOCK, Mxfp4Quantized, mxfp4_to_ggml
from llmopt.layers.formats.ggml import BLOCKS
from llmopt.layers.types import IntQuantized
from llmopt.models.gguf_weights import ROPE_FREQS, gguf_name, permute_rope

SCALE_DTYPE = torch.float16
TYPES = {(4, False): "Q4_1", (4, True): "Q4_0", (8, True): "Q8_0"}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* (F16: a float work folder; MXFP4: MOSTLY_MXFP4_MOE, its one MXFP4 file type)
FILE_TYPES = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "MXFP4": 38}


def check(bits: int, sym: bool, group_size: int | None, act_order: str, method: str = "rtn") -> str:
    """The block type a quantization writes as, or a UserInputError saying what GGUF can hold."""
    if method == "mxfp4":
        return "MXFP4"
    kind = TYPES.get((bits, bool(sym)))
    if kind is None or group_size is None or group_size == -1 or group_size % 32 or act_order == "group":
        raise UserInputError("--format gguf holds 4-bit groups (Q4_1 asymmetric, Q4_0 --sym) or 8-bit symmetric "
                             "ones (Q8_0) of 32 or a multiple of 32, without act-order's g_idx: use --bits 4|8, "
                             "--group-size 32|64|128 (and --sym for 8 bits)")
    return kind


def pack(prefix: str, qt: IntQuantized) -> dict[str, torch.Tensor]:
    """{prefix.weight: uint8 [out, in / 32 * block bytes]}: the Linear's rows as GGML blocks."""
    if isinstance(qt, Mxfp4Quantized):
        if qt.codes.shape[1] % MXFP4_BLOCK:
            raise UserInputError(f"{prefix}: {qt.codes.shape[1]} columns do not split into MXFP4 blocks of 32")
        return {f"{prefix}.weight": mxfp4_to_ggml(qt)}
    kind = TYPES.get((qt.bits, bool(qt.sym)))
    if not isinstance(qt, IntQuantized) or kind is None or qt.g_idx is not None:
        raise UserInputError(f"{prefix}: GGUF holds Q4_0, Q4_1 and Q8_0 group quantization without a g_idx")
    n, k = qt.qweight.shape
    gs = k if qt.group_size == -1 else qt.group_size
    if gs % 32 or k % gs:
        raise UserInputError(f"{prefix}: groups of {gs} do not split into GGML blocks of 32")
    rep = gs // 32
    codes = qt.qweight.to(torch.int32).view(n, k // 32, 32).numpy()
    scale = qt.scales.to(torch.float32).repeat_interleave(rep, dim=1)       # [n, blocks]
    zero = qt.zeros.to(torch.float32).repeat_interleave(rep, dim=1)
    b = np.zeros((n, k // 32), dtype=BLOCKS[kind])
    b["d"] = scale.numpy().astype(np.float16)
    if kind == "Q8_0":
        if not bool((qt.zeros == 128).all()):
            raise UserInputError(f"{prefix}: Q8_0 is symmetric: every zero point must be 128")
        b["qs"] = (codes - 128).astype(np.int8)
    else:
        if kind == "Q4_0" and not bool((qt.zeros == 8).all()):
            raise UserInputError(f"{prefix}: Q4_0 is symmetric: every zero point must be 8")
        if kind == "Q4_1":
            b["m"] = (-zero * scale).numpy().astype(np.float16)
        b["qs"] = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    return {f"{prefix}.weight": torch.from_numpy(b.view(np.uint8).reshape(n, -1))}


def _copy_metadata(writer, source: Path, kind: str) -> None:
    """Every key of a GGUF source but the writer's own and the file type (set to `kind`'s)."""
    import gguf   # deferred: start-up time (its reader decodes the string arrays: the vocabulary)
    reader = gguf.GGUFReader(str(source))
    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, f.contents(), vtype, sub)
    writer.add_file_type(FILE_TYPES[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _hf_metadata(writer, folder: Path, cfg, kind: str) -> None:
    """llama hyperparameters from the config, the tokenizer through the gguf package's readers."""
    import gguf   # deferred: start-up time
    writer.add_name(folder.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(FILE_TYPES[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    try:
        vocab = gguf.vocab.BpeVocab(folder)
        model = "gpt2"
    except FileNotFoundError:
        try:
            vocab, model = gguf.vocab.LlamaHfVocab(folder), "llama"
        except (FileNotFoundError, TypeError) as e:
            raise UserInputError(f"{folder}: no tokenizer GGUF can hold (a BPE tokenizer.json or a "
                                 f"SentencePiece tokenizer.model): {e}") from None
    tokens, scores, types = [], [], []
    for text, score, ttype in vocab.all_tokens():
        tokens.append(text)
        scores.append(score)
        types.append(ttype)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), cfg.vocab_size)]   # a padded embedding's rows
    scores += [-1000.0] * (len(tokens) - len(scores))
    types += [gguf.TokenType.UNUSED] * (len(tokens) - len(types))
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    gguf.SpecialVocab(folder, load_merges=model == "gpt2", n_vocab=len(tokens)).add_to_gguf(writer, quiet=True)


def rope_freq_factors(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs.weight: the factor dividing each RoPE frequency (the default ones over
    the scaled ones: llama3's ramp, or a GGUF source's own factors)."""
    from llmopt.models.llama import rope_inv_freq   # deferred: start-up time (model code)
    plain = rope_inv_freq(replace(cfg, rope_scaling=None))
    return (plain / rope_inv_freq(cfg)).numpy().astype(np.float32)


def write_file(work: Path, output: Path, cfg, source_folder: Path, source_gguf: Path | None, kind: str) -> None:
    """Assemble `output` from the work folder's safetensors shards (its weight map), streaming one
    tensor at a time into `.NAME.tmp<PID>` beside it, renamed into place when complete."""
    import gguf   # deferred: start-up time
    from safetensors import safe_open
    weight_map = json.loads((work / "model.safetensors.index.json").read_text())["weight_map"]
    names = [n for n in weight_map if not (cfg.tie_word_embeddings and n == "lm_head.weight")]
    order = sorted(names, key=lambda n: (0, "") if n == "model.embed_tokens.weight" else
                   (1, f"{int(n.split('.')[2]):06d}{n}") if n.startswith("model.layers.") else (2, n))
    handles = {f: safe_open(str(work / f), framework="np") for f in set(weight_map.values())}

    def array(name: str) -> tuple[np.ndarray, gguf.GGMLQuantizationType | None]:
        a = handles[weight_map[name]].get_tensor(name)
        if a.dtype == np.uint8:
            qtype = gguf.GGMLQuantizationType[kind]
        else:
            a = a.astype(np.float32 if a.ndim == 1 else np.float16)
            qtype = None
        if name.endswith("q_proj.weight"):
            a = permute_rope(a, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            a = permute_rope(a, cfg.num_key_value_heads)
        return np.ascontiguousarray(a), qtype

    extra = {}
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] in ("llama3", "freq_factors"):
        extra[ROPE_FREQS] = rope_freq_factors(cfg)   # as llama.cpp's converter writes Llama 3.x
    tmp = temp_path(output)
    writer = gguf.GGUFWriter(str(tmp), "llama")
    try:
        if source_gguf is not None:
            _copy_metadata(writer, source_gguf, kind)
        else:
            _hf_metadata(writer, source_folder, cfg, kind)
        for name in order:
            a, qtype = array(name)
            writer.add_tensor_info(gguf_name(name), a.shape, a.dtype, a.nbytes, raw_dtype=qtype)
        for name, a in extra.items():
            writer.add_tensor_info(name, a.shape, a.dtype, a.nbytes)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in order:
            writer.write_tensor_data(array(name)[0])
        for a in extra.values():
            writer.write_tensor_data(a)
        writer.close()
        apply_umask(tmp)
        os.replace(tmp, output)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
