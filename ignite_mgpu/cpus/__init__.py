"""Where a job's processes run on the CPUs, torch-free (imports nothing here):

- ``topology``: /sys's CPUs, NUMA nodes and SMT siblings, as a snapshot;
- ``binding``: ``--cpu-binding``: each local rank's CPUs and threads, planned in the parent (pure);
- ``affinity``: in a worker: its binding applied (CPUs, intra-op and BLAS threads), the group's threads moved.
"""
