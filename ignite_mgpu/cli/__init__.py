"""The ``ignite-mgpu`` command (click), torch imported lazily so that ``--help`` answers fast (imports nothing here):

- ``commands``: ``main``, the command group, and the commands that start jobs (train, evaluate, run, plan, config);
- ``readers``: the commands that read what is there (devices, stacks, report, checkpoint inspect/convert);
- ``options``: the flags that commands share, their parsing, one-line failures.
"""
