"""Built-in model and GPU presets for `llmopt kv-estimate`, each with the source of its numbers.

A model preset is the architecture part of the model's published Hugging Face `config.json`
(same keys), so a preset and a downloaded checkpoint go through the same parser. Presets are
addressable by their Hugging Face id (`meta-llama/Llama-3.1-70B`) or a short name
(`llama-3.1-70b`), case-insensitively. The model presets live in `model_presets.json`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmopt.errors import UserInputError

HF = "https://huggingface.co/{}/blob/main/config.json"


@dataclass(frozen=True)
class ModelPreset:
    hf_id: str
    short: str
    config: dict[str, Any]
    source: str = ""
    note: str = ""

    @property
    def url(self) -> str:
        return self.source or HF.format(self.hf_id)


def _load_model_presets() -> list[ModelPreset]:
    """The presets are data: `model_presets.json` beside this file, one object per model with its
    Hugging Face id, short name, note and the architecture keys of its config.json."""
    rows = json.loads((Path(__file__).with_name("model_presets.json")).read_text(encoding="utf-8"))
    return [ModelPreset(r["hf_id"], r["short"], r["config"], r.get("source", ""), r.get("note", "")) for r in rows]


MODEL_PRESETS: list[ModelPreset] = _load_model_presets()


def find_model_preset(name: str) -> ModelPreset | None:
    key = name.strip().lower()
    for p in MODEL_PRESETS:
        if key in (p.hf_id.lower(), p.short, p.hf_id.split("/")[-1].lower()):
            return p
    return None


@dataclass(frozen=True)
class GpuPreset:
    name: str
    memory_mib: int               # total memory as the driver reports it (nvidia-smi / cudaMemGetInfo)
    source: str
    aliases: tuple[str, ...] = field(default_factory=tuple)

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


_SMI = "nvidia-smi memory.total of an idle {} (what vLLM's gpu_memory_utilization multiplies)"
GPU_PRESETS: list[GpuPreset] = [
    GpuPreset("H100-80GB", 81559, _SMI.format("NVIDIA H100 80GB HBM3"), ("h100", "h100-sxm", "h800")),
    GpuPreset("H200", 143771, _SMI.format("NVIDIA H200 (141 GB HBM3e)"), ("h200-141gb",)),
    GpuPreset("A100-40GB", 40960, _SMI.format("NVIDIA A100-SXM4-40GB"), ("a100-40g",)),
    GpuPreset("A100-80GB", 81920, _SMI.format("NVIDIA A100-SXM4-80GB"), ("a100", "a100-80g")),
    GpuPreset("L40S", 46068, _SMI.format("NVIDIA L40S (48 GB GDDR6)"), ()),
    GpuPreset("L4", 23034, _SMI.format("NVIDIA L4 (24 GB GDDR6)"), ()),
    GpuPreset("RTX-4090", 24564, _SMI.format("NVIDIA GeForce RTX 4090 (24 GB GDDR6X)"), ("4090", "rtx4090")),
]


def find_gpu(name: str) -> GpuPreset:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    for g in GPU_PRESETS:
        if key == g.name.lower() or key in g.aliases:
            return g
    raise UserInputError(f"unknown --gpu {name!r}: use one of {', '.join(g.name for g in GPU_PRESETS)}, "
                         f"or give --gpu-memory GiB")
