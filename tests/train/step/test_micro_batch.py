"""train.micro_batch in one process: the split, the weighting, the out-of-memory classification and the shrink rule,
and a real CPU allocator failure retried with smaller parts. `python -m pytest tests/train/step/test_micro_batch.py
-q`."""

from __future__ import annotations

import json

import ignite.distributed as idist
import pytest
import torch
from ignite.engine import Engine, Events
from torch import nn

from ignite_mgpu.train.evaluator import create_evaluator, validation_metrics
from ignite_mgpu.train.step.micro_batch import (
    MicroBatching,
    counted_items,
    is_out_of_memory,
    next_size,
    padded,
    remember,
    remembered_size,
    split_batch,
)
from ignite_mgpu.train.step.trainer import create_trainer

TOO_MUCH = 2**62  # bytes: no allocator can give them, so asking raises its real out-of-memory error


def real_cpu_oom() -> RuntimeError:
    try:
        torch.empty(TOO_MUCH, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("the allocator gave 4 EiB")


def test_out_of_memory_is_recognised_by_type_and_by_the_allocators_message():
    assert is_out_of_memory(real_cpu_oom())  # "DefaultCPUAllocator: can't allocate memory: you tried to ..."
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("not enough memory: you tried to allocate 8 bytes"))
    # Issue #44 (12): as Lightning counts them: cuDNN's and cuBLAS's failures, CUDA's own error outside the allocator
    assert is_out_of_memory(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."))
    assert is_out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be ..."))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))  # only the allocators' RuntimeErrors
    assert not is_out_of_memory(KeyboardInterrupt())


def test_the_shrink_rule_halves_rounding_up_and_stops_after_one():
    sizes, size = [], 10
    while size:
        sizes.append(size)
        size = next_size(size)
    assert sizes == [10, 5, 3, 2, 1]


def test_split_keeps_every_sample_once_and_shares_what_is_not_per_sample():
    x, y, w = torch.arange(10.0)[:, None], torch.arange(10), torch.ones(3)
    parts = split_batch((x, y, w, "tag"), 10, 4)
    assert [k for _, k in parts] == [4, 4, 2]
    assert torch.equal(torch.cat([p[0] for p, _ in parts]), x) and all(p[2] is w and p[3] == "tag" for p, _ in parts)
    mapping = split_batch({"input_ids": x, "labels": y}, 10, 3)
    assert [len(p["labels"]) for p, _ in mapping] == [3, 3, 3, 1]
    assert split_batch((x, y), 10, 10)[0][0] == (x, y) and split_batch((x, y), 10, 64)[0][1] == 10
    assert counted_items({"labels": torch.tensor([[1, -100], [2, 3]])}) == 3 and counted_items((x, y)) is None


def test_padding_parts_count_nothing_and_are_one_sample_or_none():
    batch = (torch.arange(5.0), torch.arange(5), "shared")
    parts = padded(split_batch(batch, 5, 2), batch, 5, 4, empty=False)
    assert [k for _, k in parts] == [2, 2, 1, 0]
    assert parts[-1][0][0].tolist() == [0.0] and parts[-1][0][2] == "shared"  # the first sample again
    empty = padded(split_batch(batch, 5, 2), batch, 5, 5, empty=True)
    assert [len(p[0]) for p, _ in empty] == [2, 2, 1, 0, 0] and [k for _, k in empty][3:] == [0, 0]
    assert [k for _, k in padded(split_batch(batch, 5, 2), batch, 5, 2, empty=False)] == [2, 2, 1]  # never fewer


def test_the_remembered_size_keeps_the_smallest_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "micro_batch.json"
    remember(path, 8)
    remember(path, 16)  # a rank that saw less: the smaller size stays
    assert json.loads(path.read_text()) == {"micro_batch": 8} and MicroBatching("auto", path).size == 8
    path.write_text("{broken")
    assert remembered_size(path) is None and MicroBatching("auto", path).size is None
    assert MicroBatching(4, path).size == 4  # a fixed size never reads the file
    with pytest.raises(ValueError, match="micro_batch=0"):
        MicroBatching(0)


class Greedy(nn.Module):
    """An MLP whose forward asks for memory no allocator has when it sees more than ``fits`` samples."""

    def __init__(self, fits: int = 1_000_000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        self.fits, self.seen = fits, []

    def forward(self, x):
        self.seen.append(len(x))
        if len(x) > self.fits:
            torch.empty(TOO_MUCH, dtype=torch.uint8)
        return self.net(x)


def train(micro_batch, fits=1_000_000, accum=1, clip=None, path=None, epochs=2):
    torch.manual_seed(1)
    data = [(torch.randn(10, 6), torch.randint(0, 3, (10,))) for _ in range(4)]
    model = Greedy(fits)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_trainer(
        model, opt, nn.CrossEntropyLoss(), grad_accum_steps=accum, clip_grad_norm=clip, micro_batch=micro_batch,
        micro_batch_file=path,
    )  # fmt: skip
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(float(e.state.output)))
    trainer.run(data, max_epochs=epochs)
    return model, trainer, losses


@pytest.mark.parametrize(("accum", "clip"), [(1, None), (2, 0.05)])
def test_parts_weighted_by_their_samples_give_the_whole_batch_gradient(accum, clip):
    whole, _, whole_losses = train(None, accum=accum, clip=clip)
    for size in (3, 4, 10):  # 10 in parts of 3: 3, 3, 3, 1 (a size that does not divide)
        parts, _, losses = train(size, accum=accum, clip=clip)
        expected = [min(size, 10 - s) for s in range(0, 10, size)]
        assert parts.seen[: len(expected)] == expected
        for a, b in zip(whole.parameters(), parts.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert losses == pytest.approx(whole_losses, abs=1e-6)


def test_auto_retries_the_same_batch_after_a_real_out_of_memory_and_remembers(tmp_path):
    path = tmp_path / "micro_batch.json"
    auto, trainer, _ = train("auto", fits=4, accum=2, path=path)
    assert auto.seen[:6] == [10, 5, 3, 3, 3, 1]  # 10 and 5 ran out: the same batch again, in parts of 3
    assert trainer.step.micro_batching.size == 3 and json.loads(path.read_text()) == {"micro_batch": 3}
    fixed, _, _ = train(3, accum=2)
    for a, b in zip(auto.parameters(), fixed.parameters(), strict=True):  # the failed attempts left nothing behind
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    again, trainer, _ = train("auto", fits=4, accum=2, path=path, epochs=1)  # a restart: no search again
    assert again.seen[0] == 3 and trainer.step.micro_batching.size == 3


def test_auto_fails_clearly_when_one_sample_does_not_fit():
    with pytest.raises(RuntimeError, match="one sample per process does not fit"):
        train("auto", fits=0)


def test_evaluation_in_parts_scores_like_whole_batches():
    model = Greedy()
    data = [(torch.randn(10, 6), torch.randint(0, 3, (10,))) for _ in range(3)]
    scores = []
    for micro_batch in (None, 4):
        metrics = validation_metrics(nn.CrossEntropyLoss(), torch.device("cpu"))
        evaluator: Engine = create_evaluator(model, metrics, micro_batch=micro_batch)
        scores.append(evaluator.run(data).metrics)
    assert scores[0]["accuracy"] == scores[1]["accuracy"]
    assert scores[0]["loss"] == pytest.approx(scores[1]["loss"], abs=1e-6)
    assert max(model.seen[-9:]) == 4


class CountingLM(nn.Module):
    """A Hugging Face-style model: a mapping batch, its own loss summed over the labels and divided by the count."""

    def __init__(self):
        super().__init__()
        self.emb, self.counts = nn.Embedding(8, 8), []

    def forward(self, input_ids, labels, num_items_in_batch=None):
        self.counts.append(num_items_in_batch)
        loss = nn.functional.cross_entropy(self.emb(input_ids).flatten(0, 1), labels.flatten(), reduction="sum")
        return {"loss": loss / num_items_in_batch}


def test_num_items_are_counted_before_the_batch_moves(monkeypatch):
    # Issue #44 (6): counting the labels on the GPU (int(...)) waited for it at every iteration. Here the step's
    # device is "meta" (a move that is seen, not made): the count comes first, and the model gets a Python int.
    import dataclasses

    from ignite_mgpu.train.step import micro_step

    model = CountingLM()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, device="cpu", micro_batch=2)
    events = []
    monkeypatch.setattr(micro_step, "counted_items", lambda b: events.append("count") or counted_items(b))
    monkeypatch.setattr(micro_step.batches, "to_device", lambda b, d, nb: events.append(f"move to {d}") or b)
    step = micro_step.micro_batch_step(dataclasses.replace(trainer.step, device=torch.device("meta")))
    labels = torch.tensor([[1, 2, -100], [3, -100, -100], [4, 5, 6], [7, -100, 1]])
    step(Engine(lambda e, b: None), {"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": labels})
    assert events == ["count", "move to meta"]
    assert model.counts == [8, 8] and all(type(c) is int for c in model.counts)  # two parts, the whole count


def test_a_failed_attempt_is_collected_before_the_cuda_cache_is_emptied(monkeypatch):
    # Issue #44 (12): tensors that only reference cycles hold (the failed attempt's frames) go back to the cache first.
    from ignite_mgpu.train.step import micro_step

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(micro_step.gc, "collect", lambda: calls.append("collect"))
    model = nn.Linear(2, 2)
    model.weight.grad = torch.ones(2, 2)
    micro_step._undo(model, tuple(model.parameters()))
    assert calls == ["collect", "empty_cache"] and model.weight.grad is None


def test_sync_batchnorm_takes_the_restart_path(monkeypatch):
    # Issue #44 (8): SyncBatchNorm all-gathers in every training forward, also under no_sync: a rank out of memory
    # there leaves the other inside the collective, so auto cannot agree and retry in place; the job restarts.
    from ignite_mgpu.train.step import micro_step

    model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4), nn.Linear(4, 2))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    sizing = MicroBatching("auto")
    alone = micro_step._Trial(trainer.step, sizing, False)
    assert alone.in_place  # one process: no collective to leave unmatched
    monkeypatch.setattr("ignite.distributed.get_world_size", lambda: 2)
    two = micro_step._Trial(trainer.step, sizing, False)
    assert not two.in_place and not two.agree and two.group is None


@pytest.fixture
def one_rank_ddp(tmp_path, monkeypatch):
    """A DDP model in a one-process gloo group that auto treats as one of 2 ranks."""
    import torch.distributed as dist

    from ignite_mgpu.train.step import micro_step

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    monkeypatch.setattr("ignite.distributed.get_world_size", lambda: 2)
    events = []
    monkeypatch.setattr(micro_step, "_agree", lambda size, group: events.append("agree") or size)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(6, 3))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), device="cpu")
    yield trainer.step, events
    idist.finalize()  # ignite's own view of the group too, not only torch's (later tests run without one)


def test_auto_agrees_before_the_synced_forward_and_restarts_after_an_oom_in_it(one_rank_ddp):
    # Issue #44 (7): once the size held for SETTLE_ITERATIONS, the last part syncs through DDP. Its forward arms
    # DDP's reducer, which no_sync does not disarm: the ranks must agree before that forward, and an out-of-memory
    # error in it cannot be retried in place (the job restarts from the smaller size).
    import dataclasses

    from ignite_mgpu.train.step import micro_step
    from ignite_mgpu.train.step.micro_batch import SETTLE_ITERATIONS, MicroBatchTooLarge

    step, events = one_rank_ddp
    sizing = MicroBatching("auto")
    sizing.size, sizing.stable = 2, SETTLE_ITERATIONS
    fail_at = []

    def forward(batch):
        events.append("forward")
        if len(events) in fail_at:
            raise real_cpu_oom()
        return step.compute_loss(batch)

    attempt = micro_step._Trial(dataclasses.replace(step, compute_loss=forward), sizing, False)
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    assert isinstance(attempt(batch, 4, 2, True, 1, [], None, 0), torch.Tensor)
    assert events == ["forward", "agree", "forward"]
    events.clear()
    fail_at.append(3)  # the synced forward runs out of memory
    with pytest.raises(MicroBatchTooLarge, match="inside a collective"):
        attempt(batch, 4, 2, True, 1, [], None, 0)
    assert events == ["forward", "agree", "forward"]


class ViewAll(nn.Module):
    def forward(self, x):
        return x.view(x.size(0), -1)  # a batch of 0 samples cannot be viewed so


def sync_bn_step(monkeypatch, world: int, largest: list[int] | None, flatten=None, norm=nn.SyncBatchNorm):
    """A model with SyncBatchNorm (or ``norm``, under a stand-in for FSDP) in parts of 2, its process function as one
    of ``world`` ranks (no process group: SyncBatchNorm falls back to BatchNorm's kernel), the sizes its norm saw."""
    from ignite_mgpu.train.step import micro_step

    monkeypatch.setattr("ignite.distributed.get_world_size", lambda: world)
    if norm is not nn.SyncBatchNorm:
        monkeypatch.setattr(micro_step, "find_fsdp", lambda model: model)  # every forward a collective, as FSDP's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 4, 1), norm(4), flatten or nn.Flatten(), nn.Linear(12, 2))
    seen: list[int] = []
    model[1].register_forward_pre_hook(lambda m, args: seen.append(len(args[0])))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), micro_batch=2)
    trainer.step.shares.largest = largest
    engine = Engine(lambda e, b: None)
    engine.state.iteration, engine.state.epoch_length = 1, 1
    return model, seen, lambda batch: micro_step.micro_batch_step(trainer.step)(engine, batch)


@pytest.mark.parametrize("norm", [nn.SyncBatchNorm, nn.BatchNorm1d])
def test_a_smaller_share_runs_as_many_parts_under_batchnorm_with_empty_ones(monkeypatch, norm):
    # Issue #50: SyncBatchNorm all-gathers in every training forward (FSDP's forwards all-gather), so a rank holding 3
    # samples when another holds 5 runs 3 parts of 2 (2, 1 and an empty one, as many all-gathers); the empty part
    # counts in no statistics (SyncBatchNorm gives it a count of 0, BatchNorm skips it) and leaves the gradient, the
    # running statistics and the loss as without it.
    torch.manual_seed(1)
    batch = (torch.randn(3, 4, 3), torch.randint(0, 2, (3,)))
    alone, seen_alone, step_alone = sync_bn_step(monkeypatch, 1, None, norm=norm)
    loss_alone = step_alone(batch)
    padded_model, seen, step = sync_bn_step(monkeypatch, 3, [5], norm=norm)
    loss = step(batch)
    assert seen_alone == [2, 1] and seen == [2, 1, 0]
    assert torch.equal(loss, loss_alone)
    for a, b in zip(alone.state_dict().values(), padded_model.state_dict().values(), strict=True):
        if a.is_floating_point():
            assert torch.equal(a, b)  # parameters after the step, running mean and variance


def test_a_loader_of_the_users_agrees_on_the_largest_share(monkeypatch):
    # No GlobalBatchSampler, so no known shares: the ranks all-reduce the largest batch (here: 6), then pad.
    monkeypatch.setattr("ignite.distributed.all_reduce", lambda t, op: torch.tensor(6) if op == "MAX" else t)
    _, seen, step = sync_bn_step(monkeypatch, 3, None)
    step((torch.randn(3, 4, 3), torch.randint(0, 2, (3,))))
    assert seen == [2, 1, 0]


def test_evaluation_in_parts_runs_the_parts_of_the_largest_share_and_drops_the_padding():
    from ignite_mgpu.train.step.micro_batch import in_parts

    seen = []

    def forward(batch):
        seen.append(len(batch[0]))
        return batch[0] * 2, batch[1]

    batch = (torch.arange(5.0), torch.arange(5))
    predictions, targets = in_parts(forward, 2, False, most=lambda n: 8)(batch)
    assert seen == [2, 2, 1, 1]  # the largest share, 8, makes 4 parts: one pads with the first sample
    assert predictions.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0] and targets.tolist() == [0, 1, 2, 3, 4]
    seen.clear()
    in_parts(forward, 8, False, most=lambda n: 9)(batch)
    assert seen == [5, 1]


def test_a_model_that_fails_on_an_empty_part_is_told_what_to_accept(monkeypatch):
    _, _, step = sync_bn_step(monkeypatch, 3, [5], flatten=ViewAll())
    with pytest.raises(RuntimeError, match=r"runs an empty part .* must accept a batch of 0 samples .*flatten"):
        step((torch.randn(3, 4, 3), torch.randint(0, 2, (3,))))
