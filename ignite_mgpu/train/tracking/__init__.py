"""Experiment trackers on rank 0 (imports nothing here):

- ``trackers``: what every tracker logs and when; a failing one is one warning;
- ``backends``: tensorboard, wandb and csv around ignite's loggers;
- ``mlflow_tracker``: ignite's MLflowLogger over an MlflowClient;
- ``csv_logger``: ignite's logger interface over tracking.csv;
- ``run_facts``: what a tracker records of a run (flattened config, physical GPUs, git commit, version);
- ``packages``: what each tracker needs installed and which arguments it takes (read by the pre-flight).
"""
