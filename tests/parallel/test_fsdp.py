"""FSDP2 in one process: the default block rule over real architectures, fsdp_blocks checks, the precision mapping,
and (on a one-rank gloo group) the full-state adapters, gradient-sync switching and unwrap. The real 2-process jobs
are in tests/distributed/test_fsdp.py. `python -m pytest tests/parallel/test_fsdp.py`."""

import pytest
import torch
import torchvision
from torch import nn

from ignite_mgpu.checkpoint.load import check_model_state
from ignite_mgpu.checkpoint.state import FullModelState, FullOptimizerState, checkpoint_objects
from ignite_mgpu.errors import ConfigError
from ignite_mgpu.parallel import fsdp
from ignite_mgpu.parallel.fsdp import (
    check_blocks,
    default_blocks,
    find_fsdp,
    fully_shard,  # torch.distributed.fsdp on torch >= 2.6
    mixed_precision,
    no_sync_of,
)
from ignite_mgpu.parallel.strategy import prepare_model, unwrap
from ignite_mgpu.train.models import SimpleCNN, create_model
from tests.helpers import cpu_fsdp


def on_meta(build):
    with torch.device("meta"):
        return build()


@pytest.mark.parametrize(
    "build, blocks",
    [
        (lambda: torchvision.models.resnet18(), ["BasicBlock"]),  # layer1..4: Sequentials of BasicBlock
        (lambda: torchvision.models.resnet50(), ["Bottleneck"]),
        (lambda: torchvision.models.vit_b_16(), ["EncoderBlock"]),  # not the Linears of its MLPBlock, deeper down
        (
            lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, batch_first=True), num_layers=3),
            ["TransformerEncoderLayer"],
        ),
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), ["Linear"]),  # an MLP
        (lambda: SimpleCNN(), ["Conv2d"]),  # features: Conv2d, ReLU, MaxPool2d, Conv2d, ReLU
        (lambda: nn.Linear(4, 2), []),  # nothing repeated: only the root is sharded
    ],
)
def test_the_default_rule_finds_the_repeated_blocks(build, blocks):
    assert default_blocks(on_meta(build)) == blocks


def test_fsdp_blocks_must_name_classes_of_the_model():
    model = create_model(load_model_config("mlp"))  # LazyLinear before its first forward: it becomes Linear
    check_blocks(model, ["Linear"])
    with pytest.raises(ConfigError, match=r"model.fsdp_blocks names Blok, but model.name=mlp contains no module of"):
        check_blocks(model, ["Blok", "Linear"], "mlp")


def load_model_config(name):
    from ignite_mgpu.config.loading import load_config

    return load_config(overrides=[f"model.name={name}"]).model


def test_precision_becomes_fsdp_mixed_precision():
    assert mixed_precision("fp32").param_dtype is None
    bf16 = mixed_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)  # fp32 gradient reduction
    assert mixed_precision("fp16").param_dtype == torch.float16


def test_one_process_shards_nothing_and_places_the_model():
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model = prepare_model(net, "fsdp")
    assert model is net and find_fsdp(model) is None
    with pytest.raises(ConfigError, match="model.fsdp_blocks names Nope"):
        prepare_model(nn.Linear(2, 2), "fsdp", fsdp_blocks=["Nope"])
    with pytest.raises(ValueError, match="sync_batchnorm"):
        prepare_model(nn.Linear(2, 2), "fsdp", sync_batchnorm=True)


def sharded(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    plain = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    plain.load_state_dict(model.state_dict())
    for block in (model[0], model[2]):
        fully_shard(block)
    fully_shard(model)
    return model, plain


def step(model, optimizer, seed=1):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


@cpu_fsdp
def test_full_state_is_the_plain_state_and_loads_back(one_rank):
    model, plain = sharded()
    assert unwrap(model) is model and find_fsdp(model) is model and type(model).__name__ == "FSDPSequential"
    opt, plain_opt = torch.optim.AdamW(model.parameters()), torch.optim.AdamW(plain.parameters())
    step(model, opt)
    step(plain, plain_opt)
    model_state, optimizer_state = checkpoint_objects(model, opt)
    assert isinstance(model_state, FullModelState) and isinstance(optimizer_state, FullOptimizerState)
    full, full_opt = model_state.state_dict(), optimizer_state.state_dict()
    torch.testing.assert_close(full, plain.state_dict())  # plain tensors, the module's own names
    expected = plain_opt.state_dict()
    assert full_opt["param_groups"] == expected["param_groups"]  # indices, as optimizer.state_dict() keys them
    torch.testing.assert_close(full_opt["state"], expected["state"])
    check_model_state(model, full, "checkpoint")  # keys and (global) shapes of the sharded module match

    # Another initialisation, no optimizer state yet: both come from the checkpoint. On one rank the gathered
    # tensors are the shards themselves (nothing to gather), so load copies, as a file read from disk would be.
    other, _ = sharded(seed=5)
    other_opt = torch.optim.AdamW(other.parameters())
    FullModelState(other).load_state_dict({k: v.clone() for k, v in full.items()})
    copied = {i: {k: v.clone() for k, v in s.items()} for i, s in full_opt["state"].items()}
    FullOptimizerState(other, other_opt).load_state_dict({**full_opt, "state": copied})
    step(other, other_opt, seed=2)
    step(model, opt, seed=2)
    torch.testing.assert_close(FullModelState(other).state_dict(), FullModelState(model).state_dict())


def test_accumulation_steps_turn_gradient_sync_off(one_rank):
    model, _ = sharded()
    calls = []
    original = model.set_requires_gradient_sync
    model.set_requires_gradient_sync = lambda flag, **kw: (calls.append(flag), original(flag, **kw))[1]
    with no_sync_of(model)():
        calls.append("backward")
    assert calls == [False, "backward", True]


def test_a_worker_refuses_to_shard_over_the_cpu_where_pytorch_runs_fsdp2_only_on_cuda(monkeypatch):
    # The pre-flight refuses it before spawning (tests/test_cli.py); launch()'s own code meets it here.
    monkeypatch.setattr(fsdp, "runs_on_cpu", lambda: False)
    monkeypatch.setattr("ignite.distributed.get_world_size", lambda: 2)
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: pytest.fail("sharded"))
    with pytest.raises(ConfigError, match=r"strategy=fsdp with 2 processes on the CPU needs PyTorch 2\.6 or newer"):
        fsdp.shard_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    fsdp.check_device("cuda", 2)  # only the CPU is refused
    fsdp.check_device("cpu", 1)  # one process shards nothing


def test_cpu_offload_shards_over_a_group_with_a_cpu_backend(monkeypatch):
    # Issue #44 (9): offloaded gradients are CPU DTensors; clipping and fp16's found-inf check all-reduce them over
    # the mesh's group, which needs a CPU backend beside NCCL. Seen here through stand-ins (NCCL needs a GPU).
    from torch.distributed.device_mesh import DeviceMesh

    made = []
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.distributed, "new_group", lambda backend=None, **_: made.append(backend) or "group")
    monkeypatch.setattr(DeviceMesh, "from_group", staticmethod(lambda group, device_type: (group, device_type)))
    monkeypatch.setattr(fsdp, "_OFFLOAD_MESHES", {})
    assert fsdp.offload_mesh() == ("group", "cuda") and made == ["cuda:nccl,cpu:gloo"]
    assert fsdp.offload_mesh() == ("group", "cuda") and len(made) == 1  # one group for the job, not one a model
    assert fsdp.offload_backend("gloo") is None  # gloo's own group handles CPU tensors
    sharded = []
    monkeypatch.setattr("ignite.distributed.get_world_size", lambda: 2)
    monkeypatch.setattr("ignite.distributed.device", lambda: torch.device("cuda", 0))  # NCCL's, as the group above
    monkeypatch.setattr(fsdp, "offload_mesh", lambda: "the offload mesh")
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kw: sharded.append(kw))
    fsdp.shard_model(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), cpu_offload=True)
    assert len(sharded) == 3 and all(kw["mesh"] == "the offload mesh" for kw in sharded)
