"""``ignite-mgpu plan``: the memory a training step needs, in the launching process (imports nothing here):

- ``estimate``: one training step on fake tensors (PyTorch's MemTracker), per strategy and process count;
- ``budget``: the rows per strategy against the GPUs' free memory or the RAM: what fits, with which micro-batch;
- ``table``: the memory plan printed as a table or JSON.
"""
