"""Run folders, torch-free (imports nothing here):

- ``folder``: the names of a run folder's files, the only copy; ``lock``: one job per run folder;
- ``read``: reading runs back (metrics.jsonl, config.yaml, the best model);
- ``report``: ``ignite-mgpu report``'s text table and JSON; ``figure``: its figure (matplotlib, when drawing);
- ``goodput_parts``: goodput's parts and the run's totals as the report reads them back;
- ``bottleneck``: where the step's time goes, judged: the slowest rank and its cause, or what bounds the job;
- ``efficiency``: ``ignite-mgpu scale``'s speed-up, scaling efficiency, lost time per part, verdict and table;
- ``published``: published scaling figures and the one nearest to a run;
- ``regular``: the one way to read a path a user or a run folder names (regular files only, within a bound);
- ``writable``: whether a run folder can be made and written, as one paragraph; a full disk said with its space;
- ``metric_names``: eval.metrics' names, what each needs, which way each is better.
- ``closing``: what a run says when it ends (three lines for a person) and when it is stopped (its checkpoint).
"""
