"""How a model is spread over processes, below both the training layer and the checkpoints (imports nothing here):

- ``strategy``: DDP, DataParallel, FSDP or placed; ``unwrap``; gradient sync off (``no_sync``); the DP loss vector;
- ``fsdp``: FSDP2's block rule, ``fully_shard``, and evaluation with as many forwards on every rank.
"""
