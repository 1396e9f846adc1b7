"""A script for `ignite-mgpu run --nproc 2` (tests/faults/test_hangs.py): all-reduces for ``argv[1]`` seconds in a
function of its own, so that `ignite-mgpu stacks` finds every rank in ``reduce_for``."""

import sys
import time

import torch
import torch.distributed as dist


def reduce_for(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    reduce_for(float(sys.argv[1]))
    dist.destroy_process_group()
