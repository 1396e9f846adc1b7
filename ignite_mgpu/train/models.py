"""Models by name: the built-in small CNN and MLP, any torchvision.models name, or a "package.module:factory" of
the user's, called with ``model.args``."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins

if TYPE_CHECKING:
    from ignite_mgpu.config.schema import ModelConfig, OptimConfig


class SimpleCNN(nn.Module):
    """A small CNN for 32x32 (or larger) images: fast on a CPU, enough to learn the synthetic data."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Linear(32 * POOLED * POOLED, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(pool_to(self.features(x), POOLED), 1))


POOLED = 4  # SimpleCNN pools its features to 4x4, whatever the image size


def pool_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """``adaptive_avg_pool2d(x, size)``, as a plain average pool when the sides divide by ``size``: the same numbers,
    and unlike adaptive pooling its CUDA backward is deterministic (``train.deterministic`` runs it)."""
    h, w = x.shape[-2:]
    if h % size == 0 and w % size == 0:
        return F.avg_pool2d(x, (h // size, w // size))
    return F.adaptive_avg_pool2d(x, size)


def _mlp(num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(128), nn.ReLU(inplace=True), nn.Linear(128, num_classes))


BUILTIN = {"simple_cnn": SimpleCNN, "mlp": _mlp}


def check_model(cfg: ModelConfig) -> None:
    """ConfigError unless ``model.name`` resolves and takes ``model.args`` (in the parent, before spawning)."""
    factory = _resolve(cfg.name)
    plugins.check_arguments(factory, _kwargs(cfg, factory), f"model.name={cfg.name}", "model.args")


def _resolve(name: str) -> Callable[..., nn.Module]:
    """The constructor that ``name`` names: built-in, a torchvision.models builder, or a factory of the user's."""
    if name in BUILTIN:
        return BUILTIN[name]
    if plugins.is_factory(name):
        return plugins.resolve(name, "model.name")
    import torchvision

    available = torchvision.models.list_models(module=torchvision.models)
    if name in available:
        # weights=None: nothing is ever downloaded (a job, a test, CI may have no network).
        return functools.partial(torchvision.models.get_model_builder(name), weights=None)
    import difflib

    close = difflib.get_close_matches(name, list(BUILTIN) + available, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ConfigError(
        f"model.name={name} is not a known model.{hint} Use a built-in name ({', '.join(BUILTIN)}), a "
        f"torchvision.models name such as resnet18, or '{plugins.FORM}'."
    )


def _kwargs(cfg: ModelConfig, factory: Callable[..., nn.Module]) -> dict[str, Any]:
    """``model.args``, plus ``num_classes`` for a constructor that takes it."""
    kwargs = dict(cfg.args)
    if plugins.accepts(factory, "num_classes"):
        kwargs.setdefault("num_classes", cfg.num_classes)
    return kwargs


def create_model(cfg: ModelConfig, example: Any = None) -> nn.Module:
    """Build the model (randomly initialised, no downloaded weights) on the CPU: ``factory(**model.args)``, with
    ``num_classes=model.num_classes`` when the factory takes it.

    ``example`` (the inputs of one batch: a tensor, or a mapping of keyword arguments) materialises lazy layers
    such as ``nn.LazyLinear``: DDP refuses uninitialised parameters.
    """
    factory = _resolve(cfg.name)
    # In a worker: its exception is reported once, with its traceback.
    model = factory(**_kwargs(cfg, factory))
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name={cfg.name} returned a {type(model).__name__}; a model factory returns an nn.Module."
        )
    if example is not None and any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        with torch.no_grad():
            model(**example) if isinstance(example, Mapping) else model(example)
    return model


def check_factories(m: ModelConfig, loss: str, loss_args: Mapping[str, Any], o: OptimConfig) -> None:
    """The user's model, loss and optimizer factories called once before any worker starts, as the workers call them:
    the loss factory; the model built on the meta device (no memory, no initialisation) and the optimizer over its
    parameters (sgd and adamw over the model's own parameters, which refuse only an empty list, are not built: their
    first add_param_group imports torch._dynamo, a second or more in a launcher that never trains); what each returns
    checked. A factory that raises is a ConfigError with its traceback. A model that
    cannot be built on the meta device (it reads a tensor's value, loads weights) is said so and left, with its
    optimizer, to the workers."""
    from ignite_mgpu.config.checks import BUILTIN_LOSSES
    from ignite_mgpu.train.losses import create_loss
    from ignite_mgpu.train.optim import BUILTIN_OPTIMIZERS, create_optimizer, optim_options, optimizer_name

    if loss not in BUILTIN_LOSSES:
        create_loss(loss, loss_args, device="cpu")
    factory = _resolve(m.name)
    try:
        with torch.device("meta"):
            model = plugins.call(factory, _kwargs(m, factory), m.name, "model.name")
    except ConfigError as err:
        raised = err.__context__  # the factory's own exception (plugins.call says it without its context)
        if raised is None or "meta" not in str(raised).lower():
            raise
        print(
            f"ignite-mgpu: warning: model.name={m.name} cannot be built on the meta device ({raised}); it and its "
            "optimizer are checked in the workers instead.",
            file=sys.stderr,
        )
        return
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model.name={m.name} returned a {type(model).__name__}; a model factory returns an nn.Module."
        )
    if any(isinstance(p, nn.parameter.UninitializedParameter) for p in model.parameters()):
        return  # lazy layers: their shapes come from the first batch, in the workers
    if optimizer_name(o.name) in BUILTIN_OPTIMIZERS and not o.args and o.param_groups is None:
        if not any(p.requires_grad for p in model.parameters()):
            raise ConfigError(
                f"model.name={m.name} has no trainable parameters (all have requires_grad=False): optim.name={o.name} "
                "would train nothing. Leave requires_grad=True on the parameters to train."
            )
        return
    with torch.device("meta"):
        create_optimizer(model, **optim_options(o), distributed=False)
