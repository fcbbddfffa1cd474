"""Offline throughput of the llmopt engine against transformers, all in one run.

Workload: N prompts (default 64) of 32-256 tokens cut from wikitext-2, each with max_tokens drawn
from 16-256, ignore_eos, fixed seed, float32, greedy. Peers:
  (a) transformers `generate`, one request at a time (what a FastAPI wrapper around it does);
  (b) transformers batched `generate` with left padding, batches of 16 in arrival order (each batch
      runs to its longest request; only the tokens each request asked for are counted).
Prints output tokens/s, the ratios, and the peak resident memory of each phase (GPU: peak allocated).

    python scripts/bench_engine.py                       # the full configuration
    python scripts/bench_engine.py --max-output 128 --single-prompts 8 --threads 1   # a smaller one
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"


class PeakMemory:
    """Peak RSS of this process (sampled) during a `with` block; on CUDA, peak allocated bytes."""

    def __init__(self, device: torch.device):
        self.device, self.peak, self._stop = device, 0, threading.Event()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _watch(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak = self._rss()
            self._t = threading.Thread(target=self._watch, daemon=True)
            self._t.start()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._t.join()
            self.peak = max(self.peak, self._rss())


def workload(tokenizer, n: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int):
    rng = random.Random(seed)
    ids = tokenizer(DATA.read_text(encoding="utf-8")[:400_000]).input_ids
    prompts, outs = [], []
    for _ in range(n):
        length = rng.randint(min_in, max_in)
        start = rng.randrange(0, len(ids) - length)
        prompts.append(ids[start:start + length])
        outs.append(rng.randint(min_out, max_out))
    return prompts, outs


def bench_engine(loaded, prompts, outs, args):
    from llmopt import LLM, SamplingParams
    llm = LLM(loaded=loaded, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, seed=args.seed)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in outs]
    llm.generate(prompts[:2], [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)] * 2)  # warm-up
    with PeakMemory(loaded.device) as mem:
        t = time.perf_counter()
        res = llm.generate(prompts, params)
        dt = time.perf_counter() - t
    n = sum(len(r.outputs[0].token_ids) for r in res)
    assert n == sum(outs)
    return n / dt, dt, mem.peak, [r.outputs[0].token_ids for r in res]


def bench_hf_single(hf, prompts, outs, device):
    with PeakMemory(device) as mem, torch.no_grad():
        t = time.perf_counter()
        res = []
        for p, m in zip(prompts, outs):
            ids = torch.tensor([p], device=device)
            g = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, do_sample=False,
                            eos_token_id=-1, pad_token_id=0)
            res.append(g[0, len(p):].tolist())
        dt = time.perf_counter() - t
    return sum(outs) / dt, dt, mem.peak, res


def hf_generate_left_padded(hf, prompts, outs, device, batch: int) -> None:
    """transformers' batched greedy `generate`, left-padded batches of `batch`; each batch runs to
    its longest request (also used by gpu_check_engine.py)."""
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, ms = prompts[i:i + batch], outs[i:i + batch]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
            hf.generate(ids, attention_mask=mask, max_new_tokens=max(ms), do_sample=False, eos_token_id=-1,
                        pad_token_id=0)


def bench_hf_batched(hf, prompts, outs, device, batch: int):
    with PeakMemory(device) as mem:
        t = time.perf_counter()
        hf_generate_left_padded(hf, prompts, outs, device, batch)
        dt = time.perf_counter() - t
    return sum(outs) / dt, dt, mem.peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input", type=int, default=32)
    ap.add_argument("--max-input", type=int, default=256)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-memory", type=int, default=768 << 20)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for every phase (default: torch's)")
    ap.add_argument("--single-prompts", type=int, default=None,
                    help="run peer (a), the slowest phase, on only the first N prompts (its tok/s is a rate)")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM
    from llmopt.models.loader import load_model
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, "float32", args.device)
    prompts, outs = workload(loaded.tokenizer, args.num_prompts, args.seed, args.min_input, args.max_input,
                             args.min_output, args.max_output)
    print(f"workload: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {sum(outs)} output tokens, "
          f"torch threads {torch.get_num_threads()}, device {loaded.device}", flush=True)
    tps, dt, peak, ours = bench_engine(loaded, prompts, outs, args)
    print(f"llmopt engine:            {tps:8.1f} tok/s  {dt:7.1f} s  peak {peak / 2**20:7.0f} MiB", flush=True)
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).to(loaded.device).eval()
    b_tps, b_dt, b_peak = bench_hf_batched(hf, prompts, outs, loaded.device, args.hf_batch)
    print(f"transformers batched-{args.hf_batch}:  {b_tps:8.1f} tok/s  {b_dt:7.1f} s  peak {b_peak / 2**20:7.0f} MiB",
          flush=True)
    rows = [("llmopt engine", tps, dt, peak), (f"transformers batched-{args.hf_batch}", b_tps, b_dt, b_peak)]
    k = args.single_prompts or len(prompts)
    a_tps, a_dt, a_peak, theirs = bench_hf_single(hf, prompts[:k], outs[:k], loaded.device)
    same = sum(x == y for x, y in zip(ours, theirs))
    name = "transformers one-at-a-time" + (f" (first {k} prompts)" if k < len(prompts) else "")
    print(f"{name}: {a_tps:6.1f} tok/s  {a_dt:7.1f} s  peak {a_peak / 2**20:7.0f} MiB  "
          f"({same}/{k} outputs token-identical to the engine's)", flush=True)
    rows.append((name, a_tps, a_dt, a_peak))
    print("\n| system | output tok/s | wall s | peak memory MiB | engine speed-up |")
    print("|---|---:|---:|---:|---:|")
    for name, t, d, p in rows:
        print(f"| {name} | {t:.1f} | {d:.1f} | {p / 2**20:.0f} | {tps / t:.2f}x |")


if __name__ == "__main__":
    main()
