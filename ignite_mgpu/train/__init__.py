"""The training layer: what runs inside each worker (imports nothing here).

- ``default_job``: ``training(local_rank, cfg)`` and ``scoring``: the default job's wiring, top to bottom;
- ``measuring``: what ``ignite-mgpu scale`` runs at one size: the default job's step, measured;
- ``models``, ``losses``, ``optim``, ``param_groups``: the model, loss, optimizer and its groups from the config;
- ``evaluator``, ``metrics``: validation over all ranks, every sample once; ``eval.metrics``;
- ``checkpointing``: the checkpoint handlers on the trainer (schedule, stop, best model);
- ``epoch_log``: metrics.jsonl and the epoch's table; ``goodput``: where the wall time goes;
- ``plugins``: the user's ``package.module:factory``; ``allocator``: glibc keeps freed memory, the heap frozen;
- ``data/``: datasets, loaders, batches; ``step/``: the trainer and its step; ``tracking/``: experiment trackers.
"""
