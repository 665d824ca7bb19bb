"""Tensor parallelism: one process per rank, rank 0 in the engine's process (docs/engine.md).

layout.py    which slice of each weight and head a rank holds; the start-up checks
group.py     the rank's process group, its collectives (timed) and the model-building context
channel.py   each step's plan from rank 0 to the other ranks of its node (shared memory)
executor.py  rank 0's side: spawn the ranks, ship plans, watch them, take the group down
rank.py      a rank > 0: build its shard of the model, then run the forwards rank 0 sends
"""
