"""Tensor parallelism over torch.distributed: plans, sharded weights and the rank workers."""
