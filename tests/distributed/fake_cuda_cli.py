"""The CLI with the launching process's torch made to see one CUDA device per GPU that nvidia-smi lists: on a CPU
machine, with the stand-in nvidia-smi (tests/fake_gpus) first on PATH, ``--gpus`` plans, claims and exports GPUs as
on a GPU server, and the gloo workers (which see no CUDA here) train on the CPU. An elastic job looks at the waiting
line every ``LOOK_EVERY`` seconds (default 0.5), not every 5. Used by test_elastic.py.

Run: PATH=tests/fake_gpus:$PATH python tests/distributed/fake_cuda_cli.py train --gpus auto:2-4 --backend gloo
"""

import os

from ignite_mgpu.cli.commands import main
from ignite_mgpu.gpus import inventory
from ignite_mgpu.processes import elastic, machine


def _machine() -> machine.Machine:
    return machine.Machine(len(inventory.query_gpus()), cpu_count=os.cpu_count() or 1)


if __name__ == "__main__":
    machine.probe_machine = _machine
    elastic.LOOK_EVERY = float(os.environ.get("LOOK_EVERY", "0.5"))
    main()
