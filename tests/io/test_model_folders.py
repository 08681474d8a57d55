"""Model folders (`save`, `save_pretrained`): a file xlstm_kit did not write is never deleted or
overwritten; a save that would overwrite one, or leave one that loading would read with the
model, refuses in one line naming it; every other file stays byte for byte. Stale files of an
earlier save of ours go (xlstm_kit.io.files)."""
import pytest
import torch

from tests.helpers import HOSTILE_FILES, make_hostile
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.io.files import MANIFEST_FILE

pytestmark = pytest.mark.usefixtures("single_thread")


def large(seed=0):
    torch.manual_seed(seed)
    m = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=64, d_model=16, n_blocks=2, n_heads=2,
                                       ffn_proj_factor=1.5, round_proj_to=16))
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def same(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(fn, name):
    with pytest.raises(XLSTMKitError) as e:
        fn()
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)



def test_save_pretrained_refuses_shards_it_did_not_write(tmp_path):
    x = tmp_path / "x"
    x.mkdir()
    for i in (1, 2):
        (x / f"model-0000{i}-of-00002.safetensors").write_bytes(b"theirs %d" % i)
    before = snapshot(x)
    refused(lambda: large().save_pretrained(x, max_shard_size="10KB"), "model-00001-of-00002.safetensors")
    refused(lambda: large().save_pretrained(x), "model-00001-of-00002.safetensors")
    assert snapshot(x) == before

    # beside a save of ours too: a shard we did not write is neither deleted nor overwritten
    y = tmp_path / "y"
    large(1).save_pretrained(y, max_shard_size="10KB")
    (y / "model-00009-of-00009.safetensors").write_bytes(b"theirs")
    before = snapshot(y)
    refused(lambda: large(2).save_pretrained(y), "model-00009-of-00009.safetensors")
    assert snapshot(y) == before


def test_saves_into_a_folder_of_someone_elses_model_are_refused(tmp_path):
    """A HuggingFace folder xlstm_kit did not write (no manifest): its files stay, byte for byte."""
    x = tmp_path / "hf"
    large(1).save_pretrained(x)
    (x / MANIFEST_FILE).unlink()  # as transformers (or anyone else) writes it
    before = snapshot(x)
    refused(lambda: large(2).save(x), "config.json")
    refused(lambda: large(2).save_pretrained(x), "config.json")
    assert snapshot(x) == before
    assert same(XLSTMLanguageModel.from_pretrained(x), large(1))


def test_model_save_over_our_hf_folder_removes_its_index_and_shards(tmp_path):
    x = tmp_path / "x"
    large(1).save_pretrained(x, max_shard_size="10KB")
    (x / "README.md").write_text("mine")
    large(2).save(x)
    assert sorted(p.name for p in x.iterdir()) == [MANIFEST_FILE, "README.md", "checksums.json", "config.json",
                                                   "model.safetensors"]
    assert (x / "README.md").read_text() == "mine"
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))
    assert same(XLSTMLanguageModel.load(x), large(2))
    # and back: the HuggingFace save removes our checksums.json
    large(3).save_pretrained(x, max_shard_size="10KB")
    assert "checksums.json" not in {p.name for p in x.iterdir()}
    assert same(XLSTMLanguageModel.from_pretrained(x), large(3))


def test_a_folder_mixed_by_an_older_version_loads_what_its_config_describes(tmp_path):
    """An xlstm_kit config.json + model.safetensors beside a stale HuggingFace index and shards
    (what saving over a HuggingFace folder left before): the xlstm_kit model, not a refusal."""
    x = tmp_path / "x"
    large(1).save_pretrained(x, max_shard_size="10KB")
    large(2).save(tmp_path / "ours")
    for name in ("config.json", "model.safetensors", "checksums.json"):
        (x / name).write_bytes((tmp_path / "ours" / name).read_bytes())
    (x / MANIFEST_FILE).unlink()
    assert (x / "model.safetensors.index.json").exists()
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))


def test_files_of_other_names_stay_byte_identical_through_every_save(tmp_path):
    x = tmp_path / "x"
    x.mkdir()
    theirs = {"README.md": b"notes", "train_state.pt": b"optimizer", "sub/data.bin": b"\x00\xff"}
    for name, data in theirs.items():
        (x / name).parent.mkdir(exist_ok=True)
        (x / name).write_bytes(data)
    for save in (lambda: large(1).save(x, tokenizer="byte"), lambda: large(2).save_pretrained(x, max_shard_size="10KB"),
                 lambda: large(3).save_pretrained(x), lambda: large(4).save(x)):
        save()
        assert {k: v for k, v in snapshot(x).items() if k in theirs} == theirs
    assert same(XLSTMLanguageModel.load(x), large(4))
    assert XLSTMLanguageModel.load(x).tokenizer_name is None  # the first save's tokenizer.json went with it


def test_an_interrupted_save_that_cannot_be_completed_is_refused_in_one_line(tmp_path, monkeypatch):
    import os

    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    real = os.rename

    def stop_after_commit(src, dst):  # the save is committed, then the process dies
        real(src, dst)
        if str(dst).endswith(files.COMMIT_DIR):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", stop_after_commit)
    with pytest.raises(KeyboardInterrupt):
        large(2).save(x)
    monkeypatch.setattr(os, "rename", real)

    def read_only(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", read_only)
    refused(lambda: XLSTMLanguageModel.load(x), files.COMMIT_DIR)
    monkeypatch.undo()
    assert same(XLSTMLanguageModel.load(x), large(2))
    assert not (x / files.COMMIT_DIR).exists()


def test_save_over_a_model_of_an_earlier_version(tmp_path):
    """A folder that `save` wrote before folders had a manifest (recognised by the weights'
    safetensors metadata) is replaced like one of ours; a file beside it stays; weights that
    are not ours still refuse the save."""
    x = tmp_path / "x"
    large(1).save(x)
    (x / MANIFEST_FILE).unlink()  # as an earlier version left it
    (x / "notes.txt").write_text("mine")
    large(2).save(x)
    assert same(XLSTMLanguageModel.load(x), large(2))
    assert (x / "notes.txt").read_text() == "mine"

    y = tmp_path / "y"
    large(1).save(y)
    (y / MANIFEST_FILE).unlink()
    import safetensors.torch
    safetensors.torch.save_file({"w": torch.zeros(2)}, str(y / "model.safetensors"))  # someone else's
    before = snapshot(y)
    refused(lambda: large(2).save(y), "was not written by xlstm_kit")
    assert snapshot(y) == before


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_manifest_that_cannot_be_read_makes_nothing_ours(tmp_path, kind):
    """A FIFO, an oversized file or JSON nested too deeply as the manifest lists nothing (deep
    nesting was a RecursionError traceback): no file counts as ours, so a save over the folder
    refuses in one line, at once, and leaves every file as it was; the model still loads."""
    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    make_hostile(x / MANIFEST_FILE, kind, files.MAX_MANIFEST_BYTES)
    assert files.owned_files(x) == set()
    before = snapshot(x)
    refused(lambda: large(2).save(x), "was not written by xlstm_kit")
    assert snapshot(x) == before
    assert same(XLSTMLanguageModel.load(x), large(1))


def _interrupted_after_commit(x, monkeypatch, save):
    """Run ``save`` until its commit, then stop it as a killed process would: the folder holds
    the old model and the commit folder that the next load carries out."""
    import os

    from xlstm_kit.io import files

    real = os.rename

    def stop_after_commit(src, dst):
        real(src, dst)
        if str(dst).endswith(files.COMMIT_DIR):
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(os, "rename", stop_after_commit)
        with pytest.raises(KeyboardInterrupt):
            save()
    return x / files.COMMIT_DIR


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_plan_that_cannot_be_read_is_refused_in_one_line_and_changes_nothing(tmp_path, monkeypatch, kind):
    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    commit = _interrupted_after_commit(x, monkeypatch, lambda: large(2).save_pretrained(x, max_shard_size="10KB"))
    make_hostile(commit / files.PLAN_FILE, kind, files.MAX_MANIFEST_BYTES)
    before = sorted(p.name for p in x.iterdir()), sorted(p.name for p in commit.iterdir())
    refused(lambda: XLSTMLanguageModel.load(x), files.COMMIT_DIR)
    assert (sorted(p.name for p in x.iterdir()), sorted(p.name for p in commit.iterdir())) == before


def test_a_plan_deletes_only_model_files_that_the_manifest_lists(tmp_path, monkeypatch):
    """The plan of an interrupted save may be someone else's (a folder copied from elsewhere): a
    name it lists is deleted only when the folder's manifest lists it as ours and it is one of
    the model files a save removes, never a file xlstm_kit did not write."""
    import json

    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save_pretrained(x, max_shard_size="10KB")
    commit = _interrupted_after_commit(x, monkeypatch, lambda: large(2).save(x))
    # files of someone else's, a model file among them (a save would have refused it before)
    theirs = {"README.md": "notes", "tokenizer.json": "{}", "train_state.pt": "optimizer"}
    for name, text in theirs.items():
        (x / name).write_text(text)
    (tmp_path / "outside.txt").write_text("mine")
    plan = json.loads((commit / files.PLAN_FILE).read_text())
    assert plan["remove"] and set(plan["remove"]) <= files.owned_files(x)  # what a save plans: ours
    shards = list(plan["remove"])
    plan["remove"] += [*theirs, "../outside.txt", str(tmp_path / "outside.txt"), files.MANIFEST_FILE, ".", ""]
    (commit / files.PLAN_FILE).write_text(json.dumps(plan))
    assert same(XLSTMLanguageModel.load(x), large(2))
    assert {n: (x / n).read_text() for n in theirs} == theirs and (tmp_path / "outside.txt").read_text() == "mine"
    assert not any((x / n).exists() for n in shards) and not commit.exists()


def test_an_interrupted_save_never_replaces_a_file_it_did_not_write(tmp_path, monkeypatch):
    """A file in the commit folder whose name is a file of the folder that no manifest lists (put
    there by someone else, or since the save committed) is refused in one line, and nothing is
    moved; once it is moved away the save completes."""
    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    commit = _interrupted_after_commit(x, monkeypatch, lambda: large(2).save_pretrained(x, max_shard_size="10KB"))
    shard = sorted(p.name for p in commit.iterdir() if p.name.startswith("model-"))[0]
    (x / shard).write_text("theirs")
    (commit / "README.md").write_text("from the commit folder")
    (x / "README.md").write_text("mine")
    before = sorted(p.name for p in commit.iterdir())
    refused(lambda: XLSTMLanguageModel.load(x), files.COMMIT_DIR)
    assert (x / shard).read_text() == "theirs" and (x / "README.md").read_text() == "mine"
    assert sorted(p.name for p in commit.iterdir()) == before  # nothing moved
    (x / shard).unlink()
    (commit / "README.md").unlink()
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))
    assert (x / "README.md").read_text() == "mine"


def test_a_file_put_into_the_commit_folder_moves_in_but_stays_the_users(tmp_path, monkeypatch):
    """A file in the commit folder that its manifest does not list (put there by someone else while
    the save was interrupted) moves in with the save but is never claimed, not even while the save
    is carried out (it was, until the commit folder's manifest replaced the folder's: a process
    killed in between left it listed as ours): the next save leaves it as it is instead of
    removing it as a stale file of ours."""
    import os

    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    commit = _interrupted_after_commit(x, monkeypatch, lambda: large(2).save_pretrained(x))
    (commit / "notes.txt").write_text("theirs")
    real = os.replace

    def killed_at_first_move(src, dst, *a, **kw):
        if files.COMMIT_DIR in str(src):
            raise KeyboardInterrupt
        return real(src, dst, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed_at_first_move)
        with pytest.raises(KeyboardInterrupt):
            files.finish_interrupted_save(x)
    assert "notes.txt" not in files.owned_files(x) and "model.safetensors" in files.owned_files(x)
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))
    assert (x / "notes.txt").read_text() == "theirs" and "notes.txt" not in files.owned_files(x)
    assert "model.safetensors" in files.owned_files(x)
    large(3).save(x)
    assert (x / "notes.txt").read_text() == "theirs" and same(XLSTMLanguageModel.load(x), large(3))


def test_a_save_over_an_earlier_versions_model_killed_while_finishing_completes(tmp_path, monkeypatch):
    """The earlier version's files are written into the manifest before the commit: once the new
    weights (safetensors metadata "pt") are in, nothing else shows that its checksums.json is
    ours, and the save, carried out again, must still remove it."""
    import os

    x = tmp_path / "x"
    large(1).save(x)
    (x / MANIFEST_FILE).unlink()  # as an earlier version left it
    real = os.unlink

    def stop_at_first_removal(path, *args, **kwargs):
        if str(path).endswith("checksums.json"):
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(os, "unlink", stop_at_first_removal)
        with pytest.raises(KeyboardInterrupt):
            large(2).save_pretrained(x)
    assert (x / "checksums.json").exists()
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))
    assert not (x / "checksums.json").exists()


def test_a_planted_commit_manifest_makes_no_file_of_the_users_ours(tmp_path):
    """The commit folder of an interrupted save may be someone else's (a folder copied from
    elsewhere), its manifest too. Carrying the save out makes ours only what the folder's own
    manifest listed and what the commit folder brings in; a file of the user's that the planted
    manifest names stays foreign, so a later save refuses it instead of deleting it as a stale
    file of ours (it deleted tokenizer_config.json), and no file of the user's counts as ours."""
    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    ours = files.owned_files(x)
    theirs = {"tokenizer_config.json": "mine", "notes.txt": "mine too"}
    for name, text in theirs.items():
        (x / name).write_text(text)
    commit = x / files.COMMIT_DIR
    commit.mkdir()
    (commit / "extra.txt").write_text("brought by the commit folder")
    (commit / MANIFEST_FILE).write_bytes(files.manifest_bytes(ours | set(theirs) | {"extra.txt"}))
    assert same(XLSTMLanguageModel.load(x), large(1))  # carries the "save" out
    assert not commit.exists()
    assert files.owned_files(x) == ours | {"extra.txt"}
    refused(lambda: large(2).save(x), "tokenizer_config.json")
    assert {n: (x / n).read_text() for n in theirs} == theirs


def test_a_save_whose_finishing_was_killed_keeps_its_new_files_ours(tmp_path, monkeypatch):
    """A process carrying out an interrupted save is killed after it moved the new files in but
    before it replaced the manifest: the next one, finding them no longer in the commit folder,
    still counts them as ours (a later save removes the stale shards rather than refusing them)."""
    import os

    from xlstm_kit.io import files

    x = tmp_path / "x"
    large(1).save(x)
    commit = _interrupted_after_commit(x, monkeypatch, lambda: large(2).save_pretrained(x, max_shard_size="10KB"))
    shards = sorted(p.name for p in commit.iterdir() if p.name.startswith("model-"))
    assert shards
    real = os.replace

    def killed_at_the_manifest(src, dst):
        if str(src) == str(commit / MANIFEST_FILE):
            raise KeyboardInterrupt
        return real(src, dst)

    with monkeypatch.context() as m:
        m.setattr(os, "replace", killed_at_the_manifest)
        with pytest.raises(KeyboardInterrupt):
            XLSTMLanguageModel.from_pretrained(x)
    assert all((x / n).exists() for n in shards) and not any((commit / n).exists() for n in shards)
    assert same(XLSTMLanguageModel.from_pretrained(x), large(2))
    assert set(shards) <= files.owned_files(x)
    large(3).save(x)
    assert not any((x / n).exists() for n in shards)
    assert same(XLSTMLanguageModel.load(x), large(3))


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
def test_fsync_tree_flushes_what_a_save_wrote_and_opens_nothing_else(tmp_path, monkeypatch):
    """fsync_tree opened by name every entry that a check of its name showed to be a regular file:
    a FIFO put in a folder being saved, in place of a file after that check, blocked the open for
    ever. It flushes regular files and folders, each file opened without blocking and checked by
    its descriptor, and leaves FIFOs, devices and links unopened."""
    import os

    from xlstm_kit.io.files import fsync_tree

    x = tmp_path / "x"
    (x / "sub").mkdir(parents=True)
    (x / "a").write_text("a")
    (x / "sub" / "b").write_text("b")
    os.mkfifo(x / "fifo")
    os.mkfifo(x / "swapped")  # a FIFO that a check of its name sees as the file it replaced
    (x / "to-fifo").symlink_to(x / "fifo")
    (x / "to-file").symlink_to(x / "a")
    (x / "null").symlink_to(os.devnull)
    stand_in = tmp_path / "stand-in"
    stand_in.write_text("s")
    real_stat, real_lstat, real_fsync = os.stat, os.lstat, os.fsync
    swap = lambda p: stand_in if os.fspath(p) == os.fspath(x / "swapped") else p  # noqa: E731
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(swap(p), *a, **k))
    monkeypatch.setattr(os, "lstat", lambda p, *a, **k: real_lstat(swap(p), *a, **k))
    flushed = []

    def fsync(fd):
        st = os.fstat(fd)
        flushed.append((st.st_dev, st.st_ino))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fsync_tree(x)
    monkeypatch.undo()
    ino = lambda p: (real_stat(p).st_dev, real_stat(p).st_ino)  # noqa: E731
    assert sorted(flushed) == sorted(ino(p) for p in (x, x / "sub", x / "a", x / "sub" / "b"))
    assert flushed.index(ino(x / "sub" / "b")) < flushed.index(ino(x / "sub")) < flushed.index(ino(x))
