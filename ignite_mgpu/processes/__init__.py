"""Starting and watching a job's processes (the launch layer), torch-free (imports nothing here):

- ``plan``: ``LaunchPlan``, frozen once decided; ``make_plan`` decides backend, processes, GPUs, rendezvous, binding;
- ``machine``: what the plan knows of this machine (CUDA devices, CPUs, ports) and the checks against it;
- ``job``: what the workers run (``Job``) and what a restart runs (``Restart``);
- ``launcher``: ``launch()`` for Python code, ``run_job`` for a decided plan (in workers or in this process);
- ``supervisor``: the job's loop: an attempt, then the next start decided from how it ended;
- ``attempt``: one start of the workers: started, watched, stopped all at the first failure, how they ended;
- ``next_start``: after an attempt, one decision: the job ends, restarts (its backoff), or goes on on other GPUs;
- ``elastic``: an elastic job's GPUs changing: a failed GPU left out, GPUs lent to waiting jobs and taken back;
- ``forkserver``: the one process per job that imports torch once and forks every worker;
- ``worker``: inside a worker: what its attempt gives it, process group, signals, CPU binding, ``idist.Parallel``;
- ``relay``: each worker's output relayed to the launcher's stdout and stderr a whole line at a time;
- ``attempt_files``: what a worker leaves for the supervisor (failure, error, status files, rank 0's value);
- ``outcome``: how a job ended (one exit code, one message) and whether a restart can cure it;
- ``notebook``: where ``launch()`` is called from (a notebook's function is forked, a script's spawned);
- ``script``: ``ignite-mgpu run``: a user's script in the workers, as python would run it.
"""
