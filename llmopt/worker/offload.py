"""The bytes of the KV cache's second tier (the index is the scheduler's: llmopt/cache/offload.py).

A slot holds the block's 32-byte chained hash, then one block of every KV tensor the runner
allocated (each layer's K and V, and their scale tensors), side by side: `block_bytes` in all.
Host memory (`--kv-offload-bytes` alone) or a file mapped shared (`--kv-offload-dir`: the page
cache writes it back; the same path after a restart maps the same bytes). `save` clears the
slots' hashes, copies the pool blocks out and then writes the hashes, so a slot whose write did not
finish is never found; `load` copies slots back in; both with one indexed copy per tensor.
"""

from __future__ import annotations

import fcntl

import torch

from llmopt.errors import UserInputError

HASH_BYTES = 32   # a chained SHA-256 block hash (llmopt/cache/block_pool.py)


class OffloadStore:
    def __init__(self, tensors: list[torch.Tensor], num_slots: int, path: str | None = None) -> None:
        self.tensors = tensors
        self.widths = [t[0].numel() * t.element_size() for t in tensors]   # bytes of one block of each
        self.block_bytes = sum(self.widths)
        self.num_slots = num_slots
        self.path = path
        size = num_slots * (HASH_BYTES + self.block_bytes)
        self._lock = None
        if path is not None:   # one process a file: another one's saves would overwrite slots it indexes
            self._lock = open(path, "a+b")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                raise UserInputError(f"another process holds the KV offload file {path}: give this one another "
                                     "--kv-offload-dir") from None
        flat = torch.from_file(path, shared=True, size=size, dtype=torch.uint8) if path is not None else \
            torch.zeros(size, dtype=torch.uint8)
        rows = flat.view(num_slots, HASH_BYTES + self.block_bytes)
        self.hashes, self.data = rows[:, :HASH_BYTES], rows[:, HASH_BYTES:]
        self.found = self.restored() if path is not None else []   # what an earlier run left in the file

    def close(self) -> None:
        """Let another process use the file (the lock goes with the process anyway)."""
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def restored(self) -> list[tuple[bytes, int]]:
        """(hash, slot) of every slot holding a whole block (a disk tier's, from an earlier run)."""
        held = (self.hashes != 0).any(1).nonzero().flatten().tolist()
        return [(bytes(self.hashes[s].tolist()), s) for s in held]

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8).view(t.shape[0], -1)

    def save(self, saves: list[tuple[int, int, bytes]]) -> None:
        """(block id, slot, block hash): pool block -> tier slot."""
        if not saves:
            return
        blocks = torch.tensor([b for b, _, _ in saves], device=self.tensors[0].device)
        slots = torch.tensor([s for _, s, _ in saves])
        self.hashes.index_fill_(0, slots, 0)
        off = 0
        for t, w in zip(self.tensors, self.widths):
            self.data[:, off:off + w].index_copy_(0, slots, self._rows(t).index_select(0, blocks).cpu())
            off += w
        hashes = torch.frombuffer(bytearray(b"".join(h for _, _, h in saves)), dtype=torch.uint8)
        self.hashes.index_copy_(0, slots, hashes.view(len(saves), HASH_BYTES))

    def load(self, pairs: list[tuple[int, int]]) -> None:
        """(slot, block id): tier slot -> pool block."""
        if not pairs:
            return
        slots = torch.tensor([s for s, _ in pairs])
        blocks = torch.tensor([b for _, b in pairs], device=self.tensors[0].device)
        off = 0
        for t, w in zip(self.tensors, self.widths):
            self._rows(t).index_copy_(0, blocks, self.data[:, off:off + w].index_select(0, slots).to(t.device))
            off += w
