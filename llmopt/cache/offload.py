"""The KV cache's second tier: full prefix-cache blocks evicted from the pool are kept here, under
the same chained hashes, and copied back on a hit (LMCache's local CPU / disk backends, vLLM's
offloading connector).

`OffloadIndex` is the scheduler's side: which block hash sits in which slot of the tier, least
recently used first, and the transfers the next step must do before its forward:
- `saves` (block id, slot, hash): a cached block the pool just evicted for reuse, copied out
  before anything overwrites it;
- `loads` (slot, block id): a hit found here, copied into a fresh pool block before the forward.
A slot planned for a load this step is pinned: no save reuses it before the runner has read it.
The runner owns the bytes (llmopt/worker/offload.py: OffloadStore) and does saves, then loads.

A disk tier (--kv-offload-dir) is a file named after a digest of everything that decides a block's
bytes (model, dtype, block size, layout), locked by the one process using it; each slot carries its
block's hash, written after the block's bytes (and cleared before them), so a restart with the same
model rebuilds the index from the file and never trusts a slot whose write did not finish (a
process that dies; the page cache's write-back order after a power loss is not guaranteed);
another model gets another file.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from llmopt.cache.block_pool import BlockHash


@dataclass(frozen=True)
class TierHit:
    """A prefix block found in the tier, not in the pool: a fresh block is loaded with it."""
    block_hash: BlockHash
    slot: int


@dataclass
class OffloadStats:
    hit_tokens: int = 0      # prompt tokens found in the tier (not in the pool; KVCacheManager counts them)
    saved_bytes: int = 0     # bytes copied out of the pool into the tier
    loaded_bytes: int = 0    # bytes copied back into the pool


class OffloadIndex:
    def __init__(self, num_slots: int, block_bytes: int, restored: list[tuple[BlockHash, int]] = ()) -> None:
        """restored: (hash, slot) of the blocks a disk tier already holds."""
        self.num_slots, self.block_bytes = num_slots, block_bytes
        self._slots: OrderedDict[BlockHash, int] = OrderedDict((h, s) for h, s in restored)   # front: LRU
        taken = set(self._slots.values())
        self._free = [s for s in range(num_slots - 1, -1, -1) if s not in taken]
        self._pinned: set[int] = set()
        self.saves: list[tuple[int, int, BlockHash]] = []
        self.loads: list[tuple[int, int]] = []
        self.stats = OffloadStats()

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding this block, made the most recently used; None if absent."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def pin(self, slots) -> None:
        """Keep these slots from being reused by saves until the next `take_transfers`."""
        self._pinned.update(slots)

    def plan_load(self, slot: int, block_id: int) -> None:
        """Copy tier slot -> pool block before the next forward (the slot pinned until then)."""
        self._pinned.add(slot)
        self.loads.append((slot, block_id))
        self.stats.loaded_bytes += self.block_bytes

    def plan_save(self, block_id: int, block_hash: BlockHash) -> None:
        """An evicted cached block: keep it in the tier (evicting its least recently used unpinned
        slot when full). Nothing is planned when it is there already or every slot is pinned."""
        if block_hash in self._slots or self.num_slots == 0:
            return
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in self._pinned), None)
            if victim is None:
                return
            slot = self._slots.pop(victim)
        self._pinned.add(slot)    # written this step: not reused before the runner has saved it
        self._slots[block_hash] = slot
        self.saves.append((block_id, slot, block_hash))
        self.stats.saved_bytes += self.block_bytes

    def clear(self) -> None:
        """Forget every block (the prefix cache was reset: new weights, a cold start to measure)."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self.saves, self.loads = [], []

    def take_transfers(self) -> tuple[list[tuple[int, int, BlockHash]], list[tuple[int, int]]]:
        """(saves, loads) planned since the last call; their pins end (the runner does them next)."""
        out = (self.saves, self.loads)
        self.saves, self.loads, self._pinned = [], [], set()
        return out


def offload_path(directory: str, key: str) -> str:
    """The data file of a disk tier in `directory` for blocks of this key."""
    return os.path.join(directory, f"llmopt-kv-{key[:32]}.bin")
