"""Where the step goes on one rank (ignite_mgpu/train/step/timing.py): the split of a step from its clock readings
and the moment backward handed its last gradient bucket to the all-reduce, the trainer's sums per epoch, the DDP comm
hook that notes that moment (and gives way to the user's own), and the CUDA events read later (a gpu test). The
2-process judgement is in tests/faults/test_hangs.py (a slow rank) and tests/distributed/test_training.py.
`python -m pytest tests/train/step/test_timing.py -q`."""

import math
import time

import pytest
import torch
from ignite.engine import Events
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from ignite_mgpu.train.step.timing import StepTimes, watch_gradient_sync
from ignite_mgpu.train.step.trainer import create_trainer
from tests.conftest import needs_gpus, run_fresh
from tests.helpers import data, linear


def test_the_split_of_a_step_from_its_clock_readings():
    times = StepTimes(torch.device("cpu"))
    times.ready = 10.004  # the last bucket handed over 4 ms after the step started
    times.add(10.0, 10.010, 10.012)  # backward ended at 10 ms, the optimizer step at 12 ms
    assert (times.compute, times.comm, times.optimizer) == pytest.approx((0.004, 0.006, 0.002))
    # An accumulation step: no bucket handed over in it (the note is from the step before), no optimizer step.
    times.add(11.0, 11.003)
    assert times.seconds() == pytest.approx((0.007, 0.006, 0.002))
    times.reset()
    assert times.seconds() == (0.0, 0.0, 0.0)


def test_the_trainer_sums_its_steps_per_epoch():
    model = linear()
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu", grad_accum_steps=2
    )
    seconds = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: seconds.append(trainer.step.times.seconds()))
    trainer.add_event_handler(Events.EPOCH_STARTED, trainer.step.times.reset)
    trainer.run(data(n=32, batch=8), max_epochs=2)
    for compute, comm, optimizer in seconds:  # one plain process: no gradient sync to wait for
        assert compute > 0 and comm == 0.0 and optimizer > 0
    assert trainer.step.times.measured and trainer.step.times.watching


def test_the_comm_hook_notes_the_last_bucket_and_gives_way_to_the_users(one_rank):
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3)))
    times = StepTimes(torch.device("cpu"))
    watch_gradient_sync(None, ddp, times, 1)
    start = times.clock()
    ddp(torch.randn(4, 6)).sum().backward()
    times.add(start, times.clock())
    assert times.ready > start and times.comm >= 0 and times.compute > 0 and times.measured
    users = DistributedDataParallel(nn.Linear(6, 3))
    users.register_comm_hook(None, allreduce_hook)
    mine = StepTimes(torch.device("cpu"))
    watch_gradient_sync(None, users, mine, 1)
    users(torch.randn(4, 6)).sum().backward()
    assert not mine.measured and mine.ready == 0.0 and math.isnan(mine.seconds()[1])
    plain, parallel = StepTimes(torch.device("cpu")), StepTimes(torch.device("cpu"))
    watch_gradient_sync(None, nn.DataParallel(nn.Linear(6, 3)), parallel, 1)
    watch_gradient_sync(None, nn.Linear(6, 3), plain, 2)  # FSDP's case: several processes, no DDP
    assert not parallel.measured and not plain.measured


def test_fsdp_gathers_are_timed_around_fsdps_own_hooks(one_rank):
    # Our hooks read the clock just before FSDP gathers a block's parameters and just after: before, the block holds
    # its shards (DTensors); after, the gathered parameters. In forward and again in backward (resharded after
    # forward). The block is not the root: FSDP keeps a root's parameters gathered after forward.
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3))
    block = fully_shard(model[0], reshard_after_forward=True)
    fully_shard(model)
    times, sharded = StepTimes(torch.device("cpu")), []
    clock = times.clock

    def noting_the_block():
        sharded.append(isinstance(block.weight, DTensor))
        return clock()

    times.clock = noting_the_block
    watch_gradient_sync(None, model, times, 2)  # as on 2 ranks: no DDP, FSDP's gathers
    model(torch.randn(4, 6)).sum().backward()
    # Pairs: the root's forward (nothing of the block's gathered), the block's forward (gathered after), the root's
    # backward (the block still sharded), the block's backward (gathered again after).
    assert sharded == [True, True, True, False, True, True, True, False]
    assert times.measured and times.sharded and times.gathered > 0
    start = time.perf_counter()
    times.add(start - 1, start)
    assert times.gathered == 0.0 and times.comm > 0 and times.compute == pytest.approx(1 - times.comm)
    with torch.no_grad():
        model.eval()
        model(torch.randn(4, 6))  # an evaluation's forward: not the step's
    assert times.gathered == 0.0


def cuda_split() -> list[float]:
    """A CUDA model's trainer for 2 epochs of 8 steps: the split from events read later (run in a fresh process)."""
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
    trainer = create_trainer(model, torch.optim.AdamW(model.parameters()), nn.CrossEntropyLoss(), device="cuda")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(512, 512), torch.randint(0, 10, (512,))), batch_size=64
    )
    seconds = []
    trainer.add_event_handler(Events.EPOCH_STARTED, trainer.step.times.reset)
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda: seconds.append(trainer.step.times.seconds()))
    trainer.run(loader, max_epochs=2)
    return [*seconds[-1], len(trainer.step.times._pending)]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_cuda_events_are_read_later_without_a_sync_per_step():
    needs_gpus(1)
    (compute, comm, optimizer, pending), _ = run_fresh("tests.train.step.test_timing:cuda_split", timeout=170)
    assert compute > 0 and comm == 0.0 and optimizer > 0 and pending == 0
