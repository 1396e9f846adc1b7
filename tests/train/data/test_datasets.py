"""Datasets: deterministic synthetic data, size checks, torchvision and image folders, the user's factories.
`python -m pytest tests/train/data/test_datasets.py`."""

import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ignite_mgpu.config.schema import DataConfig
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train.data.datasets import SyntheticImages, build_datasets, check_sizes, example_inputs, first_batch


def test_synthetic_is_deterministic_and_class_dependent():
    a = SyntheticImages(64, 10, 16, seed=1, train=True)
    b = SyntheticImages(64, 10, 16, seed=1, train=True)
    assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
    val = SyntheticImages(64, 10, 16, seed=1, train=False)
    assert not torch.equal(a.images, val.images)  # a different split, same class patterns
    means = torch.stack([a.images[a.targets == c].mean(0) for c in a.targets.unique()])
    assert means.std(0).mean() > 0.05  # class means differ: learnable, not pure noise


def test_size_checks():
    train, val = list(range(100)), list(range(10))
    check_sizes(train, val, batch_size=64, world_size=2)
    check_sizes(train, val, batch_size=64, world_size=3)  # uneven shares: 22 + 21 + 21
    with pytest.raises(ConfigError, match=r"split over 3 processes: each needs at least one.*data.batch_size=3 or"):
        check_sizes(train, val, batch_size=2, world_size=3)
    with pytest.raises(ConfigError, match="only has 50 training samples"):
        check_sizes(train, val, batch_size=128, world_size=2)
    with pytest.raises(ConfigError, match="validation dataset is empty"):
        check_sizes(train, [], batch_size=8, world_size=1)
    with pytest.raises(ConfigError, match="has 2 sample.s., fewer than the 4 processes"):
        check_sizes(train, val[:2], batch_size=8, world_size=4)


def test_imagefolder_names_a_corrupt_file_or_skips_it(tmp_path):
    for split in ("train", "val"):
        for cls in ("a", "b"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            Image.new("RGB", (12, 12), color=(10, 20, 30)).save(folder / "ok.png")
    bad = tmp_path / "train" / "a" / "broken.png"
    bad.write_bytes(b"not an image")
    cfg = DataConfig(name="imagefolder", root=str(tmp_path), image_size=8)
    train = build_datasets(cfg, 2, 0).train
    index = [i for i, (p, _) in enumerate(train.inner.samples) if p.endswith("broken.png")][0]
    with pytest.raises(RuntimeError, match=r"cannot read image .*broken.png.*data.skip_bad_samples=true"):
        train[index]
    cfg.skip_bad_samples = True
    train = build_datasets(cfg, 2, 0).train
    assert train[index] is None and train[(index + 1) % len(train)][0].shape == (3, 8, 8)


def test_imagefolder_augmentation_follows_the_sample_and_epoch_not_the_process(tmp_path):
    """Random crops and flips of the built-in image folder are a function of (seed, epoch, index): the same on
    whichever rank serves a sample (a resume on another process count), new each epoch, seen by persistent loader
    workers, and the process's own generator (dropout) is not touched."""
    noise = torch.Generator().manual_seed(0)
    for split in ("train", "val"):
        for cls in ("a", "b"):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for k in range(2):
                pixels = torch.randint(0, 256, (24, 24, 3), generator=noise, dtype=torch.uint8).numpy()
                Image.fromarray(pixels).save(folder / f"{k}.png")
    cfg = DataConfig(name="imagefolder", root=str(tmp_path), image_size=8)
    one, other = build_datasets(cfg, 2, seed=5).train, build_datasets(cfg, 2, seed=5).train
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    epoch0 = [one[i][0] for i in range(4)]
    assert torch.equal(torch.rand(3), expected_next)  # the process's generator is untouched
    torch.manual_seed(999)  # another process's state: no effect on a sample
    assert all(torch.equal(other[i][0], epoch0[i]) for i in reversed(range(4)))
    other.set_epoch(1)
    epoch1 = [other[i][0] for i in range(4)]
    assert not all(torch.equal(a, b) for a, b in zip(epoch0, epoch1, strict=True))  # a new draw each epoch
    assert not torch.equal(build_datasets(cfg, 2, seed=6).train[0][0], epoch0[0])  # and each seed
    loader = DataLoader(one, batch_size=4, num_workers=1, persistent_workers=True)
    for epoch, want in ((0, epoch0), (1, epoch1)):
        one.set_epoch(epoch)
        ((images, _),) = list(loader)
        assert torch.equal(images, torch.stack(want))


def test_torchvision_dataset_missing_without_download(tmp_path):
    with pytest.raises(ConfigError, match="data.name=mnist.*looked in"):
        build_datasets(DataConfig(name="mnist", root=str(tmp_path)), 10, 0)


# --- dataset factories ----------------------------------------------------------------------------------------

PKG = "tests.plugins_pkg.factories"


def test_a_factory_with_arguments_from_yaml_and_dotted_overrides(tmp_path):
    from ignite_mgpu.config.loading import load_config

    (tmp_path / "job.yaml").write_text(f"data:\n  name: {PKG}:pairs\n  args: {{n: 24, val: 6}}\n")
    cfg = load_config(tmp_path / "job.yaml", ["data.args.val=5"])
    splits = build_datasets(cfg.data, 3, 0)
    assert (len(splits.train), len(splits.val), splits.collate_fn) == (24, 5, None)


def test_a_factory_may_return_a_mapping_and_its_collate_function():
    splits = build_datasets(DataConfig(name=f"{PKG}:dicts", args={"collate": True}), 3, 0)
    assert splits.collate_fn is not None and first_batch(splits.train, splits.collate_fn)["n"] == 2
    assert list(example_inputs(splits.train, splits.collate_fn)) == ["x", "n"]  # the targets are not inputs


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("wrong_return", {}, r"returned list; a dataset factory returns \(train, val\)"),
        ("iterable", {}, r"the training dataset is a Stream, not a map-style dataset"),
        ("pairs", {"size": 3}, r"data.args gives size, which .* does not accept \(it takes: n, val\)"),
        ("raises", {}, r"calling it raised ValueError: cannot open shard 40"),
    ],
)
def test_a_factory_that_gives_something_else_is_a_config_error(name, args, message):
    with pytest.raises(ConfigError, match=message):
        build_datasets(DataConfig(name=f"{PKG}:{name}", args=args), 3, 0)


def test_data_args_without_a_factory_is_an_error():
    from ignite_mgpu.config.loading import load_config

    with pytest.raises(ConfigError, match="data.args is for a dataset factory"):
        load_config(overrides=["data.args.n=3"])
    with pytest.raises(ConfigError, match=r"config key 'data.name' = 'cifar' is invalid"):
        load_config(overrides=["data.name=cifar"])
