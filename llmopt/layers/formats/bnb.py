"""bitsandbytes 4-bit weights (transformers' `load_in_4bit`, NF4 or FP4), as transformers saves a
bitsandbytes Linear4bit, and the config.json entry that says so; llmopt.quant.formats.bnb writes them.

A Linear's weight W [out, in] is quantized as one flat vector w = W.flatten() (row-major, n = out*in
values) in blocks of B (`blocksize`, 64 by default) consecutive values, nb = ceil(n / B) blocks.
Tensors under the module's prefix (`{prefix}.weight`, `{prefix}.weight.absmax`, ...):

- `weight`: [ceil(n / 2) bytes] held as `bnb_4bit_quant_storage` ([ceil(n / 2), 1] uint8 by default):
  two 4-bit codes a byte, w[2i] in the HIGH nibble, w[2i + 1] in the low one (an odd n pads a 0).
- `weight.quant_map`: float32 [16], code -> value in [-1, 1] (bitsandbytes' nf4 or fp4 table).
- `weight.absmax`: float32 [nb], each block's absmax; double quantized (`bnb_4bit_use_double_quant`)
  uint8 [nb] instead, codes into `weight.nested_quant_map` (float32 [256], bitsandbytes' signed 8-bit
  dynamic map) scaled per `nested_blocksize` (256) blocks by `weight.nested_absmax` (float32
  [ceil(nb / 256)]), plus `nested_offset` (the mean of the absmax vector, subtracted before).
- `weight.quant_state.bitsandbytes__{nf4|fp4}`: uint8 [len], the UTF-8 JSON of the other fields:
  {"quant_type", "blocksize", "dtype", "shape": [out, in]} and, double quantized, {"nested_blocksize",
  "nested_dtype": "float32", "nested_offset"} (bitsandbytes' QuantState.as_dict(packed=True)).

bitsandbytes dequantizes (functional.dequantize_4bit) in float32:
  scale[b] = absmax[b], or nested_quant_map[absmax[b]] * nested_absmax[b // 256] + nested_offset,
  w[j]     = quant_map[code[j]] * scale[j // B], then cast to the state's `dtype`.
The runtime keeps the float32 products (never that last cast), so it needs `in % B == 0`: each
block then lies in one row, and the Fp4Quantized form (codes [out, in], scales [out, in / B]) holds
the weight exactly. `bnb_4bit_compute_dtype` is not read: the runtime computes in `--dtype`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import torch

from llmopt.errors import ModelLoadError
from llmopt.layers.formats.fp4 import Fp4Quantized, table

QUANT_TYPES = {"nf4": "nf4", "fp4": "bnb_fp4"}     # bitsandbytes' quant_type -> fp4.TABLES name
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)   # what bitsandbytes' quantize_4bit accepts
NESTED_BLOCKSIZE = 256                                    # quantize_4bit's blocks of the absmax vector
STORAGES = ("uint8", "int8", "float16", "bfloat16", "float32", "float64")   # transformers' quant_storage
_DTYPES = ("float16", "bfloat16", "float32")             # what dequantize_4bit returns
_STATE_KEYS = {"quant_type", "blocksize", "dtype", "shape", "nested_blocksize", "nested_dtype", "nested_offset"}
_STATE_PREFIX = "weight.quant_state.bitsandbytes__"
_NESTED = ("weight.nested_absmax", "weight.nested_quant_map")


@dataclass
class BnbQuantized:
    """One Linear's weight as bitsandbytes stores it (module docstring).

    weight:    uint8 [ceil(n / 2), 1], two codes a byte, w[2i] in the high nibble.
    absmax:    float32 [nb], or uint8 [nb] codes into nested_quant_map when double quantized.
    quant_map: float32 [16]; quant_type "nf4" | "fp4"; blocksize B; shape (out, in); dtype: the
               float dtype bitsandbytes dequantizes to (quant_state's `dtype`).
    nested_*:  double quantization only: nested_absmax float32 [ceil(nb / nested_blocksize)],
               nested_quant_map float32 [256], nested_offset (a float32 value).
    """

    weight: torch.Tensor
    absmax: torch.Tensor
    quant_map: torch.Tensor
    quant_type: str
    blocksize: int
    shape: tuple[int, int]
    dtype: torch.dtype
    nested_absmax: torch.Tensor | None = None
    nested_quant_map: torch.Tensor | None = None
    nested_offset: float | None = None
    nested_blocksize: int = NESTED_BLOCKSIZE
    bias: torch.Tensor | None = None

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def table_name(self) -> str:
        return QUANT_TYPES[self.quant_type]

    def scales(self) -> torch.Tensor:
        """float32 [nb]: each block's scale as bitsandbytes computes it (module docstring)."""
        if not self.double_quant:
            return self.absmax.to(torch.float32)
        nb = self.absmax.numel()
        nested = self.nested_absmax.to(torch.float32)[:, None].expand(-1, self.nested_blocksize).reshape(-1)[:nb]
        # (index_select: a tensor index took 100x longer on a busy 2-core CPU)
        values = self.nested_quant_map.to(torch.float32).index_select(0, self.absmax.long())
        return values * nested + _f32(self.nested_offset)

    def codes(self) -> torch.Tensor:
        """uint8 [out, in]: the code of each weight."""
        packed = self.weight.reshape(-1)
        if packed.device.type == "cpu":   # numpy's uint8 shifts: 20x torch's on the CPU (44 ms for a 576x1536 weight)
            a = packed.contiguous().numpy()
            pairs = np.empty((a.size, 2), dtype=np.uint8)
            np.right_shift(a, 4, out=pairs[:, 0])
            np.bitwise_and(a, 0xF, out=pairs[:, 1])
            flat = torch.from_numpy(pairs.reshape(-1))
        else:
            flat = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1)
        return flat[: self.shape[0] * self.shape[1]].reshape(self.shape)

    def as_fp4(self) -> Fp4Quantized:
        """The canonical form: the same float32 values bitsandbytes computes before its cast to dtype."""
        out, n_in = self.shape
        if n_in % self.blocksize:
            raise ModelLoadError(f"bitsandbytes blocks of {self.blocksize} span rows of a weight of {n_in} columns: "
                                 "llmopt runs bitsandbytes checkpoints whose in_features divide by the blocksize")
        if not torch.equal(self.quant_map.to(torch.float32), table(self.table_name)):
            raise ModelLoadError(f"the bitsandbytes quant_map is not the {self.quant_type} table: custom maps are "
                                 "not supported")
        scales = self.scales().reshape(out, n_in // self.blocksize)
        return Fp4Quantized(self.codes(), scales, self.table_name, self.blocksize, self.bias)

    def state(self) -> dict:
        """The non-tensor fields, in QuantState.as_dict's order (packed as the quant_state tensor)."""
        st = {"quant_type": self.quant_type, "blocksize": self.blocksize, "dtype": _dtype_name(self.dtype),
              "shape": list(self.shape)}
        if self.double_quant:
            st.update(nested_blocksize=self.nested_blocksize, nested_dtype="float32",
                      nested_offset=float(self.nested_offset))
        return st


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(float(x), dtype=torch.float32)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- config.json's quantization_config ------------------------------------------------------------
@dataclass
class BnbConfig:
    """What the runtime takes from a bitsandbytes quantization_config."""

    quant_type: str                 # nf4 | fp4
    double_quant: bool
    storage: torch.dtype            # the dtype the packed `weight` tensor is held in
    skip_modules: list[str] | None  # llm_int8_skip_modules (None: transformers skips the output embedding)


def config_of(qcfg: dict) -> BnbConfig:
    """Parse and check a bitsandbytes quantization_config (transformers' BitsAndBytesConfig.to_dict)."""
    load_4bit = bool(qcfg.get("load_in_4bit", qcfg.get("_load_in_4bit", False)))
    if qcfg.get("load_in_8bit", qcfg.get("_load_in_8bit", False)):
        raise ModelLoadError("bitsandbytes 8-bit (load_in_8bit, LLM.int8) checkpoints are not supported: llmopt runs "
                             "load_in_4bit nf4 and fp4 ones")
    if not load_4bit:
        raise ModelLoadError("a bitsandbytes quantization_config without load_in_4bit is not supported: llmopt runs "
                             "load_in_4bit nf4 and fp4 checkpoints")
    quant_type = str(qcfg.get("bnb_4bit_quant_type", "fp4"))   # transformers' default
    if quant_type not in QUANT_TYPES:
        raise ModelLoadError(f"bnb_4bit_quant_type {quant_type!r} is not supported: use nf4 or fp4")
    storage = str(qcfg.get("bnb_4bit_quant_storage") or "uint8").removeprefix("torch.")
    if storage not in STORAGES:
        raise ModelLoadError(f"bnb_4bit_quant_storage {storage!r} is not supported: use one of {', '.join(STORAGES)}")
    skip = qcfg.get("llm_int8_skip_modules")
    if skip is not None and (not isinstance(skip, list) or not all(isinstance(s, str) for s in skip)):
        raise ModelLoadError(f"llm_int8_skip_modules must be a list of module names, got {skip!r}")
    for pattern in skip or []:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ModelLoadError(f"llm_int8_skip_modules entry {pattern!r} is not a regular expression ({e})") from None
    return BnbConfig(quant_type, bool(qcfg.get("bnb_4bit_use_double_quant", False)), getattr(torch, storage), skip)


def converts(name: str, cfg: BnbConfig) -> bool:
    """Whether transformers makes Linear `name` a Linear4bit: not the LM head when llm_int8_skip_modules
    is null, else not a name that a listed pattern matches from its start up to a module boundary
    (as a regex: `layers.1` matches `layers.1.mlp`, not `layers.11.mlp`) or ends with."""
    if cfg.skip_modules is None:
        return name != "lm_head"
    for pattern in cfg.skip_modules:
        if name.endswith(pattern) or re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", name):
            return False
    return True


# -- reading one Linear's tensors ---------------------------------------------------------------
def unpack(tensors: dict[str, torch.Tensor]) -> BnbQuantized:
    """A module's tensors, by local name (`weight`, `weight.absmax`, ..., `bias`) -> BnbQuantized."""
    states = [k for k in tensors if k.startswith(_STATE_PREFIX)]
    if len(states) != 1:
        raise ModelLoadError(f"a bitsandbytes Linear needs one {_STATE_PREFIX}nf4|fp4 tensor, found {states or 'none'}")
    st = state_of(tensors[states[0]])
    if st["quant_type"] != states[0].removeprefix(_STATE_PREFIX):
        raise ModelLoadError(f"{states[0]} holds quant_type {st['quant_type']!r}")
    nested = "nested_offset" in st
    for key in ("weight", "weight.absmax", "weight.quant_map") + (_NESTED if nested else ()):
        if key not in tensors:
            raise ModelLoadError(f"the bitsandbytes Linear lacks its {key!r} tensor")
    q = BnbQuantized(weight=tensors["weight"].contiguous().view(torch.uint8).reshape(-1, 1),
                     absmax=tensors["weight.absmax"], quant_map=tensors["weight.quant_map"],
                     quant_type=st["quant_type"], blocksize=st["blocksize"], shape=st["shape"],
                     dtype=getattr(torch, st["dtype"]),
                     nested_absmax=tensors["weight.nested_absmax"] if nested else None,
                     nested_quant_map=tensors["weight.nested_quant_map"] if nested else None,
                     nested_offset=st.get("nested_offset"), nested_blocksize=st.get("nested_blocksize", 256),
                     bias=tensors.get("bias"))
    _check(q, tensors)
    return q


def state_of(t: torch.Tensor) -> dict:
    """The quant_state tensor's JSON, checked (keys, types, values)."""
    try:
        st = json.loads(bytes(t.to(torch.uint8).reshape(-1).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"the bitsandbytes quant_state is not JSON ({e})") from None
    if not isinstance(st, dict) or not _STATE_KEYS >= set(st) or not {"quant_type", "blocksize", "dtype"} <= set(st):
        raise ModelLoadError(f"the bitsandbytes quant_state has keys {sorted(st) if isinstance(st, dict) else st}")
    if st["quant_type"] not in QUANT_TYPES or st["blocksize"] not in BLOCKSIZES or st["dtype"] not in _DTYPES:
        raise ModelLoadError(f"bitsandbytes quant_state {st}: quant_type nf4|fp4, blocksize one of {BLOCKSIZES} "
                             f"and dtype one of {', '.join(_DTYPES)} are supported")
    shape = st.get("shape")
    if not isinstance(shape, list) or len(shape) != 2 or not all(isinstance(d, int) and d > 0 for d in shape):
        raise ModelLoadError(f"the bitsandbytes quant_state's shape {shape!r} is not a Linear's [out, in]")
    st["shape"] = tuple(shape)
    nested = {"nested_blocksize", "nested_dtype", "nested_offset"} & set(st)
    if nested and (len(nested) != 3 or st["nested_dtype"] != "float32" or st["nested_blocksize"] not in BLOCKSIZES
                   or not isinstance(st["nested_offset"], (int, float))):
        raise ModelLoadError(f"the bitsandbytes quant_state's double quantization {st} is not supported")
    return st


def _check(q: BnbQuantized, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor's shape and dtype against the state's shape and blocksizes."""
    n = q.shape[0] * q.shape[1]
    nb = -(-n // q.blocksize)
    want = {"weight": ((-(-n // 2), 1), torch.uint8), "weight.quant_map": ((16,), torch.float32)}
    if q.double_quant:
        want["weight.absmax"] = ((nb,), torch.uint8)
        want["weight.nested_absmax"] = ((-(-nb // q.nested_blocksize),), torch.float32)
        want["weight.nested_quant_map"] = ((256,), torch.float32)
    else:
        want["weight.absmax"] = ((nb,), torch.float32)
    extra = set(tensors) - set(want) - {"bias"} - {k for k in tensors if k.startswith(_STATE_PREFIX)}
    if extra:
        raise ModelLoadError(f"the bitsandbytes Linear has tensors {sorted(extra)} its quant_state does not use")
    got = {"weight": q.weight, **{k: tensors[k] for k in want if k != "weight"}}
    for key, (shape, dtype) in want.items():
        t = got[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ModelLoadError(f"bitsandbytes {key}: {t.dtype} {tuple(t.shape)}, expected {dtype} {shape} for a "
                                 f"{q.shape[0]}x{q.shape[1]} weight in blocks of {q.blocksize}")
