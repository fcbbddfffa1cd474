"""llm-compressor GPTQ W4 (group size G, symmetric) on the CPU: the measured peer
for `llmopt quantize --method gptq`.

Runs INSIDE .venv-llmc (built by scripts/peer_venv.sh); never imports llmopt.
The calibration windows come in as a torch.save'd int64 tensor [num_samples,
seq_len], the exact windows llmopt uses, so both tools see the same data.

    .venv-llmc/bin/python scripts/peer_llmcompressor.py --model HF_DIR \
        --calib-ids calib.pt --group-size 64 --output OUT_DIR

Prints one JSON line on stdout: {"seconds": oneshot wall time, "load_seconds",
"versions", "actorder", "num_samples", "seq_len", ...}. llm-compressor logs
to stdout (loguru); this script points fd 1 at stderr so stdout stays one line.

actorder: when left unset, GPTQModifier (llmcompressor 0.14) resolves its
sentinel default to "static" for group-strategy schemes ("none" turns it off,
"weight" is its other mode; its GPTQ rejects "group").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from importlib.metadata import version

import torch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face float checkpoint folder")
    p.add_argument("--calib-ids", required=True, help="torch.save'd int64 tensor [num_samples, seq_len]")
    p.add_argument("--group-size", type=int, default=64)
    # llmcompressor 0.14's GPTQ accepts only "static" and "weight" ("group" raises ValueError)
    p.add_argument("--actorder", choices=["none", "static", "weight"], default=None,
                   help="default: llm-compressor's own default (static in 0.14)")
    p.add_argument("--dampening-frac", type=float, default=0.01)
    p.add_argument("--output", required=True)
    p.add_argument("--threads", type=int, default=None)
    return p.parse_args()


def build_recipe(group_size: int, actorder: str | None, dampening_frac: float):
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor.modifiers.quantization import GPTQModifier

    # The W4A16 preset (int4, symmetric, group strategy) but with our group size
    # instead of its 128.
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group_size
    w = scheme.weights
    if (w.num_bits, w.symmetric, str(w.strategy)) != (4, True, "group"):
        raise SystemExit(f"unexpected W4A16 preset: {w}")
    kwargs = {}
    if actorder is not None:
        kwargs["actorder"] = None if actorder == "none" else actorder
    return GPTQModifier(config_groups={"group_0": scheme}, ignore=["lm_head"],
                        dampening_frac=dampening_frac, **kwargs)


def main() -> None:
    args = parse_args()
    result_out = os.fdopen(os.dup(1), "w")  # the real stdout, for the JSON line only
    sys.stdout.flush()
    os.dup2(2, 1)  # everything else written to stdout (llm-compressor's logger) goes to stderr
    if args.threads:
        torch.set_num_threads(args.threads)
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.load(args.calib_ids)
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise SystemExit(f"--calib-ids must hold an int64 [num_samples, seq_len] tensor, got {ids.dtype} {tuple(ids.shape)}")
    num_samples, seq_len = ids.shape
    rows = ids.tolist()
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * seq_len for _ in rows]})

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, device_map="cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    load_seconds = time.perf_counter() - t0

    recipe = build_recipe(args.group_size, args.actorder, args.dampening_frac)
    t0 = time.perf_counter()
    oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe,
            num_calibration_samples=num_samples, max_seq_length=seq_len,
            shuffle_calibration_samples=False)
    seconds = time.perf_counter() - t0

    t0 = time.perf_counter()
    model.save_pretrained(args.output, save_compressed=True)
    tokenizer.save_pretrained(args.output)
    save_seconds = time.perf_counter() - t0
    with open(f"{args.output}/config.json") as f:  # what was really applied
        weights = json.load(f)["quantization_config"]["config_groups"]["group_0"]["weights"]

    names = ["llmcompressor", "compressed-tensors", "transformers", "torch", "datasets"]
    print(json.dumps({
        "seconds": round(seconds, 3), "load_seconds": round(load_seconds, 3),
        "save_seconds": round(save_seconds, 3),
        "versions": {n: version(n) for n in names},
        "actorder": weights["actorder"], "group_size": weights["group_size"],
        "symmetric": weights["symmetric"], "num_bits": weights["num_bits"],
        "dampening_frac": args.dampening_frac,
        "num_samples": num_samples, "seq_len": seq_len,
        "threads": torch.get_num_threads(), "output": args.output,
    }), file=result_out, flush=True)


if __name__ == "__main__":
    sys.exit(main())
