"""Checkpoints, one concern per module:

- ``files``: names on disk, completeness, safe reading (``weights_only=True``; safetensors files, ties restored),
  prefixes: the leaf (torch only: the launching process reads it before anything starts);
- ``disk``: ``SafeDiskSaver``, the atomic file saver (temp file, fsync, rename, then removals);
- ``background``: ``checkpoint.async_save``: the snapshot and the background writer (``AsyncDiskSaver``);
- ``save``: ignite's ``Checkpoint`` handlers (rotation, the best model, the run info), awaiting the last write;
- ``load``: ``load_checkpoint`` into live objects, every key and shape checked first;
- ``same_run``: the run signature, the checkpoint a resume continues and the check that it is of this run (also
  before any worker starts, from its ``run`` entry alone);
- ``resume``: restoring a run from that checkpoint;
- ``sharded``: ``checkpoint_<iteration>/`` folders written by every rank (``checkpoint.format=sharded``);
- ``state``: what a checkpoint holds of the model and optimizer (plain, or gathered / sharded under FSDP);
- ``tools``: ``ignite-mgpu checkpoint inspect`` and ``convert``;
- ``weights``: writing safetensors files (each tie once, atomically) and ``save_weights``.

Nothing is imported here, so that importing ``files`` does not pull in ignite.
"""
