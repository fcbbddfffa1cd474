"""16-bit checkpoints on the CPU and a 1.5B-class model: llmopt against llama.cpp's `llama-bench`, one run.

Models (written once under --workdir):
- `default`: the default model's weights (its Q4_1 file dequantized) as bfloat16 and float16
  safetensors folders, and the float16 one as an F16 GGUF (llmopt's GGUF writer) for llama-bench:
  the same values for every system. llmopt runs each folder with `--dtype auto` (held 16-bit) and
  the float16 one with `--dtype float32` too (what `auto` did before);
- `1.5b`: a synthetic SmolLM2-1.7B-shaped checkpoint (hidden 2048, 24 layers, 32 heads, MLP 8192,
  vocabulary 49152, tied; random float16 weights), a bfloat16 copy, its F16 GGUF, and its `llmopt
  quantize --method rtn --asym --format gguf` Q4_1 export (groups of 32); llama-bench and llmopt on
  the float model (llmopt: both folders) and on the export.

Each system alone on the machine, in its own process, alternating (scripts/bench_gguf.py's runs:
tg128 and pp512 tokens/s, the medians of 3; the peak resident memory; llmopt's weights held, load
time and resident rise while loading).

    scripts/peer_llamacpp.sh tools      # builds .venv-llamacpp/bin/llama-bench
    python scripts/bench_sizes.py [--models default,1.5b] [--rounds 1] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import llama_bench, llmopt   # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHAPE_1_5B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                  num_key_value_heads=32, head_dim=64, vocab_size=49152, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, rope_theta=130000.0, tie_word_embeddings=True, bos_token_id=1,
                  eos_token_id=2)
KV_1_5B = 1 << 30   # float32 KV: 384 KiB a token, 2,730 tokens (1,024 needed)


def float_copy(src: Path, out: Path, dtype: str) -> Path:
    """`src`'s config, tokenizer and weights, the weights cast to `dtype`."""
    import shutil
    import torch
    from safetensors.torch import load_file, save_file
    if (out / "model.safetensors").is_file():
        return out
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors*", "llmopt.json", ".*"))
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update({k: v.to(getattr(torch, dtype)) for k, v in load_file(str(f)).items()})
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": dtype}, indent=2))
    return out


def synthetic(out: Path) -> Path:
    """A float16 SmolLM2-1.7B-shaped folder with random weights and the default model's tokenizer."""
    import shutil
    import torch
    from safetensors.torch import save_file
    from llmopt.models.loader import resolve
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True)
    tok = resolve(None).folder
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, out / f)
    c = SHAPE_1_5B
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "torch_dtype": "float16", "hidden_act": "silu", **c}, indent=2))
    g = torch.Generator().manual_seed(0)
    h, d, i = c["hidden_size"], c["num_attention_heads"] * c["head_dim"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (d, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, d),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    save_file({n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g).mul_(0.02)).half()
               for n, s in shapes.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def f16_gguf(folder: Path, out: Path) -> Path:
    """The float16 folder as an F16 GGUF (llmopt's GGUF writer over a float work folder)."""
    from llmopt.models.config import ModelConfig
    from llmopt.quant.formats.gguf import write_file
    if out.is_file():
        return out
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        names = list(f.keys())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "model.safetensors"
                                                                                    for n in names}}))
    try:
        write_file(folder, out, ModelConfig.from_path(folder), folder, None, "F16")
    finally:
        (folder / "model.safetensors.index.json").unlink()
    return out


def q4_1_export(folder: Path, out: Path) -> Path:
    if not out.is_file():
        subprocess.run([sys.executable, "-m", "llmopt", "quantize", "--model", str(folder), "--method", "rtn",
                        "--group-size", "32", "--asym", "--format", "gguf", "-o", str(out)], check=True)
    return out


def summary(rows: list[dict]) -> None:
    """Per model and round, each llmopt row against the llama-bench row of the same weights (the F16
    file for float folders, the export for the export)."""
    for r in rows:
        if r["system"].startswith("llama-bench"):
            continue
        peer_name = "llama-bench Q4_1 export" if "Q4_1" in r["system"] else "llama-bench F16 GGUF"
        p = next(x for x in rows if x["system"] == peer_name and x["model"] == r["model"] and x["round"] == r["round"])
        print(f"{r['model']} round {r['round']}: {r['system']}: tg128 {r['tg128']:.1f} vs {p['tg128']:.1f} "
              f"({r['tg128'] / p['tg128']:.2f}x), pp512 {r['pp512']:.1f} vs {p['pp512']:.1f} "
              f"({r['pp512'] / p['pp512']:.2f}x); peak RSS {r['peak_rss'] / 1e6:.0f} vs {p['peak_rss'] / 1e6:.0f} MB; "
              f"weights held {r['weights_bytes'] / 1e6:.0f} MB, load {r['load_s']:.1f} s, "
              f"resident rise {r['load_rss_rise'] / 1e6:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="default,1.5b")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--workdir", default=str(ROOT / ".bench-sizes"))
    ap.add_argument("--llama-bench", default=str(ROOT / ".venv-llamacpp" / "bin" / "llama-bench"))
    a = ap.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    plans = []   # (model, [(label, thunk)])
    for model in [m.strip() for m in a.models.split(",") if m.strip()]:
        if model == "default":
            from benchlib import hf_folder
            f32 = hf_folder(None, work)
            bf16, f16 = float_copy(f32, work / "default-bf16", "bfloat16"), float_copy(f32, work / "default-f16", "float16")
            gg = f16_gguf(f16, work / "default-F16.gguf")
            runs = [("llama-bench F16 GGUF", lambda gg=gg: llama_bench(Path(a.llama_bench), gg, a.threads)),
                    ("llmopt bf16 folder, --dtype auto", lambda bf16=bf16: llmopt(bf16, a.threads, "float", "auto")),
                    ("llmopt f16 folder, --dtype auto", lambda f16=f16: llmopt(f16, a.threads, "float", "auto")),
                    ("llmopt f16 folder, --dtype float32", lambda f16=f16: llmopt(f16, a.threads, "float", "float32"))]
        elif model == "1.5b":
            f16 = synthetic(work / "synthetic-1.7b-f16")
            bf16 = float_copy(f16, work / "synthetic-1.7b-bf16", "bfloat16")
            gg, q4 = f16_gguf(f16, work / "synthetic-1.7b-F16.gguf"), q4_1_export(f16, work / "synthetic-1.7b-Q4_1.gguf")
            runs = [("llama-bench F16 GGUF", lambda gg=gg: llama_bench(Path(a.llama_bench), gg, a.threads)),
                    ("llmopt f16 folder, --dtype auto",
                     lambda f16=f16: llmopt(f16, a.threads, "float", "auto", kv_bytes=KV_1_5B)),
                    ("llmopt bf16 copy, --dtype auto",
                     lambda bf16=bf16: llmopt(bf16, a.threads, "float", "auto", kv_bytes=KV_1_5B)),
                    ("llama-bench Q4_1 export", lambda q4=q4: llama_bench(Path(a.llama_bench), q4, a.threads)),
                    ("llmopt Q4_1 export (float activations)",
                     lambda q4=q4: llmopt(q4, a.threads, "float", kv_bytes=KV_1_5B)),
                    ("llmopt Q4_1 export (int8 activations)",
                     lambda q4=q4: llmopt(q4, a.threads, "int8", kv_bytes=KV_1_5B))]
        else:
            raise SystemExit(f"unknown model {model!r}: default or 1.5b")
        plans.append((model, runs))
    rows = []
    for i in range(a.rounds):
        for model, runs in plans:
            for label, fn in runs:
                row = {"model": model, "round": i, "load_1min": os.getloadavg()[0], **fn(), "system": label}
                print(json.dumps(row), flush=True)
                rows.append(row)
    summary(rows)


if __name__ == "__main__":
    main()
