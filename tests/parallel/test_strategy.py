"""How a model is wrapped: DataParallel's per-replica losses reduced exactly and gathered without the scalar
warning, torch.compile's wrapper, unwrap, each strategy's gradient sync off (on a one-rank gloo group).
`python -m pytest tests/parallel/test_strategy.py`."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from ignite_mgpu.parallel.strategy import (
    LossDataParallel,
    find_ddp,
    model_devices,
    no_sync,
    prepare_model,
    reduce_replica_losses,
    unwrap,
)
from tests.helpers import cpu_fsdp, linear


def fake_data_parallel(n_devices):
    dp = nn.DataParallel.__new__(nn.DataParallel)
    nn.Module.__init__(dp)
    dp.device_ids = list(range(n_devices))
    return dp


@pytest.mark.parametrize("batch, n_devices", [(10, 4), (7, 3), (5, 4), (8, 2)])
def test_uneven_replica_losses_reduce_to_the_batch_loss(batch, n_devices):
    g = torch.Generator().manual_seed(batch)
    logits, y = torch.randn(batch, 5, generator=g), torch.randint(0, 5, (batch,), generator=g)
    # What DataParallel returns: one mean loss per replica, chunked as its scatter chunks (10 on 4 -> 3/3/3/1).
    per_replica = torch.stack(
        [
            nn.functional.cross_entropy(lc, yc)
            for lc, yc in zip(logits.chunk(n_devices), y.chunk(n_devices), strict=True)
        ]
    )
    with pytest.MonkeyPatch.context() as patch:
        # Issue #44 (6): no tensor built per step (on GPUs, a host-to-device copy): Python floats weight the losses.
        patch.setattr(torch, "tensor", lambda *a, **k: pytest.fail("torch.tensor on the step path"))
        reduced = reduce_replica_losses(per_replica, fake_data_parallel(n_devices), batch)
    torch.testing.assert_close(reduced, nn.functional.cross_entropy(logits, y))
    if batch % n_devices:
        assert not torch.allclose(per_replica.mean(), reduced)  # the plain mean would be wrong here


def test_dataparallel_gathers_replica_losses_without_the_scalar_warning(monkeypatch, recwarn):
    received = []

    def base_gather(self, outputs, output_device):  # stands in for the CUDA gather; torch warns on 0-dim inputs
        received.extend(outputs)
        if all(o.dim() == 0 for o in outputs):
            import warnings

            warnings.warn("Was asked to gather along dimension 0, but all input tensors were scalars", stacklevel=1)
        return torch.cat(outputs)

    monkeypatch.setattr(nn.DataParallel, "gather", base_gather)
    dp = LossDataParallel.__new__(LossDataParallel)
    out = dp.gather([torch.tensor(1.0), torch.tensor(2.0)], output_device=0)
    assert out.shape == (2,) and all(t.dim() == 1 for t in received)
    assert not [w for w in recwarn if "all input tensors were scalars" in str(w.message)]


def test_prepare_model_compiles_and_checkpoints_stay_clean():
    net = linear()
    compiled = prepare_model(net, compile=True)  # one process on a CPU: no DDP wrapper
    assert compiled is not net and unwrap(compiled) is net
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    with pytest.raises(ValueError, match="strategy='dp'.*needs CUDA"):
        prepare_model(linear(), strategy="dp")


def fake_parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    """What torch's parallel_apply does with autocast: each replica in a thread of its own, under
    autocast(device_type, enabled=...) WITHOUT a dtype, so the thread's default dtype applies. Here on the CPU."""
    import threading

    enabled, results = torch.is_autocast_enabled("cpu"), {}

    def work(i, module, inp):
        with torch.amp.autocast("cpu", enabled=enabled):
            results[i] = module(*inp)

    threads = [
        threading.Thread(target=work, args=(i, m, x)) for i, (m, x) in enumerate(zip(modules, inputs, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [results[i] for i in range(len(modules))]


class DtypeSeen(nn.Module):
    def forward(self, x):
        return torch.tensor(float(nn.functional.linear(x, torch.ones(2, 2)).dtype == torch.float16))


@pytest.mark.parametrize("wrapped", [False, True])
def test_every_replica_runs_under_the_callers_autocast_dtype(monkeypatch, wrapped):
    # The CPU's per-thread default autocast dtype is bf16 (CUDA's is fp16): a caller in fp16 shows the difference.
    import importlib

    data_parallel = importlib.import_module("torch.nn.parallel.data_parallel")  # the package shadows it by a function
    monkeypatch.setattr(data_parallel, "parallel_apply", fake_parallel_apply)
    dp = LossDataParallel.__new__(LossDataParallel if wrapped else nn.DataParallel)
    nn.Module.__init__(dp)
    dp.device_ids, dp.src_device_obj = [0, 1], torch.device("cpu")
    replicas, inputs = [DtypeSeen(), DtypeSeen()], [(torch.ones(1, 2),), (torch.ones(1, 2),)]
    with torch.autocast("cpu", dtype=torch.float16):
        fp16 = [float(o) for o in dp.parallel_apply(replicas, inputs, None)]
    assert fp16 == ([1.0, 1.0] if wrapped else [0.0, 0.0])  # plain DataParallel: the thread's default dtype
    assert [float(o) for o in dp.parallel_apply(replicas, inputs, None)] == [0.0, 0.0]  # no autocast: fp32


def test_unwrap_a_compiled_module_whose_truth_value_calls_len():
    net = nn.Sequential(nn.Linear(6, 3))
    compiled = torch.compile(net)
    assert unwrap(compiled) is net and unwrap(nn.DataParallel(compiled)) is net  # `or` on a module called len()
    assert find_ddp(compiled) is None


def test_no_sync_is_the_strategys_own(one_rank):
    """DDP's no_sync (also under torch.compile); nothing for DataParallel or a plain model. FSDP2's: below."""
    from torch.nn.parallel import DistributedDataParallel

    for model in (linear(), fake_data_parallel(2), torch.compile(linear())):
        assert no_sync(model) is contextlib.nullcontext  # they sync nothing: no context to enter
    ddp = DistributedDataParallel(linear())
    for wrapped in (ddp, torch.compile(ddp)):
        with no_sync(wrapped)():
            assert not ddp.require_backward_grad_sync
        assert ddp.require_backward_grad_sync


@cpu_fsdp
def test_no_sync_of_fsdp2_turns_its_gradient_sync_off(one_rank):
    from ignite_mgpu.parallel.fsdp import fully_shard  # torch.distributed.fsdp on torch >= 2.6

    plain = linear()
    sharded = fully_shard(copy.deepcopy(plain))
    g = torch.Generator().manual_seed(0)
    first, second = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    with no_sync(sharded)():
        sharded(first).sum().backward()
    assert all(p.grad is None for p in sharded.parameters())  # kept unsharded and local: nothing reduce-scattered
    sharded(second).sum().backward()  # synced again: the sum of both is reduce-scattered
    plain(first).sum().backward()
    plain(second).sum().backward()
    for p, q in zip(sharded.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad)


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_dataparallel_bf16_replicas_compute_in_bf16():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs for DataParallel to run replicas in threads")
    seen = []

    class Record(nn.Linear):
        def forward(self, x):
            out = super().forward(x)
            seen.append(out.dtype)
            return out

    dp = prepare_model(Record(4, 2), strategy="dp")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        dp(torch.ones(8, 4, device="cuda"))
    assert seen == [torch.bfloat16] * 2


def test_a_model_runs_on_the_ranks_device_not_its_parameters(monkeypatch):
    # Issue #44 (5): under FSDP's CPU offload the parameters are on the CPU while the step runs on the rank's GPU;
    # the memory report and the run's facts read model_devices. A device object needs no CUDA to exist.
    monkeypatch.setattr("ignite.distributed.device", lambda: torch.device("cuda", 3))
    assert model_devices(linear()) == [torch.device("cuda", 3)]
    assert model_devices(fake_data_parallel(2)) == [torch.device("cuda", 0), torch.device("cuda", 1)]
