"""The datasets of a job: built in by name (synthetic, fake, torchvision's), or from the user's factory, and the
checks of their sizes against the global batch. The launching process builds them once to check them, so nothing
here imports ignite."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping
from multiprocessing.sharedctypes import RawValue
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

# torch-free, so that the launcher checks the sizes of generated data without torch; still importable from here
from ignite_mgpu.config.checks import check_global_batch as check_global_batch
from ignite_mgpu.config.checks import check_sizes as check_sizes
from ignite_mgpu.config.schema import GENERATED as GENERATED
from ignite_mgpu.config.schema import DataConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins
from ignite_mgpu.train.data import batches

logger = logging.getLogger(__name__)
AMPLITUDE = 0.2  # of the class patterns of synthetic images, against noise of standard deviation 1


class SyntheticImages(Dataset):
    """Deterministic, learnable images generated in memory: a smooth per-class pattern plus Gaussian noise."""

    def __init__(self, size: int, num_classes: int, image_size: int, seed: int, train: bool) -> None:
        protos = torch.randn(num_classes, 3, 4, 4, generator=torch.Generator().manual_seed(seed))
        protos = F.interpolate(protos, size=image_size, mode="bilinear", align_corners=False)
        g = torch.Generator().manual_seed(seed * 2 + (1 if train else 2))
        self.targets = torch.randint(num_classes, (size,), generator=g)
        self.images = AMPLITUDE * protos[self.targets] + torch.randn(size, 3, image_size, image_size, generator=g)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.targets[index])


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's augmentation in one epoch: the same on any rank and any process count. A hash, 32
    bits: the CPU generator's Mersenne Twister takes only the seed's low 32 bits."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class _CheckedImageFolder(Dataset):
    """ImageFolder whose errors name the file; with ``skip`` a bad file is logged and dropped from its batch.

    With a ``seed``, a sample's random transforms draw from a generator seeded by (seed, epoch, index) and not from
    the process's own: sample i of epoch e gets the same crop and flip on whichever rank serves it, on any process
    count (a run resumed on other GPUs stays the same run), and the process's own generator (dropout) is untouched.
    The epoch is in shared memory, so that the loader's persistent worker processes see ``set_epoch``.
    """

    def __init__(self, root: Path, transform: Any, skip: bool, seed: int | None = None) -> None:
        from torchvision.datasets import ImageFolder

        self.inner = ImageFolder(str(root), transform=transform)
        self.skip, self.seed = skip, seed
        self.epoch = RawValue("q", 0)

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose augmentation the next samples draw (the trainer calls it with the sampler's)."""
        self.epoch.value = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> Any:
        if self.seed is None:
            return self._read(index)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, self.epoch.value, index))
            return self._read(index)

    def _read(self, index: int) -> Any:
        path = self.inner.samples[index][0]
        try:
            return self.inner[index]
        except Exception as err:  # PIL raises several unrelated types for a corrupt file
            if not self.skip:
                raise RuntimeError(
                    f"cannot read image {path}: {err}. Remove or replace the file, or set "
                    "data.skip_bad_samples=true to skip unreadable images."
                ) from err
            logger.warning("skipping unreadable image %s (%s)", path, err)
            return None


def collate_skipping_none(batch: list[Any]) -> Any:
    """(images, labels, number of skipped samples) for ``data.skip_bad_samples``; the trainer sums the third."""
    kept = [b for b in batch if b is not None]
    return [*default_collate(kept), torch.tensor(len(batch) - len(kept))]


class Splits(NamedTuple):
    """A job's datasets, and the collate function a dataset factory may give (None: PyTorch's default)."""

    train: Dataset
    val: Dataset
    collate_fn: Callable[[list[Any]], Any] | None = None


def build_datasets(cfg: DataConfig, num_classes: int, seed: int) -> Splits:
    """The training and validation datasets: built in, or from a factory. Downloads only with ``data.download``."""
    if plugins.is_factory(cfg.name):
        return _from_factory(cfg)
    return Splits(*_builtin(cfg, num_classes, seed))


def _from_factory(cfg: DataConfig) -> Splits:
    """``factory(**data.args)``, which returns ``(train, val)``, ``(train, val, collate_fn)`` or a mapping with
    ``train``, ``val`` and optionally ``collate_fn``; both map-style datasets."""
    key, name = "data.name", cfg.name
    factory = plugins.resolve(name, key)
    plugins.check_arguments(factory, cfg.args, f"{key}={name}", "data.args")
    out = plugins.call(factory, cfg.args, name, key)
    form = "(train, val), (train, val, collate_fn) or {'train': ..., 'val': ..., 'collate_fn': ...}"
    if isinstance(out, Mapping) and {"train", "val"} <= set(out) <= {"train", "val", "collate_fn"}:
        splits = Splits(out["train"], out["val"], out.get("collate_fn"))
    elif isinstance(out, (tuple, list)) and len(out) in (2, 3) and not isinstance(out, Splits):
        splits = Splits(*out)
    else:
        got = f"a mapping with keys {sorted(map(str, out))}" if isinstance(out, Mapping) else type(out).__name__
        raise ConfigError(f"{key}={name} returned {got}; a dataset factory returns {form}.")
    for split, ds in (("training", splits.train), ("validation", splits.val)):
        if isinstance(ds, IterableDataset) or not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
            raise ConfigError(
                f"{key}={name}: the {split} dataset is a {type(ds).__name__}, not a map-style dataset (__len__ and "
                "__getitem__). ignite-mgpu samples map-style datasets, so that every rank gets its share of an "
                "epoch and validation counts every sample once; wrap the data in a map-style Dataset."
            )
    if splits.collate_fn is not None and not callable(splits.collate_fn):
        raise ConfigError(f"{key}={name} returned a collate_fn that is a {type(splits.collate_fn).__name__}.")
    return splits


def first_batch(dataset: Dataset, collate_fn: Callable[[list[Any]], Any] | None = None, n: int = 2) -> Any:
    """The first ``n`` items collated as the loaders collate them: what a batch of the job looks like."""
    items = [dataset[i] for i in range(min(n, len(dataset)))]  # type: ignore[arg-type]  # map-style
    return (collate_fn or default_collate)(items)


def example_inputs(dataset: Dataset, collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """The model's inputs for one sample (a batch of one): materialises lazy layers before DDP wraps the model."""
    batch = first_batch(dataset, collate_fn, 1)
    if isinstance(batch, Mapping):
        return {k: v for k, v in batch.items() if k not in batches.TARGET_KEYS}
    return batch[0]


def _builtin(cfg: DataConfig, num_classes: int, seed: int) -> tuple[Dataset, Dataset]:
    size = cfg.image_size
    if cfg.name == "synthetic":
        return (
            SyntheticImages(cfg.train_size, num_classes, size, seed, train=True),
            SyntheticImages(cfg.val_size, num_classes, size, seed, train=False),
        )
    import torchvision.transforms as T
    from torchvision import datasets

    if cfg.name == "fake":
        tf = T.ToTensor()
        shape = (3, size, size)
        return (
            datasets.FakeData(cfg.train_size, shape, num_classes, transform=tf, random_offset=seed),
            datasets.FakeData(cfg.val_size, shape, num_classes, transform=tf, random_offset=seed + 10**6),
        )
    root = Path(cfg.root or ".").expanduser().resolve()
    if cfg.name == "imagefolder":
        norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
        train_tf = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        val_tf = T.Compose([T.Resize(int(size * 1.14)), T.CenterCrop(size), T.ToTensor(), norm])
        return (
            _CheckedImageFolder(root / "train", train_tf, cfg.skip_bad_samples, seed),
            _CheckedImageFolder(root / "val", val_tf, cfg.skip_bad_samples),
        )
    gray = cfg.name in ("mnist", "fashion_mnist")
    tf = T.Compose(([T.Grayscale(3)] if gray else []) + [T.Resize(size), T.ToTensor()])
    cls = {"mnist": datasets.MNIST, "fashion_mnist": datasets.FashionMNIST, "cifar10": datasets.CIFAR10}[cfg.name]
    try:
        return (
            cls(str(root), train=True, transform=tf, download=cfg.download),
            cls(str(root), train=False, transform=tf, download=cfg.download),
        )
    # Torchvision: "Dataset not found. You can use download=True to download it"
    except RuntimeError as err:
        raise ConfigError(f"data.name={cfg.name}: {err} (looked in data.root={root}).") from None
