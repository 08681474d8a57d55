"""Saves killed at every step: the folder loads as exactly the old model or exactly the new one.

Every filesystem call a save makes (mkdir, rename, replace, unlink, rmdir, rmtree, fsync, chmod)
is a step; the save is stopped at step k, for every k, in two ways: a *kill* (that call and every
later one raise, so no clean-up code runs, as after SIGKILL) and an *exception* (only that call
raises; the save's own clean-up runs, as after Ctrl-C). Then the folder must load, without error,
as the old model or the new one (never a mix, never neither), files xlstm_kit did not write
must be byte-identical, and saving again must give the new model with nothing of ours left
over. Each save path is covered: `save` and `save_pretrained` (both formats, one file or
shards, over each other), into a new or an empty folder, and training checkpoints.
"""
import contextlib
import os
import shutil

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.checkpoint import load_training_state, resolve_checkpoint, save_checkpoint
from xlstm_kit.io.files import MANIFEST_FILE
from xlstm_kit.training import TrainConfig, make_optimizer

pytestmark = pytest.mark.usefixtures("single_thread", "no_fsync")

FOREIGN = {"README.md": b"# my notes\n", "notes/keep.txt": b"\x00\x01 mine"}


@pytest.fixture
def no_fsync(monkeypatch):
    """fsync only matters when the machine loses power, not when a process is killed; it is most
    of a tiny save's time."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


class Killed(BaseException):
    """The process stops here."""


@contextlib.contextmanager
def stopped_at(k: int, kill: bool):
    """Count the filesystem calls of the block; the k-th raises Killed (k=0: none), and with
    `kill` every later one too. fsync is counted but not done (it matters for power loss only)."""
    state = {"n": 0, "dead": False}

    def wrap(fn):
        def call(*args, **kwargs):
            if state["dead"]:
                raise Killed
            state["n"] += 1
            if state["n"] == k:
                state["dead"] = kill
                raise Killed
            return fn(*args, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as mp:
        for name in ("mkdir", "rename", "replace", "unlink", "rmdir", "chmod"):
            mp.setattr(os, name, wrap(getattr(os, name)))
        mp.setattr(os, "fsync", wrap(lambda fd: None))
        mp.setattr(shutil, "rmtree", wrap(shutil.rmtree))
        yield state


def large(seed: int) -> XLSTMLanguageModel:
    torch.manual_seed(seed)
    m = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=64, d_model=16, n_blocks=2, n_heads=2,
                                       ffn_proj_factor=1.5, round_proj_to=16))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def state_of(m) -> dict:
    return {k: v.clone() for k, v in m.state_dict().items()}


def which(loaded, old, new) -> str:
    sd = loaded.state_dict()
    for name, ref in (("old", old), ("new", new)):
        if ref is not None and sd.keys() == ref.keys() and all(torch.equal(sd[k], ref[k]) for k in sd):
            return name
    raise AssertionError("the folder loads as neither the old model nor the new one")


def put_foreign(folder):
    for name, data in FOREIGN.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def assert_foreign_kept(folder):
    for name, data in FOREIGN.items():
        assert (folder / name).read_bytes() == data, name


def files_of(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _save(kind, shard="10KB"):
    if kind == "kit":
        return lambda m, x: m.save(x, tokenizer="byte")
    if kind == "kit-plain":
        return lambda m, x: m.save(x)
    if kind == "hf-one":
        return lambda m, x: m.save_pretrained(x)
    return lambda m, x: m.save_pretrained(x, max_shard_size=shard)


CASES = {  # old save, new save
    "save over save": ("kit", "kit-plain"),
    "hf shards over as many hf shards": ("hf-shards", "hf-shards"),
    "hf one file over hf shards": ("hf-shards", "hf-one"),
    "save over hf shards": ("hf-shards", "kit"),
    "hf shards over save": ("kit", "hf-shards"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_save_over_a_model_stopped_at_any_step_leaves_the_old_or_the_new(tmp_path, case):
    old_kind, new_kind = CASES[case]
    save_old = _save(old_kind)
    save_new = _save(new_kind)
    old_m, new_m = large(1), large(2)
    old, new = state_of(old_m), state_of(new_m)
    pristine, x = tmp_path / "pristine", tmp_path / "x"
    save_old(old_m, pristine)
    put_foreign(pristine)
    shutil.copytree(pristine, x)
    with stopped_at(0, kill=False) as counted:
        save_new(new_m, x)
    assert which(XLSTMLanguageModel.from_pretrained(x), old, new) == "new"
    complete = files_of(x)  # safetensors files are deterministic: a save's bytes are its model
    assert MANIFEST_FILE in complete
    outcomes = []
    for kill in (True, False):
        for k in range(1, counted["n"] + 1):
            shutil.rmtree(x)
            shutil.copytree(pristine, x)
            with pytest.raises(Killed), stopped_at(k, kill):
                save_new(new_m, x)
            outcomes.append(which(XLSTMLanguageModel.from_pretrained(x), old, new))
            assert_foreign_kept(x)
            save_new(new_m, x)  # the next save completes and leaves nothing of the stopped one
            assert files_of(x) == complete, (kill, k)
    assert {"old", "new"} <= set(outcomes)


@pytest.mark.parametrize("empty_folder", [False, True])
def test_a_save_into_a_new_or_empty_folder_stopped_at_any_step_leaves_no_model_or_the_new(tmp_path, empty_folder):
    """No old model: the folder holds nothing loadable or the complete new model."""
    new_m = large(2)
    new = state_of(new_m)
    x = tmp_path / "x"
    if empty_folder:
        x.mkdir()
    with stopped_at(0, kill=False) as counted:
        new_m.save_pretrained(x, max_shard_size="10KB")
    complete = files_of(x)
    outcomes = []
    for kill in (True, False):
        for k in range(1, counted["n"] + 1):
            shutil.rmtree(x)
            if empty_folder:
                x.mkdir()
            with pytest.raises(Killed), stopped_at(k, kill):
                new_m.save_pretrained(x, max_shard_size="10KB")
            try:
                outcomes.append(which(XLSTMLanguageModel.from_pretrained(x), None, new))
            except (XLSTMKitError, FileNotFoundError) as e:
                assert "\n" not in str(e)
                assert not x.exists() or not [p for p in x.iterdir() if not p.name.startswith(".")], (kill, k)
                outcomes.append("none")
            new_m.save_pretrained(x, max_shard_size="10KB")
            assert files_of(x) == complete, (kill, k)
    assert {"none", "new"} <= set(outcomes)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["x"]


def test_a_training_checkpoint_stopped_at_any_step_leaves_the_old_or_the_new(tmp_path):
    """`latest` names the older checkpoint or the complete new one; the older one is pruned (keep=1)
    only after `latest` moved on."""
    cfg = TrainConfig(steps=10)
    torch.manual_seed(0)
    m = XLSTMLanguageModel(XLSTMConfig(vocab_size=32, d_model=16, n_blocks=1, n_heads=2))
    opt = make_optimizer(m, cfg)
    pristine, run = tmp_path / "pristine", tmp_path / "run"
    save_checkpoint(pristine, m, opt, 1, cfg, keep=1)
    old = state_of(m)
    put_foreign(pristine)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    new = state_of(m)
    shutil.copytree(pristine, run)
    with stopped_at(0, kill=False) as counted:
        save_checkpoint(run, m, opt, 2, cfg, keep=1)
    outcomes = []
    for kill in (True, False):
        for k in range(1, counted["n"] + 1):
            shutil.rmtree(run)
            shutil.copytree(pristine, run)
            with pytest.raises(Killed), stopped_at(k, kill):
                save_checkpoint(run, m, opt, 2, cfg, keep=1)
            outcome = which(XLSTMLanguageModel.load(run), old, new)
            assert load_training_state(resolve_checkpoint(run))["step"] == {"old": 1, "new": 2}[outcome]
            outcomes.append(outcome)
            assert_foreign_kept(run)
    assert {"old", "new"} <= set(outcomes)
