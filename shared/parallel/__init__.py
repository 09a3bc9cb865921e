"""Tensor parallelism: one engine worker spread over several devices of one host (Megatron-style).

``group`` (the ranks and their collectives), ``sharding`` (which weights each rank keeps),
``runner`` (rank 0 leads the engine's model operations, the others follow), ``ranks`` (starting
the follower processes and running one).
"""
