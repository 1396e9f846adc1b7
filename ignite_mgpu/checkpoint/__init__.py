"""Checkpoints, one concern per module:

- ``files``: names on disk, completeness, safe reading (``weights_only=True``), prefixes, inspect and convert
  (torch only: the launching process uses it before anything starts);
- ``save``: the atomic saver and ignite's ``Checkpoint`` handlers (rotation, best model, save on stop);
- ``load``: ``load_checkpoint`` into live objects, every key and shape checked first;
- ``resume``: the run signature and restoring a run from its newest complete checkpoint;
- ``sharded``: ``checkpoint_<iteration>/`` folders written by every rank (``checkpoint.format=sharded``).

Nothing is imported here, so that importing ``files`` does not pull in ignite.
"""
