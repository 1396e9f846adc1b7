"""A job that hangs: found, and where each rank is, torch-free (imports nothing here):

- ``watch``: the hang watch over the workers' status files (no progress for far longer than the job's slowest
  work: hung), and one attempt's side of it (``HangChecks``);
- ``stacks``: every rank's Python stacks on a signal (faulthandler), for a hang's report and ``ignite-mgpu stacks``;
- ``hang_report``: where each rank is (the stuck frame, the collective), ``hang_<time>.txt``, NCCL's Flight Recorder.
"""
