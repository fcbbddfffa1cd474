"""bitsandbytes 4-bit from its definition (float64, no bitsandbytes), and tiny checkpoints written
with llmopt.quant.nf4 + llmopt.quant.formats.bnb: the references of tests/quant/test_bnb*.py."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from scipy.stats import norm

from llmopt.quant.formats.bnb import pack, quantization_config
from llmopt.quant.nf4 import quantize
from quant_util import LINEARS


def nf4_levels() -> torch.Tensor:
    """QLoRA's NormalFloat4: the N(0, 1) quantiles at 8 (positive) and 7 (negative) equal steps from
    0.9677083 towards 0.5 (exclusive), and 0, normalised by the largest; ascending, code = rank. The
    probabilities are float32 (bitsandbytes' create_normal_map takes them from a float32 linspace: the
    published values differ from exact float64 steps by up to 1e-4 near 0)."""
    def probs(n):
        return torch.linspace(0.9677083, 0.5, n + 1, dtype=torch.float32)[:-1].double().numpy()
    pos = norm.ppf(probs(8)).tolist()
    neg = (-norm.ppf(probs(7))).tolist()
    values = sorted(pos + neg + [0.0])
    return torch.tensor(values, dtype=torch.float64) / max(values)


def fp4_levels() -> torch.Tensor:
    """bitsandbytes' FP4, by bits: sign = bit 3, exponent field E = bits 2-1, mantissa M = bit 0;
    E = 0: M / 16 (subnormal), else (1 + M / 2) * 2 ** (4 - E); normalised by the largest (12)."""
    out = []
    for c in range(16):
        e, m = (c >> 1) & 3, c & 1
        v = m / 16 if e == 0 else (1 + m / 2) * 2.0 ** (4 - e)
        out.append(-v if c & 8 else v)
    return torch.tensor(out, dtype=torch.float64) / 12


def dynamic_levels() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic map: 0, 1 and, for e = 0..6, the midpoints of the 2**e equal
    steps of [0.1, 1], times 10**(e - 6), with both signs; ascending."""
    values = [0.0, 1.0]
    for e in range(7):
        k = 2 ** e
        for i in range(k):
            mid = (0.1 + 0.9 * i / k + 0.1 + 0.9 * (i + 1) / k) / 2 * 10.0 ** (e - 6)
            values += [mid, -mid]
    return torch.tensor(sorted(values), dtype=torch.float64)


LEVELS = {"nf4": nf4_levels, "fp4": fp4_levels}


def reference_dequantize(tensors: dict, prefix: str) -> torch.Tensor:
    """A Linear4bit's checkpoint tensors -> its weight, float64, read from the definitions alone."""
    w = tensors[f"{prefix}.weight"]
    (state_name,) = [k for k in tensors if k.startswith(f"{prefix}.weight.quant_state.bitsandbytes__")]
    state = json.loads(bytes(tensors[state_name].tolist()).decode())
    out, n_in = state["shape"]
    codes = []
    for byte in w.flatten().tolist():
        codes += [byte // 16, byte % 16]
    levels = LEVELS[state["quant_type"]]()
    values = levels[torch.tensor(codes[: out * n_in])]
    absmax = tensors[f"{prefix}.weight.absmax"]
    if "nested_offset" in state:
        nested = tensors[f"{prefix}.weight.nested_absmax"].double()
        blocks = torch.arange(absmax.numel()) // state["nested_blocksize"]
        absmax = dynamic_levels()[absmax.long()] * nested[blocks] + state["nested_offset"]
    scale = absmax.double()[torch.arange(out * n_in) // state["blocksize"]]
    return (values * scale).reshape(out, n_in)


def write_bnb(src: Path, dst: Path, quant_type: str, double_quant: bool, dtype: torch.dtype, block: int = 64,
              skip=(), compute_dtype: str = "float32") -> dict:
    """Every decoder Linear but `skip` quantized with quantize + pack; returns {module: Fp4Quantized}."""
    state, out, canon = load_file(str(src / "model.safetensors")), {}, {}
    for name, t in state.items():
        mod = name.removesuffix(".weight")
        if name.endswith(".weight") and mod.split(".", 3)[-1] in LINEARS and not any(s in mod for s in skip):
            q = quantize(t, block, quant_type, double_quant)
            canon[mod] = q.as_fp4()
            out.update(pack(mod, q, dtype))
        else:
            out[name] = t.to(dtype)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(quant_type, block, double_quant, compute_dtype)
    if skip:
        config["quantization_config"]["llm_int8_skip_modules"] = ["lm_head", *skip]
    config["torch_dtype"] = config["dtype"] = str(dtype).removeprefix("torch.")
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return canon
