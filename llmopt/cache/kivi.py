"""KIVI 2-bit KV cache (Liu et al. 2024, arXiv:2402.02750): the rules the engine and kv-estimate share.

KIVI quantizes keys per channel over groups of G tokens and values per token over groups of G
channels, 2 bits each with an fp16 scale and zero point (the group's minimum) per group, and keeps
the most recent R tokens in full precision. Here a block is one group of G tokens, so a block is
either quantized (a 2-bit page in the main pool, the only kind the prefix cache and the offload
tier hold) or residual (a full-precision block in a second, smaller pool). A request of L computed
tokens holds `quantized_blocks(L)` quantized blocks, the oldest, and the rest of its tokens
(R to R + G - 1 of them once L >= R) in residual blocks. A block is converted from residual to
quantized at the start of the step after the one that pushed it out of the last R tokens (KIVI
quantizes after the step's attention), so a step's attention reads its own new tokens, and the
R before them, in full precision.

Memory: both pools come out of one KV budget. The residual pool holds the residual of the requests
the budget admits at `max_model_len` (at most max_num_seqs of them) plus one step's new tokens; the
main pool takes the rest (`kivi_pools`). Layouts of the pages: llmopt/kernels/kivi.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmopt import defaults
from llmopt.cache.block_pool import BlockPool, KVBlock
from llmopt.cache.groups import cdiv
from llmopt.errors import UserInputError

FP16_BYTES = 2


def value_group(group_size: int, head_dim: int) -> int:
    """Channels per value group: G, or the whole head when it is narrower."""
    return min(group_size, head_dim)


def check_kivi(group_size: int, residual_length: int, head_dim: int) -> None:
    """One rule for the engine and kv-estimate: the sizes KIVI's layout can hold."""
    if group_size < 1 or group_size % 4:
        raise UserInputError(f"--kivi-group-size must be a positive multiple of 4, got {group_size}")
    if residual_length < 0 or residual_length % group_size:
        raise UserInputError(f"--kivi-residual-length must be a multiple of the group size {group_size}, "
                             f"got {residual_length}")
    if head_dim % 4:
        raise UserInputError(f"kivi2 packs 4 codes a byte: head_dim {head_dim} is not a multiple of 4")
    if head_dim % value_group(group_size, head_dim):
        raise UserInputError(f"kivi2 quantizes values in groups of {group_size} channels; head_dim {head_dim} "
                             f"is not a multiple of it")


def key_page_bytes(group_size: int, head_dim: int) -> int:
    """One KV head's quantized keys of one block: fp16 scale and zero per channel, then 2-bit codes."""
    return 2 * FP16_BYTES * head_dim + group_size * head_dim // 4


def value_page_bytes(group_size: int, head_dim: int) -> int:
    """One KV head's quantized values of one block: fp16 scale and zero per (token, channel group),
    then 2-bit codes."""
    groups = head_dim // value_group(group_size, head_dim)
    return 2 * FP16_BYTES * group_size * groups + group_size * head_dim // 4


def page_bytes(group_size: int, head_dim: int) -> int:
    """One KV head's pages of one block, keys and values."""
    return key_page_bytes(group_size, head_dim) + value_page_bytes(group_size, head_dim)


def check_kivi_model(windowed: bool, tensor_parallel_size: int) -> None:
    """What kivi2 does not run with (one rule for the engine and kv-estimate)."""
    if tensor_parallel_size > 1:
        raise UserInputError("kivi2 runs with --tensor-parallel-size 1 only")
    if windowed:
        raise UserInputError("kivi2 does not run sliding-window layers: pick another --kv-cache-dtype for this model")


def quantized_blocks(num_tokens: int, group_size: int, residual_length: int) -> int:
    """Blocks of a request of `num_tokens` computed tokens that KIVI holds quantized: the full groups
    before its last `residual_length` tokens."""
    return max(0, (num_tokens - residual_length) // group_size)


def request_blocks(length: int, group_size: int, residual_length: int) -> tuple[int, int]:
    """(quantized, residual) blocks a decoding request of up to `length` tokens holds at most: its
    quantized groups at the end, and R / G + 1 residual blocks (a step writes its token before the
    group that token pushes out of the window is converted, at the next step), fewer when shorter."""
    q = quantized_blocks(length, group_size, residual_length)
    return q, min(cdiv(length, group_size), residual_length // group_size + 1)


@dataclass(frozen=True)
class KiviPools:
    num_blocks: int             # quantized blocks (the main pool, prefix cache and offload tier)
    num_residual_blocks: int    # full-precision blocks
    planned_requests: int       # requests of max_model_len the pools hold at once


def kivi_pools(budget: int, block_bytes: int, residual_block_bytes: int, max_model_len: int, max_num_seqs: int,
               max_num_batched_tokens: int, group_size: int, residual_length: int) -> KiviPools:
    """Split one KV budget (bytes) into the two pools. block_bytes / residual_block_bytes: one block of
    every layer that uses it. The residual pool holds the residual of N requests of max_model_len, N the
    most the budget holds (at most max_num_seqs), and one step's new tokens; the main pool the rest."""
    q, r = request_blocks(max_model_len, group_size, residual_length)
    step = cdiv(min(max_num_batched_tokens, max_model_len), group_size) + 1   # a step writes at most a context
    per_request = q * block_bytes + r * residual_block_bytes
    n = min(max_num_seqs, (budget - step * residual_block_bytes) // per_request)
    if n < 1:
        need = per_request + step * residual_block_bytes
        raise UserInputError(f"{budget:,} bytes of KV cache cannot hold one kivi2 request of {max_model_len:,} tokens "
                             f"({need:,} bytes with its full-precision residual): raise --kv-cache-memory or lower "
                             f"--max-model-len")
    residual = n * r + step
    return KiviPools((budget - residual * residual_block_bytes) // block_bytes, residual, n)


def kivi_config(kv_cache_dtype: str, group_size: int, residual_length: int) -> "KiviConfig | None":
    """KIVI's sizes for a kivi2 cache (None for another dtype); the KIVI flags given with another
    dtype are refused (one rule for the engine and kv-estimate)."""
    if kv_cache_dtype != "kivi2":
        if (group_size, residual_length) != (defaults.KIVI_GROUP_SIZE, defaults.KIVI_RESIDUAL_LENGTH):
            raise UserInputError("--kivi-group-size and --kivi-residual-length apply to --kv-cache-dtype kivi2 only")
        return None
    return KiviConfig(group_size, residual_length)


@dataclass(frozen=True)
class KiviConfig:
    group_size: int = defaults.KIVI_GROUP_SIZE            # tokens a key group spans (= the block size)
    residual_length: int = defaults.KIVI_RESIDUAL_LENGTH  # most recent tokens kept in full precision


class ResidualTables:
    """The residual pool and each request's residual blocks, which follow its quantized ones in its
    block table, and the step's conversions (residual block -> a main-pool block) and residual copies
    (the n samples of one prompt: a fork copies the leader's residual)."""

    def __init__(self, num_blocks: int, config: KiviConfig) -> None:
        self.config = config
        self.pool = BlockPool(num_blocks, enable_prefix_caching=False)
        self.blocks: dict[str, list[KVBlock]] = {}
        self.converts: list[tuple[int, int]] = []    # (residual block, main block), before the step's forward
        self.copies: list[tuple[int, int]] = []      # (residual src, residual dst), before the conversions

    def plan(self, rid: str, num_quantized: int, num_computed: int, total: int) -> tuple[int, int]:
        """(blocks to convert, residual blocks to take) for a request holding `num_quantized` quantized
        blocks and `num_computed` computed tokens that will hold `total` tokens after the step."""
        g = self.config.group_size
        held = len(self.blocks.get(rid, ()))
        convert = max(0, quantized_blocks(num_computed, g, self.config.residual_length) - num_quantized)
        convert = min(convert, held)
        target = num_quantized + convert
        return convert, max(0, cdiv(total - target * g, g) - (held - convert))

    def take(self, rid: str, convert: list[KVBlock], new: int) -> None:
        """Convert the request's first len(convert) residual blocks into `convert` (main-pool blocks
        already taken) and give it `new` fresh residual blocks."""
        blocks = self.blocks.setdefault(rid, [])
        done, blocks[:len(convert)] = blocks[:len(convert)], []
        copied = {d: s for s, d in self.copies}
        for r, m in zip(done, convert):
            src = r.block_id
            if src in copied:   # a fork's copy not run yet: convert its source, the copy is not needed (and its
                self.copies.remove((copied[src], src))   # target may be taken, and freed, again in this step)
                src = copied[src]
            self.converts.append((src, m.block_id))
        self.pool.free_blocks(done)   # read by the conversion before this step's forward writes any block
        if new:
            blocks.extend(self.pool.get_new_blocks(new))

    def fork(self, parent: str, child: str, num_blocks: int) -> bool:
        """The child gets copies of the parent's first `num_blocks` residual blocks (False: no room)."""
        src = self.blocks.get(parent, [])[:num_blocks]
        if len(src) > self.pool.num_free_blocks:
            return False
        dst = self.pool.get_new_blocks(len(src))
        self.copies.extend((s.block_id, d.block_id) for s, d in zip(src, dst))
        self.blocks[child] = dst
        return True

    def free(self, rid: str) -> None:
        held = self.blocks.pop(rid, [])
        self.pool.free_blocks(reversed(held))
        if self.copies:   # a copy into a block freed before its step ran is not needed
            gone = {b.block_id for b in held}
            self.copies = [c for c in self.copies if c[1] not in gone]

    def ids(self, rid: str) -> list[int]:
        return [b.block_id for b in self.blocks.get(rid, ())]

    def take_work(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (residual copies, conversions) queued since the last call."""
        out = (self.copies, self.converts)
        self.copies, self.converts = [], []
        return out
