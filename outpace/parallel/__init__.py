"""Tensor parallelism: the ranks' process group (group.py) and how a model's layers are split
across them (shard.py)."""
