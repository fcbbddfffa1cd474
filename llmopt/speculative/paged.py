"""A drafter's own paged KV cache and forward, over the target's block table (as vLLM does): the
draft's K/V for position p of a request lives in the same block and slot as the target's, in tensors
of its own, so the target's rollback of rejected tokens and its freeing on finish, abort and
preemption apply to the draft's cache too."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt import kernels


class DraftKVCache(kernels.PagedStep):
    """Per-layer K/V tensors [num_blocks, block_size, kv_heads, head_dim] of a draft model or head,
    and the attention context (`ctx(layer_idx, q, k, v, window)`) that writes and reads them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device, backend: str) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.key_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.value_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.scale = head_dim ** -0.5
        self.backend = backend
        self.device = device
        self.set_step(None, None, None, None)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.key_caches + self.value_caches)

    def __call__(self, layer_idx: int, q, k, v, window):
        kc, vc = self.key_caches[layer_idx], self.value_caches[layer_idx]
        self.write(kc, vc, k, v)
        return self.attend(q, kc, vc, self.scale, window)


@dataclass
class DraftBatch:
    """One draft forward's flattened inputs: ids and positions [N], each sequence's last row."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    last_rows: torch.Tensor


def prepare(cache: DraftKVCache, seqs: list[tuple[list[int], int, list[int]]]) -> DraftBatch:
    """seqs: (token ids, position of the first, block ids). Sets the cache's slot mapping, block
    tables, sequence lengths and query starts for the forward; returns the inputs."""
    bs, dev = cache.block_size, cache.device
    n_new = torch.tensor([len(t) for t, _, _ in seqs])
    starts = torch.tensor([s for _, s, _ in seqs])
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    torch.cumsum(n_new, 0, out=qsl[1:])
    seq_idx = torch.repeat_interleave(torch.arange(len(seqs)), n_new)
    positions = torch.arange(int(n_new.sum())) - qsl[:-1].long()[seq_idx] + starts[seq_idx]
    width = max(len(b) for _, _, b in seqs)
    tables = torch.tensor([b + [0] * (width - len(b)) for _, _, b in seqs], dtype=torch.int32)
    slots = tables[seq_idx, positions // bs].long() * bs + positions % bs
    cache.set_step(slots.to(dev), tables.to(dev), (starts + n_new).to(torch.int32).to(dev), qsl.to(dev))
    ids = torch.tensor([t for toks, _, _ in seqs for t in toks], dtype=torch.long, device=dev)
    return DraftBatch(ids, positions.to(dev), (qsl[1:].long() - 1).to(dev))
