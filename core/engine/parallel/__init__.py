"""Tensor parallelism over torch.distributed: the rank group (group.py), how a checkpoint tensor
is cut for a rank (shard.py) and the sharded layers (layers.py)."""
