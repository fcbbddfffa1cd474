"""Process groups and collectives of one tensor-parallel rank (torch.distributed: gloo on the CPU,
NCCL on GPUs).

Two groups: the default one, used while the ranks start and load (its timeout,
TP_START_TIMEOUT_S, covers a slow load), and the step group every forward's collectives and the
step broadcasts use, with a timeout of TP_TIMEOUT_S (at most 30 s) so that a rank that hangs is an
error, not a hang. A rank that dies closes its sockets and its peers' collectives fail at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmopt import defaults
from llmopt.distributed.plan import TPPlan
from llmopt.distributed.shard import shard_grouped, shard_tensor
from llmopt.errors import UserInputError


@dataclass
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int


def torchrun_env() -> TorchrunEnv | None:
    """RANK/WORLD_SIZE/LOCAL_RANK as torchrun sets them (with MASTER_ADDR/MASTER_PORT), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise UserInputError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None
    return TorchrunEnv(rank, world, local)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's device: on GPUs the local rank's one, else the CPU."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def threads_per_rank(world_size: int) -> int:
    """CPU threads for each rank of a world of `world_size` processes on this machine (one at least)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group: the plan, its rank, the step group."""
    plan: TPPlan
    rank: int
    device: torch.device
    group: Any = None            # the step group (timeout TP_TIMEOUT_S); None only in a world of one

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    # -- collectives the model uses ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (row-parallel partial sums)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x concatenated along the last dim, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def embed(self, table, ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: this rank looks up the ids in its rows, zeros the others,
        and the sum over the ranks is the whole table's lookup. `table` is the rank's embedding
        module (nn.Embedding, or the int8 one sharing the head's table)."""
        start, stop = self.plan.vocab_range(self.rank)
        local = ids - start
        inside = (local >= 0) & (local < stop - start)
        x = table(torch.where(inside, local, torch.zeros_like(local)))
        x = x.masked_fill(~inside.unsqueeze(-1), 0)
        return self.all_reduce(x)

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The column-parallel head's [..., vocab_per_rank] slices -> [..., vocab] (padding dropped)."""
        return self.all_gather(logits)[..., :self.plan.vocab_size]

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV-cache blocks all ranks can hold); on the
        default group, whose timeout covers ranks that finish loading at different times."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def barrier(self) -> None:
        """Wait for every rank (default group: the long start-up timeout), e.g. after loading."""
        dist.barrier()

    # -- weights -----------------------------------------------------------------------------------
    def shard(self, name: str, tensor, quantization_config: dict | None):
        """This rank's slice of checkpoint tensor `name` (a tensor or a safetensors slice)."""
        return shard_tensor(name, tensor, self.plan, self.rank, quantization_config)

    def shard_grouped(self, name: str, g):
        """This rank's slice of a GGUF tensor decoded into grouped codes (llmopt.layers.formats.ggml)."""
        return shard_grouped(name, g, self.plan, self.rank)


def init_group(plan: TPPlan, rank: int, device: torch.device, *, store=None, init_method: str | None = None,
               timeout_s: float | None = None) -> TPGroup:
    """Join the world (a TCPStore the engine made, or torchrun's env://) and make the step group
    (its timeout: `timeout_s`, default TP_TIMEOUT_S; the default group's: TP_START_TIMEOUT_S)."""
    timeout_s = defaults.TP_TIMEOUT_S if timeout_s is None else timeout_s
    start_timeout_s = defaults.TP_START_TIMEOUT_S
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw: dict[str, Any] = {"store": store} if store is not None else {"init_method": init_method or "env://"}
    dist.init_process_group(backend, rank=rank, world_size=plan.world_size,
                            timeout=timedelta(seconds=start_timeout_s), **kw)
    group = dist.new_group(list(range(plan.world_size)), timeout=timedelta(seconds=timeout_s), backend=backend)
    return TPGroup(plan, rank, device, group)


def destroy() -> None:
    """Leave the world (a later engine in this process may join another)."""
    if dist.is_initialized():
        dist.destroy_process_group()
