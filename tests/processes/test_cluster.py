"""What the outer scheduler tells a job: torchrun's and SLURM's restart counts, and requeueing a pre-empted SLURM
job (a stand-in for scontrol). The whole pre-emption job runs in tests/faults/test_restarts.py.
`python -m pytest tests/processes/test_cluster.py`."""

import subprocess

from ignite_mgpu.processes import cluster as scheduler


def test_restart_counts_of_torchrun_and_slurm():
    assert scheduler.outer_restarts({}) == 0
    assert scheduler.outer_restarts({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert scheduler.outer_restarts({"SLURM_RESTART_COUNT": "1", "SLURM_JOB_ID": "9"}) == 1
    assert scheduler.outer_restarts({"SLURM_RESTART_COUNT": ""}) == 0


def test_requeue_runs_scontrol_with_the_job_id():
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    line = scheduler.requeue({"SLURM_JOB_ID": "4242"}, run)
    assert calls == [["scontrol", "requeue", "4242"]]
    assert line == (
        "requeued SLURM job 4242 (scontrol requeue 4242); it continues from the checkpoint with --resume auto."
    )


def test_requeue_failures_say_what_to_do():
    assert scheduler.requeue({}, lambda *a, **k: None).startswith("not requeued: this is not a SLURM job")
    refused = scheduler.requeue(
        {"SLURM_JOB_ID": "5"}, lambda argv, **k: subprocess.CompletedProcess(argv, 1, "", "Requeue not allowed\n")
    )
    assert refused == (
        "could not requeue SLURM job 5 (scontrol requeue 5 exited 1: Requeue not allowed); submit it with sbatch "
        "--requeue, or resubmit it with --resume auto."
    )

    def missing(argv, **kwargs):
        raise FileNotFoundError("scontrol")

    assert scheduler.requeue({"SLURM_JOB_ID": "5"}, missing).startswith("could not requeue SLURM job 5 (scontrol")
