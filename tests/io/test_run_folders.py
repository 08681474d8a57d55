"""Run folders (`train`, `--overwrite`) and training checkpoints (pruning): a file or folder
xlstm_kit did not write is never deleted or overwritten; a run refuses in one line, before
writing anything, to start over a `latest`, metrics log or loss plot of someone else's."""
import json

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.cli import app as cli
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.checkpoint import clear_run, resolve_checkpoint, save_checkpoint
from xlstm_kit.io.files import MANIFEST_FILE
from xlstm_kit.training.data import load_data

pytestmark = pytest.mark.usefixtures("single_thread")

TEXT = "To be, or not to be, that is the question.\n" * 40


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(fn, name):
    with pytest.raises(XLSTMKitError) as e:
        fn()
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text(TEXT)
    return load_data(str(tmp_path / "corpus.txt"), "byte")


def small():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=16, n_blocks=1, n_heads=2, chunk_size=8))


def config(**kw):
    return T.TrainConfig(**{**dict(steps=3, batch_size=2, seq_len=8, warmup_steps=1, eval_interval=0,
                                   eval_batches=1, checkpoint_interval=1, keep_checkpoints=1), **kw})


@pytest.mark.parametrize("name", ["metrics.jsonl", "loss.png", "latest"])
def test_a_fresh_run_refuses_a_run_file_it_did_not_write(data, tmp_path, name):
    out = tmp_path / "run"
    out.mkdir()
    (out / name).write_bytes(b"theirs")
    before = snapshot(out)
    refused(lambda: T.train(small(), data, config(), out, device="cpu"), name)
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".")} == before
    assert not (out / "checkpoints").exists()


def test_pruning_keeps_checkpoint_folders_it_did_not_write(data, tmp_path):
    out = tmp_path / "run"
    theirs = {"checkpoints/step-00000001/weights.bin": b"theirs", "checkpoints/step-final/x": b"x",
              "checkpoints/lightning-epoch=3.ckpt": b"lightning"}
    for name, b in theirs.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b)
    T.train(small(), data, config(), out, device="cpu")
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs
    ours = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-0"))
    assert ours == ["step-00000001", "step-00000003"]  # keep=1: step 2 went, the foreign step-00000001 stayed
    assert resolve_checkpoint(out).name == "step-00000003"


def test_a_checkpoint_of_ours_holding_a_file_of_someone_elses_is_not_pruned(tmp_path):
    m, cfg = small(), config(steps=5)
    opt = T.make_optimizer(m, cfg)
    first = save_checkpoint(tmp_path / "run", m, opt, 1, cfg, keep=1)
    (first / "notes.txt").write_text("mine")
    save_checkpoint(tmp_path / "run", m, opt, 2, cfg, keep=1)
    third = save_checkpoint(tmp_path / "run", m, opt, 3, cfg, keep=1)
    assert (first / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [first.name, third.name]


def test_overwrite_deletes_only_what_xlstm_kit_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text(TEXT)
    out = tmp_path / "run"
    fast = ["train", "--data", str(tmp_path / "corpus.txt"), "--steps", "1", "--out", str(out), "--batch-size", "2",
            "--seq-len", "8", "--eval-batches", "1", "--no-progress", "--device", "cpu", "--preset", "tiny"]
    assert cli.main(fast) == 0
    old = resolve_checkpoint(out)
    theirs = {"checkpoints/lightning-epoch=3.ckpt": b"lightning", "checkpoints/step-00000009/w.bin": b"w",
              "notes.txt": b"notes"}
    for name, b in theirs.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(b)
    assert cli.main([*fast, "--overwrite"]) == 0
    assert {k: v for k, v in snapshot(out).items() if k in theirs} == theirs
    assert resolve_checkpoint(out) == old and json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    # a run file of someone else's: refused before anything is deleted
    (out / "metrics.jsonl").unlink()
    (out / "metrics.jsonl").write_bytes(b"theirs")
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    (out / MANIFEST_FILE).write_text(json.dumps({**manifest, "files": ["latest", "loss.png"]}))
    before = snapshot(out)
    capsys.readouterr()
    assert cli.main([*fast, "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "metrics.jsonl" in err and "\n" not in err, err
    assert snapshot(out) == before


def test_clear_run_of_a_run_written_before_manifests(data, tmp_path):
    """Run folders and checkpoints of older versions (no manifest) are recognised by `latest` and
    train_meta.json: pruned and cleared as before."""
    out = tmp_path / "run"
    T.train(small(), data, config(keep_checkpoints=3), out, device="cpu")
    for f in out.rglob(MANIFEST_FILE):
        f.unlink()
    (out / "checkpoints" / "theirs.txt").write_text("x")
    clear_run(out, ("metrics.jsonl", "loss.png"))
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if not p.name.startswith(".")) \
        == ["checkpoints", "checkpoints/theirs.txt"]


def test_a_planted_commit_manifest_in_a_run_folder_makes_no_file_ours(tmp_path):
    """A commit folder planted in a run folder (loading the run carries it out first) cannot make
    the user's metrics.jsonl ours through its manifest: clearing the run refuses it instead of
    deleting it."""
    from xlstm_kit.io import files
    from xlstm_kit.io.checkpoint import claim_run_files

    run = tmp_path / "run"
    claim_run_files(run, [])  # a run folder of ours: its manifest lists `latest`
    (run / "metrics.jsonl").write_text("mine\n")
    commit = run / files.COMMIT_DIR
    commit.mkdir()
    (commit / MANIFEST_FILE).write_bytes(files.manifest_bytes({"latest", "metrics.jsonl"}))
    files.finish_interrupted_save(run)
    assert not commit.exists() and files.owned_files(run) == {"latest"}
    refused(lambda: clear_run(run, ["metrics.jsonl"]), "metrics.jsonl")
    assert (run / "metrics.jsonl").read_text() == "mine\n"


@pytest.mark.timeout(60)  # the failure a FIFO read by name would cause is a hang
@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_resume_refuses_a_metrics_log_that_is_not_a_file(data, tmp_path, kind):
    """Resuming read metrics.jsonl only when is_file saw a regular file: a FIFO there was taken
    for a run without a log (its history dropped, the FIFO replaced), a folder failed the rewrite
    with an IsADirectoryError traceback. Refused in one line naming it, and left as it was."""
    import os
    import shutil

    from xlstm_kit.training.plots import read_metrics

    out = tmp_path / "run"
    T.train(small(), data, config(), out, device="cpu")
    metrics = out / "metrics.jsonl"
    assert [r["step"] for r in read_metrics(metrics, None) if "loss" in r] == [1, 2, 3]
    saved = metrics.read_bytes()
    metrics.unlink()
    os.mkfifo(metrics) if kind == "fifo" else metrics.mkdir()
    refused(lambda: read_metrics(metrics, None), "metrics.jsonl is not a regular file")
    refused(lambda: T.train(small(), data, config(steps=4), out, resume=True, device="cpu"),
            "metrics.jsonl is not a regular file")
    assert os.path.lexists(metrics) and not metrics.is_file()
    metrics.unlink() if kind == "fifo" else shutil.rmtree(metrics)
    assert read_metrics(metrics, None) == []  # absent: a run without a log
    metrics.write_bytes(saved)
    T.train(small(), data, config(steps=4), out, resume=True, device="cpu")
    assert [r["step"] for r in read_metrics(metrics, None) if "loss" in r] == [1, 2, 3, 4]
