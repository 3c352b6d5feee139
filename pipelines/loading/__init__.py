"""The streaming loader: corpus manifest -> seekable, rank-balanced, resumable batches.

Owns ``loader`` (epoch layout, block shuffle, data position, map-style sources), ``shard_io``
(reading samples out of shards, decoding without pickle) and ``workers`` (DataLoader worker start
method and signal handling). May import ``core`` only (and torch/numpy); the engine imports it.
"""
