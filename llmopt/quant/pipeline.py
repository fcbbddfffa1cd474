"""Quantize a checkpoint layer by layer, so peak memory is about one decoder layer plus the
calibration activations, whatever the depth.

The input folder's safetensors are memory-mapped; for each decoder layer its weights are read,
the calibration activations run through it, it is quantized (llmopt.quant.layerwise), packed into
the output format (llmopt.quant.formats) and written as its own shard, then freed, and the
activations move on to the next layer. Embeddings, the final norm and the head are copied. The
whole output is written in a `.NAME.tmp<PID>` folder beside the target and swapped into place at
the end (llmopt.fsutil.atomic_folder): an interrupted run leaves nothing, a replaced folder is one
llmopt wrote (its llmopt.json marker), and never the input of the same command.
"""

from __future__ import annotations

import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from llmopt import defaults
from llmopt.errors import ModelLoadError, UserInputError
from llmopt.fsutil import atomic_folder, check_output_file, check_output_folder, clean_stale, temp_path
from llmopt.models.attention import DenseCausalAttention
from llmopt.models.config import ModelConfig
from llmopt.models.llama import DecoderLayer, rope_cos_sin, rope_inv_freq
from llmopt.models.loader import DTYPES, load_tokenizer, resolve, weight_files
from llmopt.quant.calib import load_calibration
from llmopt.quant.checkpoint import CheckpointReader, save_shard, write_metadata
from llmopt.eval.tasks import TaskEvalResult
from llmopt.quant.evaluate import QuantEval
from llmopt.quant.formats import gguf as gguf_format
from llmopt.quant.formats import pack_linear, quantization_config
from llmopt.layers.formats.bnb import BLOCKSIZES
from llmopt.quant.layerwise import LINEARS, LayerContext, dense, quantize_layer
from llmopt.quant.rtn import check_group_size
from llmopt.quant.config import FP4_METHODS, QuantConfig


@dataclass
class LayerReport:
    layer: int
    rel_error: float        # ||y_q − y||² / ||y − x||² on the first calibration samples
    seconds: float


@dataclass
class QuantizeResult:
    output: str
    source: str
    method: str
    format: str
    bits: int
    group_size: int | None     # None: fp8/int8 (per-channel scales, no groups)
    sym: bool
    calib_samples: int
    calib_seq_len: int
    size_before: int
    size_after: int
    seconds: float
    mean_rel_error: float
    max_rel_error: float
    layers: list[LayerReport] = field(default_factory=list)
    eval: QuantEval | None = None      # llmopt.quant.evaluate, when asked for (`llmopt quantize --eval`)
    task_eval: TaskEvalResult | None = None  # lm-eval tasks against the source (`llmopt quantize --eval-tasks`)
    group_size_reason: str | None = None   # how an auto group size was picked ("auto: 128 does not divide 576")


def validate(cfg: ModelConfig, qconfig: QuantConfig) -> None:
    """Check the quantization config against the model; fills in an auto group size (None) and its reason."""
    widths = (("the hidden size", cfg.hidden_size), ("the intermediate size", cfg.intermediate_size),
              ("the attention output", cfg.num_attention_heads * cfg.head_dim))
    if qconfig.method in ("awq", "gptq", "rtn"):
        if qconfig.group_size is None:
            qconfig.group_size, qconfig.group_size_reason = auto_group_size([n for _, n in widths])
        for name, n in widths:
            check_group_size(n, qconfig.group_size, name)
    if qconfig.method in FP4_METHODS:   # blocks lie within rows: every width a whole number of them
        if qconfig.method == "nf4" and qconfig.group_size not in BLOCKSIZES:
            raise UserInputError(f"--group-size {qconfig.group_size}: bitsandbytes blocks are "
                                 f"{', '.join(map(str, BLOCKSIZES))}")
        odd = next(((name, n) for name, n in widths if n % qconfig.group_size), None)
        if odd:
            raise UserInputError(f"--method {qconfig.method}: {odd[0]} ({odd[1]}) is not a whole number of "
                                 f"blocks of {qconfig.group_size}")
    if qconfig.format == "gguf":   # the block type, before any work
        qconfig.gguf_type = gguf_format.check(qconfig.bits, qconfig.sym, qconfig.group_size, qconfig.act_order,
                                              qconfig.method)
    if qconfig.seq_len > cfg.max_position_embeddings:
        raise UserInputError(f"--seq-len {qconfig.seq_len:,} is longer than the model's context of "
                             f"{cfg.max_position_embeddings:,} tokens: give at most that")


def auto_group_size(widths: list[int]) -> tuple[int, str]:
    """The largest of defaults.QUANT_GROUP_SIZES dividing every width (else -1: one group per row),
    with the reason shown in the summary, e.g. `auto: 128 does not divide 576`."""
    skipped = []
    for g in defaults.QUANT_GROUP_SIZES:
        odd = next((n for n in widths if n % g), None)
        if odd is None:
            return g, "auto" + (f": {', '.join(skipped)}" if skipped else "")
        skipped.append(f"{g} does not divide {odd}")
    return -1, f"auto: {', '.join(skipped)}; one group per row"


def output_dtype(qconfig: QuantConfig, reader: "CheckpointReader") -> torch.dtype:
    if qconfig.dtype != "auto":
        if qconfig.dtype not in DTYPES:
            raise UserInputError(f"unknown --out-dtype {qconfig.dtype!r}: use auto, float16, bfloat16 or float32")
        return DTYPES[qconfig.dtype]
    if qconfig.format in ("awq", "gptq", "gguf"):
        return torch.float16            # what the AutoAWQ / GPTQ kernels compute in (GGUF: F16 embeddings)
    dt = reader.float_dtype()
    return dt if dt in (torch.float16, torch.bfloat16) else torch.float16


def quantize_model(model: str | None, output: str | Path, qconfig: QuantConfig, overwrite: bool = False,
                   progress: Callable[[int], None] | None = None,
                   on_layer: Callable[[LayerReport], None] | None = None,
                   on_start: Callable[[int], None] | None = None) -> QuantizeResult:
    """Quantize `model` into the folder `output`. Once the inputs are checked, on_start(layers) tells
    how many steps follow; progress(1) after each decoder layer, on_layer(report) with its error."""
    t0 = time.perf_counter()
    qconfig = qconfig.resolved()
    output = Path(output).expanduser()
    # Everything a bad --output would lose is refused before any work (the GGUF conversion included):
    # the inputs as named (--model, --calib-data), then the folder --model resolves to.
    inputs = [p for p in (model, qconfig.calib_data) if p and Path(p).expanduser().exists()]
    check_output = _check_gguf_output if qconfig.format == "gguf" else check_output_folder
    check_output(output, overwrite, inputs)
    ckpt = resolve(model)
    folder = ckpt.folder
    check_output(output, overwrite, [*inputs, folder, *([ckpt.gguf] if ckpt.gguf else [])])
    cfg = ModelConfig.from_path(folder)
    if cfg.quantization_config:
        raise ModelLoadError(f"{folder} is already quantized ({cfg.quantization_config.get('quant_method')}): "
                             "quantize from the float checkpoint")
    validate(cfg, qconfig)
    reader = CheckpointReader(folder, ckpt.gguf)
    out_dtype = output_dtype(qconfig, reader)
    fp16_scales = qconfig.format in ("awq", "gptq", "gguf")
    qconfig.scale_dtype = str(torch.float16 if fp16_scales else out_dtype).replace("torch.", "")
    calib_ids = _calibration(folder, qconfig)
    err_samples = max(1, min(calib_ids.shape[0], qconfig.error_tokens // qconfig.seq_len))

    pack_linear, quantization_config = _packer(qconfig.format)
    n_layers = cfg.num_hidden_layers
    if on_start:
        on_start(n_layers)
    shard = lambda k: f"model-{k + 1:05d}-of-{n_layers + 1:05d}.safetensors"  # noqa: E731
    weight_map: dict[str, str] = {}
    reports: list[LayerReport] = []
    marker = {"command": "quantize", "method": qconfig.method, "format": qconfig.format, "bits": qconfig.bits,
              "group_size": qconfig.group_size, "source": str(folder.resolve()), "model": model or defaults.DEFAULT_MODEL}
    # A `.NAME.tmp<PID>` folder beside the target, removed on any error, Ctrl-C or SIGTERM, swapped
    # into place atomically at the end (a dead run's leftover is removed by the next start). GGUF:
    # the same shards in a work folder, assembled into the one file at the end, then removed.
    with (_gguf_work(output) if qconfig.format == "gguf" else atomic_folder(output, marker)) as tmp:
        rest = {n: _cast(reader.get(n), out_dtype) for n in reader.names() if not n.startswith("model.layers.")}
        x = F.embedding(calib_ids, reader.get("model.embed_tokens.weight").float())
        weight_map.update(save_shard(tmp / shard(0), rest))
        del rest
        ctx = LayerContext(*rope_cos_sin(rope_inv_freq(cfg), torch.arange(qconfig.seq_len), torch.float32),
                           DenseCausalAttention())
        for i in range(n_layers):
            t1 = time.perf_counter()
            layer = _load_layer(cfg, reader, i)
            outcome = quantize_layer(layer, x, err_samples, ctx, qconfig)
            tensors = {}
            for name, qt in outcome.quantized.items():
                prefix = f"model.layers.{i}.{name}"
                packed = pack_linear(prefix, qt, qconfig.format, out_dtype)
                if qt.bias is not None and f"{prefix}.bias" not in packed:
                    packed[f"{prefix}.bias"] = qt.bias
                tensors.update(packed)
            for pname, p in layer.state_dict().items():
                if not any(pname.startswith(f"{lin}.") for lin in LINEARS):
                    tensors[f"model.layers.{i}.{pname}"] = p.to(out_dtype)   # norms (changed by AWQ / SmoothQuant)
            weight_map.update(save_shard(tmp / shard(i + 1), {k: _cast(v, out_dtype) if k.endswith(".bias") else v
                                                              for k, v in tensors.items()}))
            x = outcome.next_x
            report = LayerReport(i, outcome.rel_error, time.perf_counter() - t1)
            reports.append(report)
            del layer, outcome, tensors
            if on_layer:
                on_layer(report)
            if progress:
                progress(1)
        qcfg = quantization_config(qconfig.format, qconfig=qconfig)
        write_metadata(folder, tmp, weight_map, qcfg, out_dtype)
        if qconfig.format == "gguf":
            gguf_format.write_file(tmp, output, cfg, folder, ckpt.gguf, qconfig.gguf_type)
    errors = [r.rel_error for r in reports]
    size_after = output.stat().st_size if qconfig.format == "gguf" else _size(sorted(output.glob("*.safetensors")))
    return QuantizeResult(
        output=str(output), source=str(folder), method=qconfig.method, format=qconfig.format, bits=qconfig.bits,
        group_size=qconfig.group_size, sym=bool(qconfig.sym), calib_samples=int(calib_ids.shape[0]),
        calib_seq_len=qconfig.seq_len, size_before=_size(weight_files(ckpt)),
        size_after=size_after, seconds=time.perf_counter() - t0,
        mean_rel_error=sum(errors) / max(len(errors), 1), max_rel_error=max(errors, default=0.0), layers=reports,
        group_size_reason=qconfig.group_size_reason)


def _load_layer(cfg: ModelConfig, reader: "CheckpointReader", i: int) -> DecoderLayer:
    with torch.device("meta"):
        layer = DecoderLayer(cfg, i)
    prefix = f"model.layers.{i}."
    state = {n[len(prefix):]: reader.get(n).float() for n in reader.names() if n.startswith(prefix)}
    state = {n: t for n, t in state.items() if not n.endswith("rotary_emb.inv_freq")}
    missing = set(layer.state_dict()) - set(state)
    if missing:
        raise ModelLoadError(f"{reader.folder}: layer {i} lacks {sorted(missing)[0]}")
    unexpected = set(state) - set(layer.state_dict())
    if unexpected:
        raise ModelLoadError(f"{reader.folder}: layer {i} has weights llmopt does not know: {sorted(unexpected)[0]}")
    layer.load_state_dict(state, assign=True)
    return layer.eval()


def _calibration(folder: Path, qconfig: QuantConfig) -> torch.Tensor:
    """Token windows: the full set for methods that calibrate, else only what the error report uses."""
    n = qconfig.num_samples if qconfig.needs_calibration else max(1, qconfig.error_tokens // qconfig.seq_len)
    return load_calibration(qconfig.calib_data, load_tokenizer(folder), n, qconfig.seq_len, qconfig.seed, qconfig.text_field).ids


def _packer(fmt: str):
    """(pack_linear, quantization_config) for a format: the checkpoint formats of llmopt.quant.formats,
    or `dequantized`: float weights after quantization (a plain checkpoint any loader reads, for
    evaluating a method's quality; weight rounding only, activations stay float)."""
    if fmt == "dequantized":
        def pack(prefix, qt, _fmt, dtype):
            return {f"{prefix}.weight": dense(qt, dtype)}
        return pack, lambda _fmt, qconfig: None
    return pack_linear, quantization_config


def _check_gguf_output(output: Path, overwrite: bool, inputs) -> Path:
    """--format gguf writes one file: a `.gguf` name, not an input, replaced only with --overwrite."""
    if Path(output).suffix != ".gguf":
        raise UserInputError(f"--output {output}: --format gguf writes one file: name it FILE.gguf")
    if Path(output).exists() and not overwrite:
        raise UserInputError(f"--output {output} exists: choose another file or pass --overwrite")
    return check_output_file(output, inputs)


@contextmanager
def _gguf_work(output: Path) -> Iterator[Path]:
    """A `.NAME.work.tmp<PID>` folder beside the GGUF file for the layer shards, always removed."""
    output.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(output.parent)
    work = temp_path(output.with_name(output.name + ".work"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def _size(files) -> int:
    return sum(Path(f).stat().st_size for f in files)
