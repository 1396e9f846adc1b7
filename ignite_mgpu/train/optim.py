"""The optimizer and the learning-rate schedule (``optim:`` in the config): sgd (Nesterov) and adamw, cosine and
constant as they always were, any ``torch.optim`` / ``torch.optim.lr_scheduler`` class by its name, or a factory of
the user's. ``check_optim`` checks names and arguments in the parent; the pre-flight imports this module, so ignite
is imported only when an optimizer is built."""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer, lr_scheduler
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau, SequentialLR

from ignite_mgpu.config.schema import OPTIMIZERS, SCHEDULES
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.train import plugins
from ignite_mgpu.train.param_groups import parameter_groups

if TYPE_CHECKING:
    from ignite_mgpu.config.schema import OptimConfig

BUILTIN_OPTIMIZERS = OPTIMIZERS  # sgd (Nesterov), adamw
BUILTIN_SCHEDULES = SCHEDULES  # LambdaLR: the linear warm-up and then the shape, one function
# Given by their own keys to every optimizer that takes them; optim.args may not give them a second value.
OWN_KEYS = {"lr": "optim.lr", "weight_decay": "optim.weight_decay", "momentum": "optim.momentum"}
REFUSED_OPTIMIZERS = {
    "LBFGS": "its step() needs a closure that evaluates the model again, and a training step calls step() without one",
}
_NEEDS_CODE = "it takes {what}, which YAML cannot hold: build it in a 'package.module:factory' (optimizer, **args)"
REFUSED_SCHEDULERS = {
    "ReduceLROnPlateau": "it steps on a validation metric, and ignite-mgpu steps the schedule once per optimizer step; "
    "use a schedule of steps (StepLR, MultiStepLR, CosineAnnealingLR, ...)",
    "LambdaLR": _NEEDS_CODE.format(what="a Python function"),
    "MultiplicativeLR": _NEEDS_CODE.format(what="a Python function"),
    "SequentialLR": _NEEDS_CODE.format(what="other schedulers"),
    "ChainedScheduler": _NEEDS_CODE.format(what="other schedulers"),
}
# Schedules whose length is the run's: the argument that is filled with the optimizer steps after the warm-up, and
# the arguments whose presence in optim.scheduler_args leaves it to the user.
RUN_LENGTH = {
    "OneCycleLR": ("total_steps", ("total_steps", "epochs", "steps_per_epoch")),
    "PolynomialLR": ("total_iters", ("total_iters",)),
    "CosineAnnealingLR": ("T_max", ("T_max",)),
}


def create_optimizer(
    model: nn.Module,
    name: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool = True,
    *,
    args: Mapping[str, Any] | None = None,
    no_decay_norm_and_bias: bool = False,
    param_groups: str | None = None,
    distributed: bool = True,
) -> Optimizer:
    """The optimizer over the trainable parameters of a prepared model (DDP, DataParallel, FSDP2 or plain), wrapped by
    ``idist.auto_optim`` (``distributed=False``: not wrapped, which asks no process group: the memory plan and the
    pre-flight build it so). ``optim_options(section)`` gives the ``optim:`` section's arguments.

    ``name``: "sgd" (SGD, Nesterov momentum when ``nesterov`` and ``momentum > 0``), "adamw", a ``torch.optim`` class
    name ("Adam", "RMSprop", ...) or "package.module:factory", called as ``factory(param_groups, lr=..., **args)``.
    Every optimizer gets ``lr``, and ``weight_decay`` when it takes it (one that does not needs ``weight_decay=0``);
    ``momentum`` goes to those with a parameter of that name. ``args`` (``optim.args``) adds keyword arguments.
    ``no_decay_norm_and_bias`` and ``param_groups`` (a factory ``model -> groups``) make the groups
    (``param_groups.py``).
    """
    extra, name = dict(args or {}), optimizer_name(name)
    fn = optimizer_factory(name)
    kwargs = _optimizer_kwargs(fn, name, lr, momentum, weight_decay, nesterov, extra)
    _check_call(fn, kwargs, extra, f"optim.name={name}", "optim.args")
    groups = parameter_groups(model, no_decay_norm_and_bias, param_groups)
    opt = plugins.call(functools.partial(fn, groups), kwargs | extra, name, "optim.name")
    if not isinstance(opt, Optimizer):
        raise ConfigError(f"optim.name={name} returned a {type(opt).__name__}, not a torch.optim.Optimizer.")
    if not distributed:
        return opt
    import ignite.distributed as idist

    return idist.auto_optim(opt)


def create_lr_scheduler(
    optimizer: Optimizer,
    total_steps: int,
    warmup_steps: int,
    cosine: bool = True,
    *,
    scheduler: str | None = None,
    scheduler_args: Mapping[str, Any] | None = None,
) -> LRScheduler:
    """Linear warm-up over ``warmup_steps``, then the schedule, for ``total_steps`` optimizer steps in all; the trainer
    steps it once per optimizer step taken.

    ``scheduler``: "cosine" or "constant" (None: as ``cosine`` says), a ``torch.optim.lr_scheduler`` class name
    ("OneCycleLR", "StepLR", ...) or "package.module:factory", called as ``factory(optimizer, **scheduler_args)``.
    Arguments that are the run's length are filled with the steps after the warm-up unless ``scheduler_args`` gives
    them: OneCycleLR's ``total_steps`` (and ``max_lr``: each group's learning rate), PolynomialLR's
    ``total_iters``, CosineAnnealingLR's ``T_max``, a factory's ``total_steps`` parameter. A class or factory runs
    after the warm-up through ``torch.optim.lr_scheduler.SequentialLR``.
    """
    name = scheduler if scheduler is not None else "cosine" if cosine else "constant"
    if name in BUILTIN_SCHEDULES:
        shape = functools.partial(_warmup_cosine, warmup=warmup_steps, total=total_steps, cosine=name == "cosine")
        return LambdaLR(optimizer, shape)
    peaks = [group["lr"] for group in optimizer.param_groups]  # before any schedule changes them
    # The warm-up first: a schedule's constructor may set the groups' initial_lr (OneCycleLR's max_lr / div_factor),
    # and the warm-up must climb to the learning rate the optimizer was given.
    ramp = functools.partial(_warmup_cosine, warmup=warmup_steps, total=warmup_steps, cosine=False)
    warmup = LambdaLR(optimizer, ramp) if warmup_steps else None
    main = _schedule(optimizer, name, dict(scheduler_args or {}), max(1, total_steps - warmup_steps), peaks)
    return main if warmup is None else SequentialLR(optimizer, [warmup, main], milestones=[warmup_steps])


def optim_options(o: OptimConfig) -> dict[str, Any]:
    """``create_optimizer``'s arguments from the ``optim:`` section."""
    return {
        "name": o.name,
        "lr": o.lr,
        "momentum": o.momentum,
        "weight_decay": o.weight_decay,
        "nesterov": o.nesterov,
        "args": o.args,
        "no_decay_norm_and_bias": o.no_decay_norm_and_bias,
        "param_groups": o.param_groups,
    }


def check_optim(o: OptimConfig) -> None:
    """ConfigError unless ``optim.name`` and ``optim.scheduler`` name what exists and take ``optim.args`` /
    ``optim.scheduler_args``, and ``optim.param_groups`` imports; in the parent, before spawning."""
    args, name = dict(o.args), optimizer_name(o.name)
    fn = optimizer_factory(name)
    _check_call(
        fn,
        _optimizer_kwargs(fn, name, o.lr, o.momentum, o.weight_decay, o.nesterov, args),
        args,
        f"optim.name={o.name}",
        "optim.args",
    )
    if o.param_groups is not None:
        plugins.resolve(o.param_groups, "optim.param_groups")
    if o.scheduler not in BUILTIN_SCHEDULES:
        schedule, sargs = scheduler_factory(o.scheduler), dict(o.scheduler_args)
        # The names only: the steps are the workers'
        filled = _filled(schedule, o.scheduler, sargs, 1, [o.lr])
        _check_call(schedule, filled, sargs, f"optim.scheduler={o.scheduler}", "optim.scheduler_args")


def optimizer_name(name: str) -> str:
    """``optim.name`` as the code spells it, whatever its case: a built-in (``Sgd`` -> sgd, ``ADAMW`` -> adamw) or a
    torch.optim class (``adam`` -> Adam, ``rmsprop`` -> RMSprop). A name written exactly stays as written: ``SGD`` is
    torch's class (classic momentum), ``sgd`` the built-in (Nesterov)."""
    if name in BUILTIN_OPTIMIZERS or plugins.is_factory(name) or isinstance(getattr(torch.optim, name, None), type):
        return name
    by_case = {n.lower(): n for n in _classes(torch.optim, Optimizer)} | {n: n for n in BUILTIN_OPTIMIZERS}
    return by_case.get(name.lower(), name)


def optimizer_factory(name: str) -> Callable[..., Any]:
    """The class or factory that ``optim.name`` names (in any case: ``optimizer_name``)."""
    name = optimizer_name(name)
    if name == "sgd":
        return torch.optim.SGD
    if name == "adamw":
        return torch.optim.AdamW
    if plugins.is_factory(name):
        return plugins.resolve(name, "optim.name")
    return _torch_class(torch.optim, Optimizer, name, "optim.name", REFUSED_OPTIMIZERS, list(BUILTIN_OPTIMIZERS))


def scheduler_factory(name: str) -> Callable[..., Any]:
    """The class or factory that ``optim.scheduler`` names (not cosine or constant)."""
    if plugins.is_factory(name):
        return plugins.resolve(name, "optim.scheduler")
    return _torch_class(lr_scheduler, LRScheduler, name, "optim.scheduler", REFUSED_SCHEDULERS, list(BUILTIN_SCHEDULES))


def _torch_class(
    module: Any, base: type, name: str, key: str, refused: Mapping[str, str], builtin: list[str]
) -> Callable[..., Any]:
    """``module.<name>``, a subclass of ``base``, by its name in any case (``onecyclelr``: OneCycleLR); else a
    ConfigError with the closest names (case aside)."""
    classes = _classes(module, base)
    name = {n.lower(): n for n in classes}.get(name.lower(), name) if name not in classes else name
    if name in refused:
        raise ConfigError(f"{key}={name} is not supported: {refused[name]}.")
    if name in classes:
        return getattr(module, name)
    usable = builtin + [n for n in classes if n not in refused]
    lower = {n.lower(): n for n in usable}
    close = [lower[n] for n in difflib.get_close_matches(name.lower(), list(lower), n=3, cutoff=0.6)]
    said = f"{', '.join(close[:-1])} or {close[-1]}" if len(close) > 1 else "".join(close)
    hint = f" Did you mean {said}?" if close else ""
    raise ConfigError(
        f"{key}={name} is not known.{hint} Use {', '.join(builtin)}, a class of {module.__name__} by its name, any "
        f"case ({', '.join(n for n in classes if n not in refused)}), or '{plugins.FORM}' for your own."
    )


def _classes(module: Any, base: type) -> list[str]:
    """The public subclasses of ``base`` in ``module``, by name."""
    return sorted(
        n
        for n, c in vars(module).items()
        if isinstance(c, type) and issubclass(c, base) and c is not base and not n.startswith("_")
    )


def _names(fn: Callable[..., Any], parameter: str) -> bool:
    """Whether ``fn`` has a parameter called ``parameter`` (not only ``**kwargs``)."""
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _optimizer_kwargs(
    fn: Callable[..., Any],
    name: str,
    lr: float,
    momentum: float,
    weight_decay: float,
    nesterov: bool,
    args: Mapping[str, Any],
) -> dict[str, Any]:
    """The keyword arguments that the config's own keys give the optimizer (``args`` go on top of them)."""
    for key, own in OWN_KEYS.items():
        if key in args:
            raise ConfigError(
                f"optim.args.{key}={args[key]} gives what {own} gives every optimizer: set {own}={args[key]} and "
                f"remove optim.args.{key}."
            )
    if name == "sgd" and "nesterov" in args:
        raise ConfigError("optim.args.nesterov with optim.name=sgd: set optim.nesterov instead.")
    if not plugins.accepts(fn, "lr"):
        raise ConfigError(
            f"optim.name={name} takes no lr argument, and every optimizer gets optim.lr: give the factory an lr "
            "parameter."
        )
    kwargs: dict[str, Any] = {"lr": lr}
    if plugins.accepts(fn, "weight_decay"):
        kwargs["weight_decay"] = weight_decay
    elif weight_decay:
        raise ConfigError(
            f"optim.name={name} takes no weight_decay, but optim.weight_decay={weight_decay}: set optim.weight_decay=0."
        )
    if _names(fn, "momentum"):
        kwargs["momentum"] = momentum
    if name == "sgd":
        kwargs["nesterov"] = nesterov and momentum > 0
    return kwargs


def _check_call(fn: Callable[..., Any], given: Mapping[str, Any], args: Mapping[str, Any], name: str, key: str) -> None:
    """ConfigError unless ``fn(first, **given, **args)`` binds: ``args`` are what the user wrote under ``key``."""
    plugins.check_arguments(functools.partial(fn, None, **given), args, name, key)


def _filled(
    fn: Callable[..., Any], name: str, args: Mapping[str, Any], steps: int, peaks: list[float]
) -> dict[str, Any]:
    """The schedule's arguments that the run fills (RUN_LENGTH), unless ``args`` gives them."""
    if name in RUN_LENGTH:
        key, given = RUN_LENGTH[name]
        filled: dict[str, Any] = {} if any(k in args for k in given) else {key: steps}
        if name == "OneCycleLR" and "max_lr" not in args:
            filled["max_lr"] = peaks[0] if len(set(peaks)) == 1 else peaks
        return filled
    if plugins.is_factory(name) and _names(fn, "total_steps") and "total_steps" not in args:
        return {"total_steps": steps}
    return {}


def _schedule(optimizer: Optimizer, name: str, args: dict[str, Any], steps: int, peaks: list[float]) -> LRScheduler:
    """The schedule after the warm-up, over ``steps`` optimizer steps."""
    fn = scheduler_factory(name)
    filled = _filled(fn, name, args, steps, peaks)
    _check_call(fn, filled, args, f"optim.scheduler={name}", "optim.scheduler_args")
    schedule = plugins.call(functools.partial(fn, optimizer), filled | args, name, "optim.scheduler")
    if isinstance(schedule, ReduceLROnPlateau) or not isinstance(schedule, LRScheduler):
        raise ConfigError(
            f"optim.scheduler={name} returned a {type(schedule).__name__}; a scheduler factory returns a "
            "torch.optim.lr_scheduler.LRScheduler of the optimizer it is given, stepped once per optimizer step "
            "(not ReduceLROnPlateau)."
        )
    if schedule.optimizer is not optimizer:
        raise ConfigError(
            f"optim.scheduler={name} returned a scheduler of another optimizer than the one it was given."
        )
    return schedule


def _warmup_cosine(step: int, warmup: int, total: int, cosine: bool) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))
