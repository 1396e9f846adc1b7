"""What torchrun and SLURM tell a job: who started it, its ranks and id, the restart counts, and requeueing a
pre-empted SLURM job (a stand-in for scontrol). The whole pre-emption job runs in tests/faults/test_restarts.py.
`python -m pytest tests/env/test_cluster.py`."""

import subprocess

from ignite_mgpu.env import cluster


def test_restart_counts_of_torchrun_and_slurm():
    assert cluster.outer_restarts({}) == 0
    assert cluster.outer_restarts({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert cluster.outer_restarts({"SLURM_RESTART_COUNT": "1", "SLURM_JOB_ID": "9"}) == 1
    assert cluster.outer_restarts({"SLURM_RESTART_COUNT": ""}) == 0


def test_requeue_runs_scontrol_with_the_job_id():
    calls = []

    def run(argv, **kwargs):
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    line = cluster.requeue({"SLURM_JOB_ID": "4242"}, run)
    assert calls == [["scontrol", "requeue", "4242"]]
    assert line == (
        "requeued SLURM job 4242 (scontrol requeue 4242); it continues from the checkpoint with --resume auto."
    )


def test_requeue_failures_say_what_to_do():
    assert cluster.requeue({}, lambda *a, **k: None).startswith("not requeued: this is not a SLURM job")
    refused = cluster.requeue(
        {"SLURM_JOB_ID": "5"}, lambda argv, **k: subprocess.CompletedProcess(argv, 1, "", "Requeue not allowed\n")
    )
    assert refused == (
        "could not requeue SLURM job 5 (scontrol requeue 5 exited 1: Requeue not allowed); submit it with sbatch "
        "--requeue, or resubmit it with --resume auto."
    )

    def missing(argv, **kwargs):
        raise FileNotFoundError("scontrol")

    assert cluster.requeue({"SLURM_JOB_ID": "5"}, missing).startswith("could not requeue SLURM job 5 (scontrol")


def test_a_scripts_requeue_says_it_starts_again_without_resume_auto():
    ok = cluster.requeue({"SLURM_JOB_ID": "7"}, lambda argv, **k: subprocess.CompletedProcess(argv, 0, "", ""), True)
    assert ok == (
        "requeued SLURM job 7 (scontrol requeue 7); the script starts again (TORCHELASTIC_RESTART_COUNT counts the "
        "requeue)."
    )
    refused = cluster.requeue(
        {"SLURM_JOB_ID": "7"}, lambda argv, **k: subprocess.CompletedProcess(argv, 1, "", ""), True
    )
    assert refused.endswith("); submit it with sbatch --requeue, or resubmit it.")
    assert cluster.requeue({}, script=True).endswith("(no SLURM_JOB_ID); start it again.")


def test_who_started_the_process_and_where_it_stands():
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    assert cluster.started_externally(torchrun) and not cluster.started_externally({"RANK": "0"})
    assert (cluster.global_rank(torchrun), cluster.local_rank(torchrun), cluster.job_size(torchrun)) == (3, 1, (8, 4))
    assert cluster.job_id(torchrun) == "x" and not cluster.is_first_process(torchrun)
    srun = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "8", "SLURM_PROCID": "0", "SLURM_NTASKS_PER_NODE": "4(x2)"}
    assert cluster.started_externally(srun) and cluster.is_first_process(srun)
    assert cluster.job_size(srun) == (8, 4) and cluster.job_id(srun) == "42"
    assert not cluster.started_externally({"SLURM_JOB_ID": "42", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"})  # sbatch
    assert cluster.job_id({"TORCHELASTIC_RUN_ID": "none"}) is None and cluster.job_id({}) is None
    assert cluster.is_first_process({}) and cluster.job_size({}) == (1, 1)


def test_a_worker_gets_torchruns_variables_and_drops_the_launchers_slurm_task():
    env = cluster.worker_environment(
        5, 1, 8, 4, 1, "10.0.0.1", 29500, restart_count=1, max_restarts=2, run_id="j7", error_file="/e/error5.json"
    )
    assert env == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "5",
        "ROLE_WORLD_SIZE": "8",
        "ROLE_NAME": "default",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "2",
        "TORCHELASTIC_RUN_ID": "j7",  # torch.distributed.is_torchelastic_launched(): Lightning reads it
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts the store, as torchrun's static rendezvous
        "TORCHELASTIC_ERROR_FILE": "/e/error5.json",  # filled by torch's @record
    }
    assert "TORCHELASTIC_ERROR_FILE" not in cluster.worker_environment(0, 0, 1, 1, 0, "h", 1)
    assert cluster.outer_restarts(env) == 1  # a restarted script reads it as it would under torchrun
    assert cluster.started_externally(env)  # what the job function sees is what torchrun would give it
    slurm = {"SLURM_PROCID": "0", "SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "PATH": "/bin"}
    assert sorted(cluster.slurm_task_variables(slurm)) == ["SLURM_JOB_ID", "SLURM_PROCID"]
    agent = {
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "7",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    assert cluster.torchrun_store(agent) == ("h", 7, "2") and cluster.torchrun_store({}) is None
