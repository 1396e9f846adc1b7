"""The data of a job (imports nothing here):

- ``datasets``: built-in by name or from the user's factory, and their size checks;
- ``loaders``: ``create_dataloader`` (the global batch, the seeded sampler, exact validation) and the job's loaders;
- ``sampler``: ``GlobalBatchSampler``: each rank's share of every global batch, the same on any process count;
- ``batches``: what a batch is (tuple or mapping) and what a model returns (logits, loss).
"""
