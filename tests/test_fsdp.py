"""The FSDP settings' one-line refusals; the multi-process FSDP runs are in tests/test_fsdp_mp.py."""
import os
import pickle
import shutil

import pytest

from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.training.config import RESUME_FROZEN
from xlstm_kit.training.distributed import init_distributed


def test_parallel_is_checked_and_frozen_on_resume():
    assert T.TrainConfig().parallel == "ddp"
    assert T.TrainConfig(parallel="fsdp").parallel == "fsdp"
    with pytest.raises(XLSTMKitError, match="parallel must be one of"):
        T.TrainConfig(parallel="zero3")
    assert "parallel" in RESUME_FROZEN


def test_fsdp_without_torchrun_is_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(XLSTMKitError, match="needs torchrun") as e:
        init_distributed(parallel="fsdp")
    assert "\n" not in str(e.value)
    assert not init_distributed().enabled  # ddp without torchrun: one process, as before


def _corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return str(tmp_path / "c.txt")


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_cli_refuses_fsdp_without_torchrun_before_importing_torch(tmp_path, monkeypatch, capsys):
    from xlstm_kit.cli import app

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert app.main(["train", "--parallel", "fsdp", "--steps", "2", "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "--parallel fsdp needs torchrun" in line and "--nproc-per-node" in line
    assert not (tmp_path / "run").exists()


def test_world_size_that_does_not_divide_the_batch_is_one_line(tmp_path, monkeypatch, capsys):
    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.cli import app, train as cli_train
    from xlstm_kit.training.data import load_data

    corpus = _corpus(tmp_path, monkeypatch)
    # the library: refused before any collective (no process group is needed to see it)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=16, n_blocks=1, n_heads=1))
    with pytest.raises(XLSTMKitError, match="batch_size 4 is not divisible by world_size"):
        T.train(model, load_data(corpus, "byte"), T.TrainConfig(steps=1, batch_size=4, seq_len=8), None,
                device="cpu", dist=T.DistInfo(rank=0, world_size=3), handle_signals=False)
    # the command line, as rank 0 of three processes: before data or model are read
    monkeypatch.setattr(cli_train, "init_distributed", lambda parallel: T.DistInfo(rank=0, world_size=3))
    monkeypatch.setattr(cli_train, "load_data", lambda *a, **k: pytest.fail("read the data before refusing"))
    assert app.main(["train", "--data", corpus, "--batch-size", "4", "--grad-accum", "2", "--steps", "2",
                     "--device", "cpu", "--out", str(tmp_path / "run")]) == 2
    line = _error_line(capsys)
    assert "--batch-size 4" in line and "3 processes x --grad-accum 2" in line and "multiple of 6" in line


def test_resuming_with_another_parallel_is_one_line(tmp_path, monkeypatch, capsys):
    from xlstm_kit.cli import app, train as cli_train

    corpus = _corpus(tmp_path, monkeypatch)
    run = str(tmp_path / "run")
    assert app.main(["train", "--data", corpus, "--batch-size", "2", "--seq-len", "16", "--steps", "2",
                     "--eval-batches", "1", "--device", "cpu", "--no-progress", "--out", run]) == 0
    capsys.readouterr()
    # under torchrun's variables: refused before the processes join up
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(cli_train, "init_distributed", lambda parallel: pytest.fail("joined the process group"))
    assert app.main(["train", "--out", run, "--resume", "--steps", "4", "--parallel", "fsdp"]) == 2
    line = _error_line(capsys)
    assert "--parallel fsdp cannot resume a run trained with --parallel ddp" in line


# ------------------------------------------------------------------ sharded checkpoints, read back
@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A run trained by FSDP2 in a process group of one (this process), with its sharded checkpoint."""
    import torch
    import torch.distributed as dist

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.training.data import load_data

    tmp = tmp_path_factory.mktemp("sharded")
    os.environ["XLSTM_KIT_CACHE"] = str(tmp / "cache")
    (tmp / "c.txt").write_text("the quick brown fox jumps over the lazy dog. " * 60)
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=16, n_blocks=2, n_heads=1, slstm_at=[1],
                                           context_length=16, chunk_size=8))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        T.train(model, load_data(str(tmp / "c.txt"), "byte"),
                T.TrainConfig(steps=2, batch_size=2, seq_len=16, eval_batches=1, parallel="fsdp"), tmp / "run",
                device="cpu", dist=T.DistInfo(), handle_signals=False)
        weights = {k: v.full_tensor().clone() for k, v in model.state_dict().items()}
    finally:
        dist.destroy_process_group()
        os.environ.pop("XLSTM_KIT_CACHE")
    return tmp / "run", weights


def _copy(run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(run, dst, ignore=shutil.ignore_patterns(".xlstm-kit.lock"))
    return dst, T.resolve_checkpoint(dst)


def test_sharded_checkpoint_loads_whole_and_generates(sharded_run, tmp_path, capsys):
    import torch

    from xlstm_kit import XLSTMLanguageModel
    from xlstm_kit.cli import app
    from xlstm_kit.io.checkpoint import is_sharded

    run, weights = sharded_run
    ckpt = T.resolve_checkpoint(run)
    assert is_sharded(ckpt) and not (ckpt / "model.safetensors").exists()
    for model in (XLSTMLanguageModel.load(run), XLSTMLanguageModel.from_pretrained(run, dtype=torch.float32)):
        for k, v in weights.items():
            assert torch.equal(model.state_dict()[k], v), k
    assert XLSTMLanguageModel.from_pretrained(run, dtype=torch.bfloat16).lm_head.weight.dtype == torch.bfloat16
    assert app.main(["generate", str(run), "--prompt", "the ", "--max-new-tokens", "4", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("the ")


def test_a_crafted_shard_index_runs_no_code(sharded_run, tmp_path):
    from xlstm_kit import XLSTMLanguageModel

    run, ckpt = _copy(sharded_run[0], tmp_path)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(XLSTMKitError, match="not a readable checkpoint index: the index names .*system") as e:
        XLSTMLanguageModel.load(run)
    assert "\n" not in str(e.value) and not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "unlisted"])
def test_a_damaged_shard_is_one_line(sharded_run, tmp_path, damage):
    import json

    from xlstm_kit import XLSTMLanguageModel

    run, ckpt = _copy(sharded_run[0], tmp_path)
    shard = ckpt / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
        expect = "lies past the end of __0_0.distcp"
    elif damage == "flipped":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
        expect = "does not match the SHA-256"
    else:
        sums = json.loads((ckpt / "checksums.json").read_text())
        del sums["sha256"]["__0_0.distcp"]
        (ckpt / "checksums.json").write_text(json.dumps(sums))
        expect = "records no SHA-256 of __0_0.distcp"
    with pytest.raises(XLSTMKitError, match=expect) as e:
        XLSTMLanguageModel.load(run)
    assert "\n" not in str(e.value)


def test_a_sharded_save_that_fails_to_commit_raises_and_leaves_nothing(tmp_path, monkeypatch):
    import torch
    import torch.distributed as dist

    from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
    from xlstm_kit.io import sharded
    from xlstm_kit.training.distributed import shard_model
    from xlstm_kit.training.optim import make_optimizer

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(sharded, "_commit_checkpoint", disk_full)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=16, n_blocks=1, n_heads=1))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        shard_model(model, T.DistInfo(), torch.device("cpu"), "fp32")
        config = T.TrainConfig(steps=1, batch_size=1, seq_len=8, parallel="fsdp")
        with pytest.raises(OSError, match="No space left"):
            sharded.save_sharded_checkpoint(tmp_path / "run", model, make_optimizer(model, config), 1, config)
    finally:
        dist.destroy_process_group()
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == []  # the staging folder went
    assert not (tmp_path / "run" / "latest").exists()
