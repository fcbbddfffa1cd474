"""CPU cost of the paged reference attention against transformers-style contiguous attention.

One decode step of one layer with SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head
dim 64, float32), N sequences with contexts drawn from [min, max], all in one run:
  - llmopt reference: write the new K/V into 16-token blocks (random block order), then varlen
    paged attention (gathers each sequence's blocks);
  - transformers-style: a padded contiguous [N, kv heads, L, D] cache extended by torch.cat, as
    DynamicCache does every step, then SDPA with a padding mask (peer (b) of bench_engine.py);
  - the SDPA alone on that contiguous cache (a floor: no cache update at all).

    python scripts/bench_kernels_cpu.py --threads 1
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/paged_batch.py

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from llmopt.kernels import reference as ref  # noqa: E402
from paged_batch import make_batch  # noqa: E402


def timed(fn, iters: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-context", type=int, default=32)
    ap.add_argument("--max-context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    hq, hkv, d, bs = 9, 3, 64, 16
    rng = random.Random(0)
    lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.seqs)]
    b = make_batch([(n, 1) for n in lens], hq, hkv, d, bs, garbage="big", extra_blocks=0)
    b.key_cache[b.key_cache.abs() > 1e3] = 0  # zero-initialized, as the engine allocates
    b.value_cache[b.value_cache.abs() > 1e3] = 0
    newest = torch.cumsum(torch.tensor(lens), 0) - 1  # each sequence's decode token
    k_new, v_new, slots = b.k_new[newest], b.v_new[newest], b.slot_mapping[newest]
    scale = d ** -0.5

    def paged():
        ref.write_kv(b.key_cache, b.value_cache, k_new, v_new, slots, "auto", 1.0, 1.0)
        return ref.paged_attention(b.q, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                   scale, None, "auto", 1.0, 1.0)

    # contiguous, left-padded cache of the previous tokens, as transformers keeps it
    width = max(lens) - 1
    kc = torch.zeros(args.seqs, hkv, width, d)
    vc = torch.zeros_like(kc)
    mask = torch.zeros(args.seqs, width + 1, dtype=torch.bool)
    for s, (n, k, v) in enumerate(zip(lens, b.k_new.split(lens), b.v_new.split(lens))):
        kc[s, :, width - (n - 1):] = k[:-1].transpose(0, 1)
        vc[s, :, width - (n - 1):] = v[:-1].transpose(0, 1)
        mask[s, width - (n - 1):] = True
    q = b.q.view(args.seqs, hq, 1, d)

    def contiguous_cat():
        k = torch.cat([kc, k_new[:, :, None]], dim=2)
        v = torch.cat([vc, v_new[:, :, None]], dim=2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None], scale=scale, enable_gqa=True)

    kfull = torch.cat([kc, k_new[:, :, None]], dim=2)
    vfull = torch.cat([vc, v_new[:, :, None]], dim=2)

    def sdpa_only():
        return F.scaled_dot_product_attention(q, kfull, vfull, attn_mask=mask[:, None, None], scale=scale,
                                              enable_gqa=True)

    want = sdpa_only().view(args.seqs, hq, d)
    assert torch.allclose(paged(), want, atol=1e-5), "paged reference disagrees with dense SDPA"
    t_p, t_c, t_s = (timed(f, args.iters) for f in (paged, contiguous_cat, sdpa_only))
    kv_mb = sum(lens) * hkv * d * 4 * 2 / 2**20
    print(f"{args.seqs} sequences, contexts {args.min_context}-{args.max_context} (K+V {kv_mb:.1f} MiB per layer), "
          f"torch threads {torch.get_num_threads()}")
    print("| path (one layer, one decode step) | ms | vs paged reference |")
    print("|---|---:|---:|")
    for name, t in (("llmopt paged reference (write_kv + paged_attention)", t_p),
                    ("transformers-style cat + SDPA", t_c), ("SDPA on a ready contiguous cache", t_s)):
        print(f"| {name} | {t * 1e3:.2f} | {t / t_p:.2f}x |")


if __name__ == "__main__":
    main()
