"""Tensor parallelism below the engine: one engine worker spread over several devices of one host (Megatron-style).

``group`` (the ranks and their collectives), ``sharding`` (which weights each rank keeps),
``commands`` (what rank 0 tells the others to do). The runner that leads and follows
(``engine/tp_model_runner.py``) and the follower processes (``engine/tp_ranks.py``) live with the
engine they drive.
"""
