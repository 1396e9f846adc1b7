"""Dataset, model and loss factories as a user would write them, well and badly."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, TensorDataset

NOT_CALLABLE = 42


def _pairs(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def pairs(n: int = 40, val: int = 10) -> tuple[Dataset, Dataset]:
    """(train, val) of (x, y) pairs."""
    return _pairs(n, 0), _pairs(val, 1)


class Dicts(Dataset):
    """Hugging Face-style items: {"x": ..., "labels": ...} (or without labels)."""

    def __init__(self, n: int, seed: int, with_labels: bool = True) -> None:
        self.inner, self.with_labels = _pairs(n, seed), with_labels

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> dict:
        x, y = self.inner[i]
        return {"x": x, "labels": y, "note": "kept on the host"} if self.with_labels else {"x": x}


def dicts(n: int = 40, val: int = 10, labels: bool = True, collate: bool = False) -> dict:
    out = {"train": Dicts(n, 0, labels), "val": Dicts(val, 1, labels)}
    if collate:
        out["collate_fn"] = collate_dicts
    return out


def collate_dicts(items: list[dict]) -> dict:
    return {
        "x": torch.stack([i["x"] for i in items]),
        "labels": torch.stack([i["labels"] for i in items]),
        "n": len(items),
    }


def raises(n: int = 40) -> tuple:
    return _helper_that_fails(n)


def _helper_that_fails(n: int) -> tuple:
    raise ValueError(f"cannot open shard {n}")


def wrong_return() -> list:
    return [1, 2, 3, 4]


class Stream(IterableDataset):
    def __iter__(self):
        yield from _pairs(10, 0)


def iterable() -> tuple:
    return Stream(), _pairs(10, 1)


class Net(nn.Module):
    """Returns logits, or its own loss given targets."""

    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.fc = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **_: object):
        logits = self.fc(x)
        return logits if labels is None else {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def net(hidden: int = 8) -> nn.Module:
    return Net(hidden)


def bn_cnn(num_classes: int = 10) -> nn.Module:
    """A CNN with BatchNorm (statistics over the batch), for images of 3 channels."""
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers, nn.Linear(8, num_classes))


def smooth_l1() -> nn.Module:
    """A loss factory: returns a loss function (predictions, targets) -> loss."""
    return nn.CrossEntropyLoss(label_smoothing=0.1)


def number() -> int:
    return 3


def samples(device: str = "cpu", scale: int = 1):
    """A metric of the user's (eval.metrics: tests.plugins_pkg.factories:samples): the validation samples seen,
    times ``scale``; it records the device it was given."""
    from ignite.metrics import Metric
    from ignite.metrics.metric import sync_all_reduce

    class Samples(Metric):
        def reset(self) -> None:
            self.count = 0

        def update(self, output) -> None:
            self.count += len(output[1])

        @sync_all_reduce("count")
        def compute(self) -> float:
            return float(self.count * scale)

    metric = Samples(device=device)
    metric.given_device = device
    return metric


def not_a_metric():
    return 3.0


class CappedMLP(nn.Module):
    """An MLP whose training forward holds ``mb_per_sample`` MB of scratch per sample (untouched: address space
    only). In rank ``capped_rank`` its first training forward of a batch caps the process's address space at what
    it uses then plus ``headroom_mb``: a real allocator failure for a batch that does not fit. ``log``: a file that
    gets each training forward's batch size (rank 0's)."""

    def __init__(self, capped_rank: int, headroom_mb: int, mb_per_sample: int, log: str | None) -> None:
        import ignite.distributed as idist

        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 10))
        self.mb_per_sample, self.log = mb_per_sample, log if idist.get_rank() == 0 else None
        self.cap_mb = headroom_mb if idist.get_rank() == capped_rank else 0

    def _cap(self) -> None:
        import resource

        with open("/proc/self/statm") as f:
            used = int(f.read().split()[0]) * resource.getpagesize()
        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        resource.setrlimit(resource.RLIMIT_AS, (used + self.cap_mb * 2**20, hard))
        self.cap_mb = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and len(x) > 1:  # not the one sample that builds the model
            if self.cap_mb:
                self._cap()
            torch.empty(len(x) * self.mb_per_sample * 2**20, dtype=torch.uint8)  # the activations of a big model
            if self.log:
                with open(self.log, "a") as f:
                    f.write(f"{len(x)}\n")
        return self.net(x)


# 16 samples (8 GiB of scratch) never fit under the cap, 8 (4 GiB) fit with about 1.9 GiB of address space to spare
# for what the process maps after the cap (gloo's and FSDP's buffers, a thread's malloc arena of 64 MiB each).
def capped_mlp(
    num_classes: int = 10, capped_rank: int = -1, headroom_mb: int = 6000, mb_per_sample: int = 512, log: str = ""
) -> nn.Module:
    return CappedMLP(capped_rank, headroom_mb, mb_per_sample, log or None)


def wide_mlp(num_classes: int = 10, hidden: int = 2048, second: int = 1200) -> nn.Module:
    """An MLP of 4.0 M parameters on 16x16 RGB images (768 inputs): 16 MB of gradients to all-reduce per step, for
    little compute at a small batch."""
    return nn.Sequential(
        nn.Flatten(),
        nn.LazyLinear(hidden),
        nn.ReLU(),
        nn.Linear(hidden, second),
        nn.ReLU(),
        nn.Linear(second, num_classes),
    )
