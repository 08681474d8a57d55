"""xlstm_kit.io.jsonfile, the one bounded reader of the library's JSON files: a file that is not
a regular file, one larger than its bound or JSON nested too deeply is a one-line JSONFileError
naming it, at once (the readers of each kind of file have their own tests of the same)."""
import os

import pytest

from tests.helpers import HOSTILE_FILES, HOSTILE_MESSAGES, make_hostile
from xlstm_kit.errors import MissingFileError, XLSTMKitError
from xlstm_kit.io.jsonfile import (JSONFileError, checked_path, read_bytes, read_json, read_json_lines,
                                  regular_file_exists)


def refused(call, needle):
    with pytest.raises(JSONFileError) as e:
        call()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_hostile_files_are_refused_in_one_line(tmp_path, kind):
    f, bound = tmp_path / "f.json", 1 << 20  # the nested JSON is 200 kB
    make_hostile(f, kind, bound)
    refused(lambda: read_json(f, bound), HOSTILE_MESSAGES[kind])
    if kind != "nested":
        refused(lambda: read_bytes(f, bound), HOSTILE_MESSAGES[kind])
    if kind == "fifo":
        refused(lambda: read_json_lines(f), "not a regular file")


@pytest.mark.timeout(60)
def test_devices_folders_and_links_to_them_are_refused(tmp_path):
    (tmp_path / "zero").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    for path in ("/dev/zero", tmp_path / "zero", tmp_path, tmp_path / "to-fifo"):
        refused(lambda: read_json(path, 1000), "not a regular file")
        refused(lambda: read_json_lines(path), "not a regular file")


def test_a_missing_file_is_missing_file_error(tmp_path):
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path in (tmp_path / "absent.json", tmp_path / "dangling"):
        with pytest.raises(MissingFileError, match="does not exist"):
            read_json(path, 1000)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_an_unreadable_file_is_one_line(tmp_path):
    f = tmp_path / "locked.json"
    f.write_text("{}")
    f.chmod(0)
    with pytest.raises(XLSTMKitError, match="Permission denied"):
        read_json(f, 1000)


def test_the_error_type_is_the_callers(tmp_path):
    class Mine(XLSTMKitError):
        pass

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(Mine, match="not a regular file"):
        read_json(tmp_path / "fifo", 1000, error=Mine)
    (tmp_path / "ok.json").write_text('{"a": [1, {"b": null}]}')
    assert read_json(tmp_path / "ok.json", 1000) == {"a": [1, {"b": None}]}


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
def test_regular_file_exists_is_false_only_for_nothing_there(tmp_path):
    """For files that may be absent: False only where nothing is; a FIFO, a device, a folder or a
    link to one is refused (a check of the name took each of them for an absent file)."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "to-file").symlink_to(tmp_path / "file")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert regular_file_exists(tmp_path / "file") and regular_file_exists(tmp_path / "to-file")
    for path in (tmp_path / "absent", tmp_path / "dangling", tmp_path / "absent" / "file", tmp_path / "file" / "x"):
        assert not regular_file_exists(path)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    for path in (tmp_path / "fifo", tmp_path / "to-fifo", "/dev/null", tmp_path):
        refused(lambda: regular_file_exists(path), "not a regular file")

    class Mine(XLSTMKitError):
        pass

    with pytest.raises(Mine, match="fifo is not a regular file"):
        regular_file_exists(tmp_path / "fifo", error=Mine)


def _open_descriptors():
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux's /proc/self/fd")
def test_checked_path_opens_the_file_checked_whatever_is_at_its_name_by_then(tmp_path):
    """The name checked_path yields (for safetensors, which opens names itself) opens the file
    that was checked: a FIFO put at its name afterwards is never what is opened. The descriptor
    is closed when the block ends, also on an error."""
    f = tmp_path / "weights"
    f.write_bytes(b"checked")
    before = _open_descriptors()
    with checked_path(f) as name:
        assert name != str(f)
        f.unlink()
        os.mkfifo(f)
        with open(name, "rb") as g:  # a plain open: the FIFO's would block for ever
            assert g.read() == b"checked"
    assert _open_descriptors() == before
    (tmp_path / "again").write_bytes(b"x")
    with pytest.raises(RuntimeError, match="in the block"):
        with checked_path(tmp_path / "again"):
            raise RuntimeError("in the block")
    assert _open_descriptors() == before


@pytest.mark.timeout(60)
def test_checked_path_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-fifo").symlink_to(tmp_path / "fifo")
    for path in (tmp_path / "fifo", tmp_path / "to-fifo", "/dev/null", tmp_path):
        refused(lambda: checked_path(path).__enter__(), "not a regular file")
    with pytest.raises(MissingFileError, match="absent does not exist"):
        with checked_path(tmp_path / "absent"):
            pass

    class Mine(XLSTMKitError):
        pass

    with pytest.raises(Mine, match="fifo is not a regular file"):
        with checked_path(tmp_path / "fifo", error=Mine):
            pass


@pytest.mark.timeout(60)
@pytest.mark.skipif(not os.path.isdir("/dev/fd"), reason="no /dev/fd")
def test_checked_path_without_proc_names_the_descriptor_in_dev_fd(tmp_path, monkeypatch):
    """Without /proc/self/fd (macOS, the BSDs) /dev/fd/N names the checked descriptor: a FIFO
    put at the file's name afterwards is still not what is opened."""
    f = tmp_path / "weights"
    f.write_bytes(b"checked")
    real_stat = os.stat

    def no_proc(p, *args, **kwargs):
        if os.fspath(p).startswith("/proc/"):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(p))
        return real_stat(p, *args, **kwargs)

    monkeypatch.setattr(os, "stat", no_proc)
    with checked_path(f) as name:
        assert name.startswith("/dev/fd/")
        f.unlink()
        os.mkfifo(f)
        with open(name, "rb") as g:
            assert g.read() == b"checked"


def test_checked_path_without_a_descriptor_name_yields_the_name(tmp_path, monkeypatch):
    """Where neither /proc/self/fd nor /dev/fd is there, or they name something else, the name
    itself: there is no other name of a descriptor to hand a reader by name."""
    f = tmp_path / "weights"
    f.write_bytes(b"x")
    real_stat = os.stat
    fd_names = ("/proc/", "/dev/fd/")

    def no_fd_names(p, *args, **kwargs):
        if os.fspath(p).startswith(fd_names):
            raise FileNotFoundError(2, "No such file or directory", os.fspath(p))
        return real_stat(p, *args, **kwargs)

    monkeypatch.setattr(os, "stat", no_fd_names)
    with checked_path(f) as name:
        assert name == str(f)
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(tmp_path if os.fspath(p).startswith(fd_names) else p,
                                                                 *a, **k))
    with checked_path(f) as name:
        assert name == str(f)
