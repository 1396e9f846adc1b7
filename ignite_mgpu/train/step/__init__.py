"""The training step and the engine that runs it (imports nothing here):

- ``core``: ``Step``, what the step is made of, built once (``trainer.step``); the window's optimizer step;
- ``trainer``: ``create_trainer``: one ignite Engine (``Trainer``), one step with switches;
- ``timing``: where this rank's step goes (compute, the wait for the gradient all-reduce, the optimizer), per epoch;
- ``micro_step``: the step in parts (weighted losses, one sync, auto's agreed retry);
- ``micro_batch``: ``train.micro_batch``: the split, the out-of-memory test, the shrink rule, the remembered size;
- ``guard``: every rank stops together; the shared checkpoint decision; accumulation windows;
- ``deterministic``: ``train.deterministic``: PyTorch's deterministic mode, a portable DeterministicEngine.
"""
