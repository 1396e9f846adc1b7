"""train.micro_batch=auto on a real CUDA out-of-memory error (the twins of tests/train/step/test_micro_batch.py and
tests/distributed/test_micro_batch.py): the forward asks for a share of the GPU's free memory per sample, so that the
whole batch does not fit; one process with fp16's GradScaler, and 2 processes over NCCL with rank 1 alone short of
memory. `python -m pytest -m gpu tests/gpu/test_micro_batch.py`; they skip on a machine without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import ignite.distributed as idist
import pytest
import torch
from torch import nn

from ignite_mgpu import launch
from ignite_mgpu.train.step.trainer import create_trainer
from tests.conftest import needs_gpus, run_fresh

pytestmark = [pytest.mark.gpu, pytest.mark.slow]  # they start processes: not in the fast tier


class Hungry(nn.Module):
    """Each training sample holds ``free / (fits + 0.5)`` bytes of the GPU's free memory (at construction)."""

    def __init__(self, fits: int, starve: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        free = torch.cuda.mem_get_info()[0]
        self.per_sample = int(free / (fits + 0.5)) if starve else 0
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(len(x))
        if self.training and self.per_sample:
            scratch = torch.empty(len(x) * self.per_sample, dtype=torch.uint8, device=x.device)
            del scratch
        return self.net(x)


def train(micro_batch, fits: int, precision: str = "fp16", starve: bool = True):
    torch.manual_seed(1)
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(4)]
    model = Hungry(fits, starve).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(
        model, opt, nn.CrossEntropyLoss(), device="cuda", precision=precision, micro_batch=micro_batch
    )
    trainer.run(data, max_epochs=2)
    return model, trainer


def test_auto_retries_after_a_real_cuda_out_of_memory_with_the_grad_scaler():
    needs_gpus(1)
    auto, trainer = train("auto", fits=5)
    assert auto.seen[:3] == [16, 8, 4] and trainer.step.micro_batching.size == 4  # 16 and 8 ran out, 4 fits
    fixed, _ = train(4, fits=5, starve=False)
    for a, b in zip(auto.parameters(), fixed.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def ddp_worker(local_rank: int, out: str) -> None:
    model = idist.auto_model(Hungry(fits=5, starve=idist.get_rank() == 1).cuda())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, opt, nn.CrossEntropyLoss(), micro_batch="auto")
    data = [(torch.randn(16, 6), torch.randint(0, 3, (16,))) for _ in range(4)]
    trainer.run(data, max_epochs=2)
    state = {k: v.cpu().tolist() for k, v in model.module.state_dict().items()}
    size = trainer.step.micro_batching.size
    Path(out, f"rank{idist.get_rank()}.json").write_text(json.dumps({"size": size, **state}))


def launch_ddp(out: str) -> None:
    launch(ddp_worker, out, nproc=2, backend="nccl")


@pytest.mark.timeout(180)
def test_one_ranks_cuda_out_of_memory_is_retried_on_both_ranks_without_a_hang(tmp_path):
    needs_gpus(2)
    run_fresh("tests.gpu.test_micro_batch:launch_ddp", str(tmp_path), timeout=170)  # no CUDA in pytest's process
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0 == r1 and r0["size"] == 4  # the same size on both ranks, and the same weights
