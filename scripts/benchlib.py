"""Helpers shared by the scripts in this folder (not part of the llmopt package).

`python scripts/NAME.py` puts scripts/ on sys.path, so a script imports this module as `benchlib`.

- `paged_batch()`: tests/paged_batch.py (random paged-attention batches: the kernel tests' tool), loaded
  from its file for gpu_check.py and bench_kernels.py without putting tests/ on sys.path;
- `hf_generate_left_padded`, `hf_generate_single`: transformers' `generate` as the peers of the engine
  (bench_decode.py --transformers, gpu_check_engine.py);
- `median_seconds`: the median wall time of a call (CUDA events on a GPU);
- `hf_folder`: a Hugging Face folder with weights for a model name, for the peers that load one
  (transformers, lm-eval's `hf`, llm-compressor): a GGUF (the built-in default) dequantized into
  `workdir`, since llmopt runs the file as stored and caches no float copy.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def paged_batch():
    """The module tests/paged_batch.py (make_batch, empty_cache, run_paged, dense_attention)."""
    if "paged_batch" in sys.modules:          # under pytest, tests/ is on the path and it is already imported
        return sys.modules["paged_batch"]
    spec = importlib.util.spec_from_file_location("paged_batch", ROOT / "tests" / "paged_batch.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["paged_batch"] = mod           # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def hf_generate_left_padded(hf, prompts: list[list[int]], outs: list[int], device, batch: int) -> None:
    """transformers' batched greedy `generate`, left-padded batches of `batch` in arrival order; each batch
    runs to its longest request (only the tokens each request asked for are counted by the callers)."""
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, ms = prompts[i:i + batch], outs[i:i + batch]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(ms), do_sample=False, eos_token_id=-1,
                        pad_token_id=0)


def hf_generate_single(hf, prompts: list[list[int]], outs: list[int], device) -> list[list[int]]:
    """transformers' greedy `generate`, one request at a time (what a web wrapper around it does); the
    generated ids of each."""
    res = []
    with torch.no_grad():
        for p, m in zip(prompts, outs):
            ids = torch.tensor([p], device=device)
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                            eos_token_id=-1, pad_token_id=0)
            res.append(g[0, len(p):].tolist())
    return res


def median_seconds(fn, dev=None, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over `iters` calls after `warmup` (CUDA events on a CUDA device)."""
    for _ in range(warmup):
        fn()
    cuda = dev is not None and torch.device(dev).type == "cuda"
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def hf_folder(model: str | None, workdir: str | Path) -> Path:
    """The checkpoint folder of `model`, or for a GGUF its float32 copy written once under `workdir`."""
    from llmopt.models.gguf_convert import cache_problem, convert_gguf
    from llmopt.models.loader import resolve
    ckpt = resolve(model)
    if ckpt.gguf is None:
        return ckpt.folder
    out = Path(workdir) / f"{ckpt.gguf.stem}-float32"
    if out.exists() and cache_problem(out) is None:
        return out
    return convert_gguf(ckpt.gguf, out, weights=True)
