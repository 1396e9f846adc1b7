"""safetensors weights: a tied GPT-2 through `checkpoint convert` and back (equal, still tied), ties and views written
once, the best model as safetensors (rotation, metadata, FSDP's gathered state), weights-only resume, corrupt files
refused in one paragraph; one CLI job runs the how-to (docs/how-to/share-weights.md).
`python -m pytest tests/checkpoint/test_weights.py`."""

import io
import json
import os
import stat

import pytest
import torch
from click.testing import CliRunner
from ignite.engine import Engine
from safetensors import safe_open
from torch import nn

from ignite_mgpu import fit, jobs
from ignite_mgpu.checkpoint.files import TIED, is_complete, read_safetensors
from ignite_mgpu.checkpoint.load import load_checkpoint
from ignite_mgpu.checkpoint.resume import resume
from ignite_mgpu.checkpoint.same_run import resume_target, run_signature
from ignite_mgpu.checkpoint.save import RunInfo, adopt_existing, create_checkpointers
from ignite_mgpu.checkpoint.weights import TiedWeights, save_weights, tensors_to_write, write_safetensors
from ignite_mgpu.cli.commands import main
from ignite_mgpu.config.loading import load_config
from ignite_mgpu.errors import CheckpointError, ConfigError
from ignite_mgpu.preflight import check_no_foreign_checkpoints
from ignite_mgpu.processes import launcher
from ignite_mgpu.runs.read import best_model
from ignite_mgpu.train.step.trainer import create_trainer
from tests.docs_blocks import doc_block, run_block, sandbox
from tests.helpers import cpu_fsdp, hugging_face, linear


class TiedLM(nn.Module):
    """An embedding and an output layer sharing one weight, as GPT-2's."""

    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.mid = nn.Embedding(10, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.mid(self.emb(x)))


def assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def tiny_gpt2(seed=0):
    transformers = hugging_face()
    torch.manual_seed(seed)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(config)


def test_gpt2_round_trips_through_convert_equal_and_still_tied(tmp_path):
    model = tiny_gpt2()
    run = {"config": {"model.name": "examples.huggingface.models:causal_lm", "model.args.n_embd": "16", "seed": "0"}}
    prefixed = {f"module.{k}": v for k, v in model.state_dict().items()}  # as DDP's state_dict: one tensor, two names
    torch.save({"model": prefixed, "run": run, "trainer": {"iteration": 8}}, tmp_path / "checkpoint_8.pt")
    weights, back = tmp_path / "model.safetensors", tmp_path / "back.pt"

    converted = CliRunner().invoke(main, ["checkpoint", "convert", str(tmp_path / "checkpoint_8.pt"), str(weights)])
    assert converted.exit_code == 0 and "stripped module." in converted.output, converted.output
    with safe_open(str(weights), "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # written once, as Hugging Face does
    assert json.loads(metadata[TIED]) == {"lm_head.weight": "transformer.wte.weight"}
    assert metadata["format"] == "pt" and metadata["ignite_mgpu.source"] == "checkpoint_8.pt"
    assert metadata["ignite_mgpu.model.name"] == "examples.huggingface.models:causal_lm"
    assert metadata["ignite_mgpu.model.args.n_embd"] == "16" and "ignite_mgpu.seed" not in metadata

    fresh = tiny_gpt2(seed=1)
    load_checkpoint(weights, {"model": fresh}, map_location="cpu")
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # one Parameter, as built
    assert_same_weights(fresh, model)

    assert CliRunner().invoke(main, ["checkpoint", "convert", str(weights), str(back)]).exit_code == 0
    state = torch.load(back, weights_only=True)
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()  # one storage again
    other = tiny_gpt2(seed=2)
    other.load_state_dict(state)
    assert_same_weights(other, model)

    inspected = CliRunner().invoke(main, ["checkpoint", "inspect", str(weights), "--json"])
    info, of_pt = (
        json.loads(inspected.output),
        json.loads(CliRunner().invoke(main, ["checkpoint", "inspect", str(back), "--json"]).output),
    )
    assert info["kind"] == "safetensors" and info["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    assert info["parameters"] == of_pt["parameters"] and info["tensors"] == of_pt["tensors"]


def test_the_how_to_gpt2_block_loads_tied_and_into_hugging_face(tmp_path, monkeypatch, capsys):
    hugging_face()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a local folder: nothing may be fetched
    names: dict = {}
    exec(doc_block("share-gpt2").text, names)
    assert capsys.readouterr().out.split() == ["True", "True"]
    assert names["hf"].lm_head.weight is names["hf"].transformer.wte.weight
    assert_same_weights(names["hf"], names["model"])
    assert read_safetensors(tmp_path / "gpt2" / "model.safetensors")[1]["trained_on"] == "my data"


def test_ties_views_and_what_cannot_be_written(tmp_path):
    base = torch.arange(12.0)
    state = {"a": base, "b": base, "half": base[:6], "t": torch.arange(6.0).view(2, 3).t(), "e1": torch.zeros(0)}
    tensors, tied = tensors_to_write({**state, "e2": torch.zeros(0)})
    assert tied == {"b": "a"} and set(tensors) == {"a", "half", "t", "e1", "e2"}  # empty tensors are never ties
    write_safetensors(state, tmp_path / "w.safetensors")
    read, _ = read_safetensors(tmp_path / "w.safetensors")
    assert read["b"] is read["a"] and all(torch.equal(read[k], v) for k, v in state.items())
    assert stat.S_IMODE(os.stat(tmp_path / "w.safetensors").st_mode) == 0o600
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temp file left
    with pytest.raises(CheckpointError, match=r"steps is a int, not a tensor: a safetensors file holds tensors only"):
        tensors_to_write({"steps": 3})
    with pytest.raises(CheckpointError, match=r"cannot write .*nowhere"):
        save_weights({"a": base}, tmp_path / "nowhere" / "w.safetensors")
    refused = CliRunner().invoke(
        main, ["checkpoint", "convert", str(tmp_path / "w.safetensors"), str(tmp_path / "nowhere" / "c.safetensors")]
    )
    assert refused.exit_code == 2 and "cannot write" in refused.output and "Traceback" not in refused.output


def corrupt_files(tmp_path):
    write_safetensors(TiedLM().state_dict(), tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[:-7])
    (tmp_path / "noise.safetensors").write_bytes(b"\x00" * 5)
    write_safetensors({"w": torch.ones(2)}, tmp_path / "edited.safetensors", {TIED: '{"x": "nope"}'})
    return tmp_path / "good.safetensors", tmp_path / "truncated.safetensors", tmp_path / "noise.safetensors"


def test_a_corrupt_or_truncated_file_is_one_paragraph_not_a_traceback(tmp_path, monkeypatch, capsys):
    good, truncated, noise = corrupt_files(tmp_path)
    assert is_complete(good) and not is_complete(truncated) and not is_complete(noise)
    for bad in (truncated, noise):
        for args in (["inspect", str(bad)], ["convert", str(bad), str(tmp_path / "x.pt")]):
            result = CliRunner().invoke(main, ["checkpoint", *args])
            assert result.exit_code == 2 and "is corrupt or truncated and cannot be loaded" in result.output
            assert "Traceback" not in result.output
    with pytest.raises(CheckpointError, match=r"truncated.safetensors is corrupt or truncated .*safetensors: "):
        load_checkpoint(truncated, {"model": TiedLM()}, map_location="cpu")
    with pytest.raises(CheckpointError, match=r"ignite_mgpu.tied=.* does not name tensors of the file"):
        read_safetensors(tmp_path / "edited.safetensors")

    monkeypatch.setattr(launcher, "run_job", lambda *a, **k: pytest.fail("a job was started"))
    cfg = load_config(overrides=[f"output_dir={tmp_path / 'out'}", f"resume={truncated}", "dist.nproc=1"])
    assert (
        fit(cfg) == 1
        and "the file is corrupt or truncated (not a complete safetensors file)" in capsys.readouterr().err
    )
    evaluated = jobs.evaluate(
        load_config(overrides=["dist.nproc=1", "data.train_size=64", "data.val_size=8", "data.batch_size=8"]), truncated
    )
    assert evaluated == 2 and "is corrupt or truncated" in capsys.readouterr().err


def test_the_best_model_as_safetensors_is_tied_named_and_rotated(tmp_path):
    model, trainer, evaluator = TiedLM(), Engine(lambda e, b: None), Engine(lambda e, b: None)
    run = RunInfo(1, 8, {"model.name": "pkg.models:tied_lm", "model.num_classes": "10", "optim.lr": "0.1"})
    full, best = create_checkpointers(
        {"model": model, "trainer": trainer, "run": run},
        nn.DataParallel(model),  # a wrapper's prefix never reaches the file
        tmp_path,
        2,
        "accuracy",
        lambda e, _: trainer.state.epoch,
        best_format="safetensors",
    )
    for epoch, accuracy in [(1, 0.5), (2, 0.7), (3, 0.6)]:
        trainer.state.epoch, evaluator.state.metrics = epoch, {"accuracy": accuracy}
        with torch.no_grad():
            model.emb.weight.fill_(epoch)
        best(evaluator)
    (path,) = tmp_path.iterdir()  # the first deleted once the second was complete; no temp file
    assert path.name == "best_model_2_val_accuracy=0.7000.safetensors" and best_model(tmp_path) == path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    weights, metadata = read_safetensors(path)
    assert weights["head.weight"] is weights["emb.weight"] and float(weights["emb.weight"][0, 0]) == 2
    assert metadata["ignite_mgpu.model.name"] == "pkg.models:tied_lm" and "ignite_mgpu.optim.lr" not in metadata
    assert metadata["ignite_mgpu.source"] == "the best model by val_accuracy"

    fresh = TiedLM(seed=3)
    load_checkpoint(path, {"model": fresh}, map_location="cpu")
    assert fresh.head.weight is fresh.emb.weight and float(fresh.emb.weight.detach()[0, 0]) == 2

    # A resumed run adopts it, also with best_format changed back to pt: a better score replaces it.
    full, best = create_checkpointers({"model": model}, model, tmp_path, 2, "accuracy", lambda e, _: 4)
    adopt_existing(full, best, tmp_path)
    evaluator.state.metrics = {"accuracy": 0.69}
    best(evaluator)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
    evaluator.state.metrics = {"accuracy": 0.9}
    best(evaluator)
    assert [p.name for p in tmp_path.iterdir()] == ["best_model_4_val_accuracy=0.9000.pt"]


def test_the_default_best_model_is_still_the_torch_save_file(tmp_path):
    model, evaluator = TiedLM(), Engine(lambda e, b: None)
    _, best = create_checkpointers({"model": model}, model, tmp_path, 1, "loss", lambda e, _: 1)
    evaluator.state.metrics = {"loss": 0.5}
    best(evaluator)
    (path,) = tmp_path.iterdir()
    expected = io.BytesIO()
    torch.save(model.state_dict(), expected)
    assert path.name == "best_model_1_val_loss=0.5000.pt" and path.read_bytes() == expected.getvalue()


@cpu_fsdp
def test_a_sharded_model_is_gathered_and_written_with_its_tie_once(one_rank, tmp_path):
    from ignite_mgpu.checkpoint.state import FullModelState
    from ignite_mgpu.parallel.fsdp import fully_shard  # torch.distributed.fsdp on torch >= 2.6

    model, plain = TiedLM(), TiedLM()
    fully_shard(model.mid)
    fully_shard(model)

    class Gathered:  # on N ranks each gathered tensor is a copy of its own, a tie's two names two copies
        def state_dict(self):
            return {k: v.clone() for k, v in FullModelState(model).state_dict().items()}

    state = TiedWeights(Gathered(), model).state_dict()
    assert state["head.weight"] is state["emb.weight"]
    save_weights(model, tmp_path / "fsdp.safetensors")  # gathers through FullModelState itself
    with safe_open(str(tmp_path / "fsdp.safetensors"), "pt") as f:
        assert set(f.keys()) == {"emb.weight", "mid.weight", "mid.bias"}

    other = TiedLM(seed=4)
    fully_shard(other.mid)
    fully_shard(other)
    load_checkpoint(tmp_path / "fsdp.safetensors", {"model": FullModelState(other)}, map_location="cpu")
    assert other.head.weight is other.emb.weight
    torch.testing.assert_close(FullModelState(other).state_dict(), plain.state_dict())


def test_resume_from_safetensors_is_a_new_run_from_the_weights(tmp_path, caplog, monkeypatch):
    trained = linear(seed=7)
    save_weights(trained, tmp_path / "w.safetensors")
    cfg = load_config(overrides=[f"output_dir={tmp_path / 'new'}", f"resume={tmp_path / 'w.safetensors'}"])
    model = linear(seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, nn.CrossEntropyLoss(), device="cpu")
    to_save = {"model": model, "optimizer": optimizer, "trainer": trainer, "run": RunInfo(1, 8, run_signature(cfg))}
    with caplog.at_level("WARNING", logger="ignite_mgpu"):
        assert resume(cfg, to_save, world_size=1)
    assert_same_weights(model, trained)
    assert trainer.state.iteration == 0 and not to_save["run"].loaded  # nothing of a run restored
    assert "weights only: the model starts from this file's weights; the optimizer" in caplog.text

    # auto means an exact resume: a best_model_*.safetensors beside it is never picked.
    (tmp_path / "new").mkdir()
    save_weights(trained, tmp_path / "new" / "best_model_1_val_accuracy=0.5000.safetensors")
    assert resume_target(load_config(overrides=[f"output_dir={tmp_path / 'new'}", "resume=auto"])) is None

    # A new run needs an output_dir without checkpoints; a requeued job continues its own newest one.
    torch.save({"model": trained.state_dict()}, tmp_path / "new" / "checkpoint_4.pt")
    with pytest.raises(ConfigError, match=r"starts a new run from its weights \(a fresh optimizer.*checkpoint_4.pt"):
        check_no_foreign_checkpoints(cfg)
    assert resume_target(cfg) == tmp_path / "w.safetensors"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    check_no_foreign_checkpoints(cfg)
    assert resume_target(cfg) == tmp_path / "new" / "checkpoint_4.pt"


def test_a_restart_before_the_first_checkpoint_starts_from_the_weights_again(tmp_path):
    cfg = load_config(overrides=[f"output_dir={tmp_path}", f"resume={tmp_path / 'w.safetensors'}"])
    restart = jobs._resume_newest(cfg, 1)
    assert restart.args[0].resume == str(tmp_path / "w.safetensors") and restart.checkpoint == cfg.resume
    torch.save({"model": linear().state_dict()}, tmp_path / "checkpoint_4.pt")
    restart = jobs._resume_newest(cfg, 1)
    assert restart.args[0].resume == "auto" and restart.iteration == 4


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_share_weights_how_to(tmp_path):
    """One 1-process CLI job: the best model as safetensors, evaluated, then a new run from its weights."""
    result = run_block(doc_block("share-weights"), sandbox(tmp_path), timeout=280)
    run_dir = tmp_path / "runs" / "share"
    (best,) = run_dir.glob("best_model_*")
    assert best.suffix == ".safetensors" and best_model(run_dir) == best  # what fit's result names
    assert f"best model: {best.relative_to(tmp_path)} (val_accuracy " in result.stderr  # the end of the run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first_best = max(lines, key=lambda line: (line["val_accuracy"], -line["epoch"]))
    assert best.name.startswith(f"best_model_{first_best['epoch']}_val_accuracy=")
    assert read_safetensors(best)[1]["ignite_mgpu.model.name"] == "simple_cnn"
    evaluated = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert evaluated["accuracy"] == pytest.approx(first_best["val_accuracy"])
    assert f"--resume {best.relative_to(tmp_path)}: weights only" in result.stderr
    (line,) = (tmp_path / "runs" / "finetune" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(line)["epoch"] == 1 and json.loads(line)["iteration"] == 8  # from epoch 0, not 16


@pytest.mark.gpu
def test_weights_written_from_and_read_onto_a_gpu_stay_tied(tmp_path):
    model, path = TiedLM().cuda(), tmp_path / "gpu.safetensors"
    save_weights(model, path)
    state, _ = read_safetensors(path, map_location="cuda")
    assert state["head.weight"] is state["emb.weight"] and state["emb.weight"].is_cuda
    fresh = TiedLM(seed=2).cuda()
    load_checkpoint(path, {"model": fresh})  # this rank's device
    assert fresh.head.weight is fresh.emb.weight
    assert_same_weights(fresh, model)
