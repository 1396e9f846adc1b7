"""What a worker and the launcher both read of their surroundings, torch-free leaves (imports nothing here):

- ``cluster``: what torchrun and SLURM tell a job (who started it, ranks, job id, restarts), a worker's environment
  and its run id;
- ``stop``: the stop request, the collective timeout and the status file of this worker;
- ``clock``: goodput's anchors (when the command started, when a previous attempt failed);
- ``launcher_dir``: the launcher's private folder (0700, held open), checked before ``ignite-mgpu stacks`` trusts it.
"""
