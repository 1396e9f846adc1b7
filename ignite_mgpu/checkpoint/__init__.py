"""Checkpoints, one concern per module:

- ``files``: names on disk, completeness, safe reading (``weights_only=True``; safetensors files, ties restored),
  prefixes: the leaf (torch only: the launching process reads it before anything starts);
- ``save``: the atomic saver and ignite's ``Checkpoint`` handlers (rotation, best model, save on stop);
- ``load``: ``load_checkpoint`` into live objects, every key and shape checked first;
- ``resume``: the run signature and restoring a run from its newest complete checkpoint;
- ``sharded``: ``checkpoint_<iteration>/`` folders written by every rank (``checkpoint.format=sharded``);
- ``state``: what a checkpoint holds of the model and optimizer (plain, or gathered / sharded under FSDP);
- ``tools``: ``ignite-mgpu checkpoint inspect`` and ``convert``;
- ``weights``: writing safetensors files (each tie once, atomically) and ``save_weights``.

Nothing is imported here, so that importing ``files`` does not pull in ignite.
"""
