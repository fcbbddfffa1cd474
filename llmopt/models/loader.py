"""Find and load a model: a Hugging Face checkpoint folder, a GGUF file, a Hugging Face id from the
local cache (offline), or a built-in name (the default, `smollm2-135m`). A GGUF file runs as stored
(llmopt.models.gguf_weights): its config and tokenizer are cached in a small folder, its weights are
read from the file itself."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from llmopt import defaults
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.layers import runtime
from llmopt.layers.modules16 import DTYPES16, convert_to_16bit
from llmopt.layers.tp import fit_quantized_modules
from llmopt.models.config import (ModelConfig, builtin_gguf, resolve_device_name, resolve_dtype_name,
                                  resolve_weight_dtype_name)
from llmopt.models import gguf_weights
from llmopt.models.gguf_convert import cached_conversion
from llmopt.models.llama import LlamaForCausalLM, rope_inv_freq
from llmopt.validate import safetensors_header

log = logging.getLogger("llmopt.models")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Any
    config: ModelConfig
    path: Path            # the checkpoint folder actually loaded
    source: str           # what the user named
    dtype: torch.dtype    # what it computes in (float32 on the CPU)
    device: torch.device
    gguf: Path | None = None   # the GGUF file the weights were read from
    weight_dtype: torch.dtype | None = None   # how its float Linear and embedding weights are held

    def __post_init__(self) -> None:
        if self.weight_dtype is None:
            self.weight_dtype = self.dtype


@dataclass(frozen=True)
class Checkpoint:
    """What a model name resolves to: the folder with config.json and the tokenizer and, for a GGUF
    file, the file the weights are read from (its cached folder holds no weights)."""
    folder: Path
    gguf: Path | None = None


def resolve_device(device: str | None = "auto") -> torch.device:
    """`auto`: CUDA when available, else the CPU (models/config.py: resolve_device_name, which kv-estimate uses)."""
    return torch.device(resolve_device_name(device))


def resolve_dtype(dtype: str | None, device: torch.device, checkpoint_dtype: str = "float32") -> torch.dtype:
    """What the model computes in: float32 on the CPU, `auto` the checkpoint's dtype on a GPU
    (models/config.py: resolve_dtype_name, which kv-estimate uses)."""
    return DTYPES[resolve_dtype_name(dtype, torch.device(device).type, checkpoint_dtype)]


def resolve_weight_dtype(dtype: str | None, device: torch.device, checkpoint_dtype: str = "float32") -> torch.dtype:
    """How float weights are held: on the CPU `auto` keeps a 16-bit checkpoint 16-bit
    (models/config.py: resolve_weight_dtype_name, which kv-estimate uses)."""
    return DTYPES[resolve_weight_dtype_name(dtype, torch.device(device).type, checkpoint_dtype)]


def resolve(model: str | None, progress=None) -> Checkpoint:
    """The checkpoint the user named (a GGUF's config and tokenizer cached once per file content)."""
    name = model or defaults.DEFAULT_MODEL
    if name in defaults.BUILTIN_MODELS:
        path = builtin_gguf(name)
        return Checkpoint(gguf_folder(path, progress), path)
    p = Path(name).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return Checkpoint(gguf_folder(p, progress), p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"{p} has no config.json: it is not a Hugging Face checkpoint folder")
        return Checkpoint(p)
    if p.exists():
        raise ModelLoadError(f"{p} is neither a checkpoint folder nor a .gguf file")
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return Checkpoint(hf_cache_folder(name))
    raise ModelLoadError(f"model {name!r} not found: give a checkpoint folder, a .gguf file, a Hugging Face id "
                         f"in the local cache, or one of: {', '.join(defaults.BUILTIN_MODELS)}")


def resolve_checkpoint(model: str | None, progress=None) -> Path:
    """The folder with the config and tokenizer of what the user named (`resolve(...).folder`)."""
    return resolve(model, progress).folder


def hf_cache_folder(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as e:
        raise ModelLoadError(f"{repo_id!r} is not in the local Hugging Face cache (llmopt works offline): "
                             f"download it first or pass a local folder") from e


def gguf_folder(path: Path, progress=None) -> Path:
    """The config and tokenizer of a GGUF file, cached under CACHE_DIR/gguf by the file's content
    (checked on each use, rebuilt with a warning when damaged: gguf_convert.cached_conversion)."""
    return cached_conversion(Path(path), defaults.CACHE_DIR / "gguf", progress)


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files, each header checked against its size (validate.safetensors_header:
    a truncated or garbage file is a one-line ModelLoadError naming it, before anything is read)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
            files = sorted({folder / str(f) for f in weight_map.values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index} is damaged: expected JSON with a weight_map of tensor name -> "
                                 "file") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{folder}: shards listed in model.safetensors.index.json are missing: {', '.join(missing)}")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    for f in files:
        safetensors_header(f)
    return files


def weight_files(ckpt: Checkpoint) -> list[Path]:
    """The files the weights are read from: the GGUF file, or the folder's safetensors."""
    return [ckpt.gguf] if ckpt.gguf is not None else safetensors_files(ckpt.folder)


def iter_safetensors(folder: Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs read lazily from memory-mapped safetensors files. lazy: (name, slice)
    pairs instead, safetensors' slice objects (`get_shape()`, `[rows, cols]` reads only that part),
    valid while the pair is being handled, each from its own mapping of the file: a tensor-parallel
    rank that copies its part out maps one tensor at a time, never the whole file."""
    from safetensors import SafetensorError, safe_open
    for f in safetensors_files(folder):
        try:
            with safe_open(str(f), framework="pt") as fh:
                names = list(fh.keys())
                if not lazy:
                    for name in names:
                        yield name, fh.get_tensor(name)
                    continue
            for name in names:
                with safe_open(str(f), framework="pt") as fh:
                    yield name, fh.get_slice(name)
        except SafetensorError as e:     # what the header check cannot see (an unknown dtype...)
            raise ModelLoadError(f"{f} cannot be read as safetensors: {e}") from None


def build_model(cfg: ModelConfig, folder: Path, dtype: torch.dtype, device: torch.device,
                quantization: str | None = None, lm_head_dtype: str = defaults.LM_HEAD_DTYPE,
                tp=None, gguf: Path | None = None, weight_dtype: torch.dtype | None = None) -> LlamaForCausalLM:
    """`quantization` int8|fp8: a float checkpoint's decoder Linears quantized per channel as they
    load; `lm_head_dtype` auto|float|int8 (layers/runtime.py: resolve_lm_head_dtype). `tp` (a
    llmopt.distributed.parallel.TPGroup): build and load this rank's shard only. `gguf`: the weights
    are that file's (run as stored: gguf_weights.install, a tensor-parallel rank's slices included;
    dequantized, one tensor at a time, for --quantization).
    `weight_dtype` 16-bit on the CPU: an unquantized safetensors checkpoint's Linear and embedding
    weights are held in it (llmopt/layers/modules16.py), the rest computes in `dtype`. Those are
    kept as read, each on a mapping of its own (a safetensors slice), which goes with its tensor:
    on one mapping of the whole file, q/k/v's pages stayed resident after fusing copied them (a
    300M bfloat16 checkpoint peaked at 1.11x its weights and KV cache; 1.02x so). The weights are
    then file pages, read on first use and shared with the page cache, as llama.cpp maps a GGUF."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, tp)
    sixteen = holds_16bit(cfg, device, dtype, weight_dtype, quantization, gguf)
    if sixteen:
        convert_to_16bit(model, weight_dtype)
    if gguf is None and sixteen and tp is None:   # each tensor on a mapping of its own (above)
        weights = ((n, part[:]) for n, part in iter_safetensors(folder, lazy=True))
    elif gguf is None:
        weights = iter_safetensors(folder, lazy=tp is not None)
    elif quantization:   # dequantized a tensor at a time, then quantized
        weights = gguf_weights.iter_float_weights(gguf, cfg)
    else:
        weights = gguf_weights.install(model, gguf, cfg, dtype, device, tp)
    if quantization:
        if cfg.quantization_config:
            raise UserInputError(f"--quantization {quantization}: {folder} is already quantized "
                                 f"({cfg.quantization_config.get('quant_method')})")
        names = runtime.convert_for_load_quantization(model, quantization)
        if tp is not None:   # per-row scales of the whole weight, then the rank's part (TP=1's numbers)
            weights = ((n, t[:] if n.removesuffix(".weight") in names else t) for n, t in weights)
        weights = runtime.quantize_as_loaded(weights, names, quantization)
    elif cfg.quantization_config:
        runtime.convert_for_runtime(model, cfg.quantization_config)  # swaps Linear for quantized modules
        if tp is not None:
            fit_quantized_modules(model, tp.plan)
    runtime.resolve_lm_head_dtype(lm_head_dtype, False, device)   # (checked before the work)
    loaded = model.load_weights(weights, dtype, device)
    quantized = bool(quantization or cfg.quantization_config or gguf_weights.runs_quantized(model))
    head = runtime.resolve_lm_head_dtype(lm_head_dtype, quantized, device)
    missing = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in loaded]
    if missing:
        raise ModelLoadError(f"{folder}: checkpoint lacks {len(missing)} weights, e.g. {missing[0]}")
    model.inv_freq = rope_inv_freq(cfg).to(device)  # a buffer, not in checkpoints: still on meta
    if head == "int8":
        runtime.quantize_lm_head(model)
    if device.type == "cpu" and quantized:
        runtime.release_freed_memory()
    return model.eval()


def holds_16bit(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype | None,
                quantization: str | None, gguf: Path | None) -> bool:
    """Whether build_model holds the float weights 16-bit (the CPU, a float safetensors checkpoint)."""
    return (weight_dtype is not None and weight_dtype != dtype and weight_dtype in DTYPES16 and device.type == "cpu"
            and not quantization and not cfg.quantization_config and gguf is None)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer
    names = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((Path(folder) / n).is_file() for n in names):
        raise ModelLoadError(f"{folder} has no tokenizer: expected {', '.join(names[:-1])} or {names[-1]} "
                             "beside config.json (copy them from the original checkpoint)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        first = str(e).strip().split("\n")[0].split(". ")[0][:200]   # transformers' messages run to paragraphs
        raise ModelLoadError(f"{folder}: cannot load the tokenizer ({e.__class__.__name__}: {first})") from e


def load_model(model: str | None = None, dtype: str | None = "auto", device: str | None = "auto",
               progress=None, tokenizer: bool = True, quantization: str | None = None,
               lm_head_dtype: str = defaults.LM_HEAD_DTYPE, tp=None) -> LoadedModel:
    """tp: a llmopt.distributed.parallel.TPGroup: this rank's shard, on its device (`tp.device`)."""
    ckpt = resolve(model, progress)
    cfg = ModelConfig.from_path(ckpt.folder)
    dev = tp.device if tp is not None else resolve_device(device)
    dt = resolve_dtype(dtype, dev, cfg.torch_dtype)
    wdt = resolve_weight_dtype(dtype, dev, cfg.torch_dtype)
    if ckpt.gguf is not None and dev.type == "cpu" and (dtype or "auto") != "auto":
        log.info(f"--dtype {dtype}: a GGUF's tensors run as stored on the CPU (its F16/BF16 matrices "
                 "16-bit), computing in float32")
    with torch.inference_mode(False), torch.no_grad():
        m = build_model(cfg, ckpt.folder, dt, dev, quantization, lm_head_dtype, tp, ckpt.gguf, wdt)
    tok = load_tokenizer(ckpt.folder) if tokenizer else None
    held = wdt if holds_16bit(cfg, dev, dt, wdt, quantization, ckpt.gguf) else dt
    return LoadedModel(m, tok, cfg, ckpt.folder, model or defaults.DEFAULT_MODEL, dt, dev, ckpt.gguf, held)
