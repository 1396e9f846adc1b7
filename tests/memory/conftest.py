"""The memory plan needs PyTorch's memory trackers, which PyTorch 2.4 lacks: there, this folder is not collected
(`ignite-mgpu plan` says to upgrade: tests/test_jobs.py)."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("torch.distributed._tools.fsdp2_mem_tracker") else ["*.py"]
