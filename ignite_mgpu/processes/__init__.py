"""Starting and watching a job's processes (the launch layer), torch-free (imports nothing here):

- ``plan``: ``LaunchPlan`` and ``Restart``; ``make_plan`` decides backend, processes, GPUs, rendezvous, binding;
- ``launcher``: ``launch()`` for Python code, ``run_plan`` / ``run_job`` for a decided plan;
- ``supervisor``: starts the workers, stops them all on the first failure, restarts them;
- ``forkserver``: the one process per job that imports torch once and forks every worker;
- ``worker``: inside a worker: process group, signals, CPU binding, ``idist.Parallel``;
- ``attempt_files``: what a worker leaves for the supervisor (failure file, rank 0's value, status), and its reading;
- ``elastic``: a failed GPU left out of the restart (``--gpus auto:MIN-MAX``), or the line saying a range would;
- ``resize``: an elastic job lending GPUs to waiting jobs and taking free ones back (the supervisor's side);
- ``outcome``: how a job ended (one exit code, one message) and whether a restart can cure it;
- ``torchelastic``: what a torchrun launch also gives: the run's id, each rank's error file that ``@record`` fills;
- ``notebook``: where ``launch()`` is called from (a notebook's function is forked, a script's spawned);
- ``script``: ``ignite-mgpu run``: a user's script in the workers, as python would run it;
- ``heartbeat``: the hang watch (no progress for far longer than the job's slowest work: hung), the supervisor's side;
- ``stacks``: every rank's Python stacks on a signal (faulthandler), for a hang's report and ``ignite-mgpu stacks``;
- ``hang_report``: where each rank is (the stuck frame, the collective), ``hang_<time>.txt``, NCCL's Flight Recorder.
"""
