"""What to quantize and how: one dataclass the CLI, recipes and the pipeline share."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from llmopt import defaults
from llmopt.errors import UserInputError
from llmopt.validate import SEED_MAX, SEED_MIN, decode_utf8

METHODS = ("awq", "gptq", "rtn", "fp8", "int8", "nvfp4", "mxfp4", "nf4")
FORMATS = ("awq", "gptq", "compressed-tensors", "gguf", "bitsandbytes", "dequantized")
DEFAULT_FORMAT = {"awq": "awq", "gptq": "gptq", "rtn": "compressed-tensors", "fp8": "compressed-tensors",
                  "int8": "compressed-tensors", "nvfp4": "compressed-tensors", "mxfp4": "compressed-tensors",
                  "nf4": "bitsandbytes"}
# 4-bit float methods -> the formats that hold them; FP4_BLOCKS: the block size each format fixes
# (nf4's is --group-size, default defaults.NF4_BLOCK)
FP4_METHODS = {"nvfp4": ("compressed-tensors", "dequantized"), "mxfp4": ("compressed-tensors", "gguf", "dequantized"),
               "nf4": ("bitsandbytes", "dequantized")}
FP4_BLOCKS = {"nvfp4": 16, "mxfp4": 32}   # (also the methods with FP4 activations: --activations dynamic, W4A4)
FP4_ALGORITHMS = ("rtn", "gptq")


ACT_ORDERS = ("none", "static", "group")


def act_order_mode(act_order: "str | bool | None") -> str:
    """`none`, `static` or `group` (llm-compressor's names); True is GPTQModel's desc_act (`group`)."""
    if act_order is True:
        return "group"
    if act_order is False or act_order is None:
        return "none"
    return str(act_order)


@dataclass
class QuantConfig:
    method: str = "awq"
    bits: int | None = None            # 4 for awq/gptq/rtn, 8 for fp8/int8
    group_size: int | None = None      # None: auto, the largest of QUANT_GROUP_SIZES dividing every layer
    sym: bool | None = None            # None: symmetric for gptq/rtn, asymmetric (zero points) for awq
    format: str | None = None          # None: DEFAULT_FORMAT[method]
    calib_data: str = defaults.CALIB_DATA
    text_field: str = defaults.TEXT_FIELD   # .jsonl field / dataset column of calib_data
    num_samples: int = defaults.QUANT_NUM_SAMPLES
    seq_len: int = defaults.QUANT_SEQ_LEN
    seed: int = defaults.QUANT_SEED
    damp: float = defaults.GPTQ_DAMP
    act_order: str | bool | None = None   # GPTQ: none | static | group; None: defaults.GPTQ_ACT_ORDER
    smoothquant_alpha: float = defaults.SMOOTHQUANT_ALPHA
    awq_duo_scaling: bool = False
    awq_grid: int = defaults.AWQ_GRID
    awq_search_tokens: int = defaults.AWQ_SEARCH_TOKENS
    error_tokens: int = defaults.QUANT_ERROR_TOKENS   # calibration tokens the per-layer error is measured on
    fp8_scale: str = "channel"         # channel | tensor
    activations: str | None = None     # fp8/int8: dynamic (W8A8, the default) | none (weight-only); nvfp4/mxfp4:
    #                                    none (the default) | dynamic (W4A4); nf4: none
    fp4_algorithm: str | None = None   # nvfp4/mxfp4: rtn (default) | gptq (error feedback, calibrated)
    dtype: str = "auto"                # unquantized tensors: auto = checkpoint's 16-bit dtype, else float16
    scale_dtype: str | None = None     # set by the pipeline: the dtype the format stores scales in
    gguf_type: str | None = None       # set by the pipeline for --format gguf: Q4_0, Q4_1, Q8_0 or MXFP4
    group_size_reason: str | None = None   # set by the pipeline when it picks the group size (auto)

    @property
    def scale_torch_dtype(self):
        import torch
        return getattr(torch, self.scale_dtype) if self.scale_dtype else None

    def resolved(self) -> "QuantConfig":
        """A copy with the method-dependent defaults filled in, validated."""
        s = QuantConfig(**{f.name: getattr(self, f.name) for f in fields(self)})
        if s.method not in METHODS:
            raise UserInputError(f"unknown --method {s.method!r}: use one of {', '.join(METHODS)}")
        if s.method in FP4_METHODS:
            _resolve_fp4(s)
        elif s.fp4_algorithm is not None:
            raise UserInputError("--fp4-algorithm applies to --method nvfp4 and mxfp4 only")
        if s.activations is None:
            s.activations = "dynamic"
        if s.bits is None:
            s.bits = 8 if s.method in ("fp8", "int8") else 4
        if s.method in ("fp8", "int8") and s.bits != 8:
            raise UserInputError(f"--method {s.method} is 8-bit: drop --bits or use --bits 8")
        if s.method in ("awq", "gptq", "rtn") and s.bits not in (2, 3, 4, 8):
            raise UserInputError(f"--bits {s.bits} is not supported: use 4 or 8 (2 and 3 for experiments)")
        if s.sym is None:
            s.sym = s.method != "awq"
        if s.format is None:
            s.format = DEFAULT_FORMAT[s.method]
        if s.format not in FORMATS:
            raise UserInputError(f"unknown --format {s.format!r}: use one of {', '.join(FORMATS)}")
        if s.method in ("fp8", "int8") and s.format not in ("compressed-tensors", "dequantized"):
            raise UserInputError(f"--method {s.method} is written as compressed-tensors only: use --format compressed-tensors")
        gptq_like = s.method == "gptq" or s.fp4_algorithm == "gptq"
        if s.act_order not in (None, False, "none") and not gptq_like:
            raise UserInputError("--act-order applies to --method gptq (and --fp4-algorithm gptq) only")
        s.act_order = act_order_mode(s.act_order if s.act_order is not None or not gptq_like
                                     else defaults.GPTQ_ACT_ORDER)
        if s.act_order == "group" and s.method in FP4_METHODS:
            raise UserInputError("--act-order group needs a g_idx, which FP4 formats have no place for: use static")
        if s.act_order not in ACT_ORDERS:
            raise UserInputError(f"--act-order {s.act_order!r}: use one of {', '.join(ACT_ORDERS)}")
        if s.act_order == "group" and s.format == "compressed-tensors":   # refused here, before calibration
            raise UserInputError("--act-order group needs a g_idx, which --format compressed-tensors has no place "
                                 "for: use --format gptq, or --act-order static")
        if s.format == "gguf" and s.method not in ("awq", "gptq", "rtn", "mxfp4"):
            raise UserInputError(f"--format gguf holds integer groups (awq, gptq, rtn) and mxfp4, "
                                 f"not --method {s.method}")
        if s.format == "bitsandbytes" and s.method != "nf4":
            raise UserInputError(f"--format bitsandbytes holds --method nf4, not --method {s.method}")
        if s.method == "awq" and s.format == "gptq":   # refused here, before calibration
            raise UserInputError("--method awq is written as --format awq (AutoAWQ GEMM) or compressed-tensors: GPTQ v1 "
                                 "stores zero points minus one, so AWQ's zero point 0 has no place there")
        if s.format == "awq" and (s.bits != 4 or s.sym or s.group_size == -1 or s.act_order == "group"):
            raise UserInputError("--format awq (AutoAWQ GEMM) holds 4-bit asymmetric weights with groups: "
                                 "use --bits 4 --asym --group-size 128|64|32, or --format gptq|compressed-tensors")
        if s.group_size is not None and s.group_size != -1 and s.group_size <= 0:
            raise UserInputError(f"--group-size {s.group_size}: use a positive divisor of the hidden size or -1")
        if s.method in ("fp8", "int8"):
            s.group_size = None          # per-channel (or per-tensor) scales: no groups
        if not 1 <= s.num_samples <= defaults.QUANT_MAX_NUM_SAMPLES:
            raise UserInputError(f"--num-samples {s.num_samples}: use 1 to {defaults.QUANT_MAX_NUM_SAMPLES:,} "
                                 "calibration windows")
        if not SEED_MIN <= s.seed <= SEED_MAX:
            raise UserInputError(f"--seed {s.seed} does not fit in 64 bits: use {SEED_MIN} to {SEED_MAX}")
        if not 0 < s.damp < 1:
            raise UserInputError(f"--damp {s.damp}: use a fraction of the mean Hessian diagonal in (0, 1)")
        if not 0 <= s.smoothquant_alpha <= 1:
            raise UserInputError(f"--smoothquant-alpha {s.smoothquant_alpha}: use a value in [0, 1]")
        if s.fp8_scale not in ("channel", "tensor"):
            raise UserInputError(f"--fp8-scale {s.fp8_scale!r}: use channel or tensor")
        if s.activations not in ("dynamic", "none"):
            raise UserInputError(f"--activations {s.activations!r}: use dynamic (W8A8, W4A4) or none (weight-only)")
        if s.seq_len < 2:
            raise UserInputError(f"--seq-len {s.seq_len}: use at least 2 tokens per calibration window")
        return s

    @property
    def needs_calibration(self) -> bool:
        """Whether the method looks at activations beyond the error report."""
        return (self.method in ("awq", "gptq") or (self.method in ("int8", "nvfp4") and self.activations == "dynamic")
                or self.fp4_algorithm == "gptq")


def _resolve_fp4(s: QuantConfig) -> None:
    """nvfp4 / mxfp4 / nf4: 4-bit symmetric float codes in the formats that hold them, weight-only by
    default; nvfp4 and mxfp4 with --activations dynamic quantize the activations to FP4 too (W4A4,
    compressed-tensors' NVFP4 / MXFP4 schemes); the block size is the format's (nf4: --group-size,
    default 64); fills in the defaults."""
    m = s.method
    if s.bits not in (None, 4):
        raise UserInputError(f"--method {m} is 4-bit: drop --bits or use --bits 4")
    if s.sym is False:
        raise UserInputError(f"--method {m} is symmetric (float codes, no zero points): drop --asym")
    fmt = s.format or DEFAULT_FORMAT[m]
    if fmt in FORMATS and fmt not in FP4_METHODS[m]:
        raise UserInputError(f"--method {m} is written as --format {' or '.join(FP4_METHODS[m])}, not {fmt}")
    if s.activations == "dynamic" and m not in FP4_BLOCKS:
        raise UserInputError(f"--method {m} quantizes weights only (bitsandbytes has no activation quantization): "
                             "drop --activations or use none")
    if s.activations == "dynamic" and fmt == "gguf":
        raise UserInputError("--format gguf holds MXFP4 weights only: drop --activations or use --format "
                             "compressed-tensors (W4A4)")
    if m in FP4_BLOCKS:
        if s.group_size not in (None, FP4_BLOCKS[m]):
            raise UserInputError(f"--method {m} has blocks of {FP4_BLOCKS[m]} by definition: drop --group-size")
        s.group_size = FP4_BLOCKS[m]
        s.fp4_algorithm = s.fp4_algorithm or "rtn"
        if s.fp4_algorithm not in FP4_ALGORITHMS:
            raise UserInputError(f"--fp4-algorithm {s.fp4_algorithm!r}: use {' or '.join(FP4_ALGORITHMS)}")
    else:
        if s.fp4_algorithm is not None:
            raise UserInputError("--fp4-algorithm applies to --method nvfp4 and mxfp4 (nf4 is bitsandbytes' "
                                 "round to nearest)")
        s.group_size = defaults.NF4_BLOCK if s.group_size is None else s.group_size
    s.bits, s.sym, s.activations = 4, True, s.activations or "none"


@dataclass
class QuantJob:
    """A quantize run with every source merged: what to quantize, where to, and how."""
    qconfig: QuantConfig
    model: str | None      # None: the default model
    output: str


JOB_KEYS = ("model", "output")


def _field_types() -> dict[str, tuple[type, ...]]:
    """Accepted Python types per recipe key, read from QuantConfig's annotations ('int | None')."""
    names = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,), "None": (type(None),)}
    out = {}
    for f in fields(QuantConfig):
        parts = [t.strip() for t in str(f.type).split("|")]
        if all(t in names for t in parts):
            out[f.name] = tuple(x for t in parts for x in names[t])
    return {**out, "model": (str,), "output": (str,)}


def merge_sources(recipe: str | Path | None = None, flags: dict | None = None) -> QuantJob:
    """Merge a YAML recipe and command-line flags into a QuantJob: flags (None = not given) override
    recipe keys, which override QuantConfig's defaults. Keys are QuantConfig fields plus model and output;
    unknown keys and values of the wrong type are refused."""
    types = _field_types()

    def check(where: str, k: str, v) -> None:
        ok = types.get(k)
        if ok and (not isinstance(v, ok) or (isinstance(v, bool) and bool not in ok)):
            want = " or ".join(t.__name__ for t in ok if t is not type(None))
            raise UserInputError(f"{where}: {k.replace('_', '-')} must be {want}, got {v!r}")

    settings = load_recipe(recipe) if recipe else {}
    for k, v in settings.items():
        check(f"recipe {recipe}", k, v)
    known = {f.name for f in fields(QuantConfig)} | set(JOB_KEYS)
    for k, v in (flags or {}).items():
        if k not in known:
            raise UserInputError(f"unknown quantize setting {k!r} (known: {', '.join(sorted(known))})")
        if v is not None:
            check("flags", k, v)
            settings[k] = v
    model = settings.pop("model", None)
    output = settings.pop("output", None)
    if not output:
        raise UserInputError("--output is required (or `output:` in the recipe)")
    return QuantJob(qconfig=QuantConfig(**settings), model=model, output=str(output))


def load_recipe(path: str | Path) -> dict:
    """A YAML recipe whose keys mirror the CLI flags (dashes or underscores)."""
    import yaml
    p = Path(path)
    if not p.is_file():
        raise UserInputError(f"recipe {p} not found")
    text = decode_utf8(p.read_bytes(), f"recipe {p}")
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        what = getattr(e, "problem", None) or str(e)
        raise UserInputError(f"recipe {p} is not valid YAML: {what}{where}") from None
    if not isinstance(data, dict):
        raise UserInputError(f"recipe {p} must be a mapping of flag names to values")
    known = {f.name for f in fields(QuantConfig)} | {"model", "output"}
    out = {}
    for k, v in data.items():
        key = str(k).replace("-", "_")
        if key == "quant_method":
            key = "method"
        if key not in known:
            raise UserInputError(f"recipe {p}: unknown key {k!r} (known: {', '.join(sorted(known))})")
        out[key] = v
    return out
