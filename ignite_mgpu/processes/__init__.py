"""The process layer, torch-free when imported: the launch plan decided once in the parent (``plan``), the GPUs and
CPUs it uses (``gpus``, ``gpu_selection``, ``topology``, ``binding``), what torchrun and SLURM tell a job
(``cluster``), starting and watching the workers (``launcher``, ``supervisor``, ``worker``, ``stop``) and how a job
ended (``outcome``). It never imports the training layer. Nothing is imported here."""
