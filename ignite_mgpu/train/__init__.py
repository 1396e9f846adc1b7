"""The training layer: what runs inside each worker. ``job`` wires the default job from the config; the engines
(``engine``, ``evaluator``, ``deterministic``, ``guard``), the model's wrapping (``strategy``, ``fsdp``), data
(``datasets``, ``loaders``, ``batches``), ``models``, ``optim``, the user's factories (``plugins``), the epoch log
and the CPU allocator. Nothing is imported here."""
