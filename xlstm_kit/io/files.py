"""Crash-safe writes, and which files in a folder are ours.

**Ownership.** Every folder xlstm_kit writes a model, a training checkpoint or a training run
into holds ``.xlstm-kit-files.json`` (the *manifest*): ``{"written_by": "xlstm_kit", "files":
[names]}``, the plain file names in that folder that xlstm_kit wrote. xlstm_kit deletes or
overwrites a file only when a manifest lists it (or, for the hidden temporaries it names itself,
when its name says so); any other file is *foreign* and is left byte for byte as it was. Where a
save would have to overwrite a foreign file, or would leave one that loading reads as part of the
model (a foreign ``config.json``, ``model.safetensors.index.json``, shard, tokenizer file,
``checksums.json``), it refuses in one line naming the file instead. Folders written before
manifests existed hold no manifest: their files count as foreign for a model save (the refusal
says which to move) — run folders and training checkpoints of that age are recognised by their
``latest`` and ``train_meta.json`` (xlstm_kit.io.checkpoint).

**Saving a model folder atomically** (:func:`save_folder`). A new folder is written under a
hidden name beside it and renamed into place: it appears complete or not at all. Over an
existing folder the new files are written into a hidden staging folder inside it
(``.xlstm-kit-staging-<hex>``) with the new manifest and a plan (the stale files of ours to
delete: e.g. the shards and index of an earlier sharded save), flushed to disk, and committed by
renaming the staging folder to ``.xlstm-kit-commit``. Before that rename the folder holds the
old model untouched; from it on the save is complete and is only carried out: each file is
renamed over the old one, the stale files are deleted, the manifest is replaced and the commit
folder removed. A process killed at any point leaves either the old model or a commit folder,
which the next load or save of that folder carries out first (:func:`finish_interrupted_save`),
so a reader gets the old model or the new one, never a mix, never neither. A commit folder may
be someone else's (a folder copied from elsewhere): carrying it out replaces or deletes only files
the folder's manifest lists, and its manifest makes ours only those and the files it brings in.
A staging folder that was never committed is removed by the next save into the folder.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any, Callable, Iterable

from ..errors import XLSTMKitError
from .jsonfile import open_regular, read_json

MANIFEST_FILE = ".xlstm-kit-files.json"
STAGING_PREFIX = ".xlstm-kit-staging-"
COMMIT_DIR = ".xlstm-kit-commit"
PLAN_FILE = ".xlstm-kit-plan.json"  # inside a staging / commit folder only
MAX_MANIFEST_BYTES = 1 << 20

# What loading a model folder reads (xlstm_kit.io.checkpoint, .hf, .tokenizers): a foreign file
# of one of these names in a folder we save a model into would be overwritten or read with it.
MODEL_FILES = re.compile(r"config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                         r"model-\d{5}-of-\d{5}\.safetensors|checksums\.json|tokenizer\.json|tokenizer_config\.json")
_STAGING = re.compile(re.escape(STAGING_PREFIX) + r"[0-9a-f]{12}")
# atomic_write's temporary of the manifest (claim), left by a process killed while writing it
_MANIFEST_TMP = re.compile(re.escape(f".{MANIFEST_FILE}.") + r"\d+\.[0-9a-f]{12}\.tmp")


# --------------------------------------------------------------------------------------------
# Crash-safe writes
# --------------------------------------------------------------------------------------------


# without O_NONBLOCK the open of a FIFO waits for a writer, for ever
_NO_WAIT = os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):
        # O_DIRECTORY: a FIFO put where the folder was fails the open instead of blocking it
        fd = os.open(path, os.O_RDONLY | _NO_WAIT | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _fsync_file(path: Path) -> None:
    # Only regular files hold data a save wrote. Anything else in its folder was put there by
    # someone else and is left unopened: a FIFO would block the open, a device act on it, a link
    # lead outside the folder. Checked by name first, so that a device is not opened, then by the
    # descriptor, for one put there after that check.
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return
        fd = os.open(path, os.O_RDONLY | _NO_WAIT | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):  # gone, or now a link or a socket
            return
        raise
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush what a save wrote into the folder ``path``: every regular file and folder under it,
    and the folder itself (each folder after its files). Other entries (FIFOs, sockets, devices,
    links) hold nothing of it and are passed over unopened."""
    for folder, _, names in os.walk(path, topdown=False):  # links to folders are not followed
        for name in names:
            _fsync_file(Path(folder) / name)
        fsync_dir(Path(folder))


def atomic_write(path: str | Path, data: bytes | str | Callable[[Any], None]) -> Path:
    """Replace ``path`` with ``data`` (bytes, text, or a function writing to a binary file).

    The data goes to a uniquely named file beside ``path``, is flushed, then renamed over it:
    readers see the old file or the complete new one, never a partial one, and processes racing
    to write the same file are safe (the last rename wins).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name opened with "x" (not mkstemp): the file gets the usual umask permissions.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "xb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    # os.umask can only be read by setting it; /proc avoids the brief window where another
    # thread would create files with the wrong mode.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _make_hidden_dir(parent: Path, prefix: str) -> Path:
    """A new, uniquely named folder in ``parent`` with the usual umask permissions (mkdtemp
    would make it 0700 whatever the umask)."""
    while True:
        path = parent / f"{prefix}{secrets.token_hex(6)}"
        try:
            path.mkdir(mode=0o777)
            return path
        except FileExistsError:
            continue


# --------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def owned_files(folder: str | Path) -> set[str]:
    """The names ``folder``'s manifest lists as written by xlstm_kit; empty without a (readable)
    manifest, so that an unreadable one makes nothing deletable."""
    f = Path(folder) / MANIFEST_FILE
    try:
        d = read_json(f, MAX_MANIFEST_BYTES)
    except (OSError, XLSTMKitError):  # none, a FIFO, too large, too deep, not JSON, not an object
        return set()
    names = d.get("files") if isinstance(d, dict) and d.get("written_by") == "xlstm_kit" else None
    return {n for n in names if _plain_name(n)} if isinstance(names, list) else set()


def manifest_bytes(names: Iterable[str]) -> bytes:
    return (json.dumps({"written_by": "xlstm_kit", "files": sorted(set(names))}, indent=2) + "\n").encode()


def write_manifest(folder: Path, names: Iterable[str]) -> None:
    """Replace ``folder``'s manifest by one listing ``names`` (none: no manifest)."""
    names = set(names)
    if names:
        atomic_write(Path(folder) / MANIFEST_FILE, manifest_bytes(names))
    else:
        (Path(folder) / MANIFEST_FILE).unlink(missing_ok=True)


def claim(folder: Path, names: Iterable[str]) -> None:
    """Add ``names`` to ``folder``'s manifest (files xlstm_kit is about to write there)."""
    owned = owned_files(folder)
    if not set(names) <= owned:
        write_manifest(folder, owned | set(names))


# What `XLSTMLanguageModel.save` wrote before folders had a manifest; recognised by the weights'
# safetensors metadata {"format": "xlstm_kit"}, so that a save over a model of an earlier version
# replaces it instead of refusing its files as foreign.
_EARLIER_MODEL_FILES = ("config.json", "model.safetensors", "checksums.json", "tokenizer.json")
_MAX_HEADER_BYTES = 100 << 20


def _earlier_model_files(folder: Path) -> set[str]:
    """The files of an `xlstm_kit` model folder written before manifests existed, or none."""
    if (folder / MANIFEST_FILE).exists():
        return set()
    weights = folder / "model.safetensors"
    try:
        if weights.is_symlink():
            return set()
        # checked by the open descriptor: a FIFO put there after a check of the name would block
        # an open of the name for ever; anything but a regular file is not an earlier save's
        with open_regular(weights) as fh:
            n = int.from_bytes(fh.read(8), "little")
            if not 2 <= n <= _MAX_HEADER_BYTES:
                return set()
            header = json.loads(fh.read(n))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return set()
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not (isinstance(meta, dict) and meta.get("format") == "xlstm_kit"):
        return set()
    return {n for n in _EARLIER_MODEL_FILES if (folder / n).is_file() and not (folder / n).is_symlink()}


def not_ours(path: Path, why: str) -> XLSTMKitError:
    return XLSTMKitError(f"{path} was not written by xlstm_kit (no {MANIFEST_FILE} there lists it) and {why}: "
                         f"move it away or choose another folder")


# --------------------------------------------------------------------------------------------
# Atomic saves of a model folder
# --------------------------------------------------------------------------------------------


def _foreign_model_files(folder: Path, owned: set[str], also: Iterable[str] = ()) -> list[str]:
    also = set(also)
    return sorted(n for n in os.listdir(folder) if n not in owned and (MODEL_FILES.fullmatch(n) or n in also))


def _refuse_foreign(folder: Path, foreign: list[str]) -> None:
    if foreign:
        more = f" (and {len(foreign) - 1} more such files)" if len(foreign) > 1 else ""
        raise not_ours(folder / foreign[0], f"a model saved into {folder} would overwrite it or be read with it{more}")


def finish_interrupted_save(folder: str | Path) -> None:
    """Carry out a save into ``folder`` that was committed but not completed (a process killed
    while it renamed the new files into place): see the module docstring. Does nothing when
    there is none; XLSTMKitError (one line) when it cannot be completed here."""
    folder = Path(folder)
    commit = folder / COMMIT_DIR
    if not commit.is_dir() or commit.is_symlink():
        return
    try:
        plan_file = commit / PLAN_FILE
        # no plan: the last step (removing the commit folder) was under way, all else is done
        remove = read_json(plan_file, MAX_MANIFEST_BYTES)["remove"] if plan_file.exists() else []
        if not isinstance(remove, list):
            raise ValueError("a list of files to remove was expected")
        # The commit folder, its plan and its manifest may be someone else's (a folder copied
        # from elsewhere holds whatever it holds): a file of the folder is replaced or deleted
        # only when the folder's manifest says it is ours, as for a save, which refuses foreign
        # files before it commits and so never plans more. The old manifest is replaced last, so
        # a process that carries the save out again gets the same answer.
        # The commit folder is listed before the folder's manifest is read: a file missing from
        # it was moved by a process carrying the save out too, which claimed it first (below).
        moves = [n for n in sorted(os.listdir(commit)) if n not in (PLAN_FILE, MANIFEST_FILE)]
        ours = owned_files(folder) | _earlier_model_files(folder)
        for name in moves:
            # folder first, then commit: a file moved there meanwhile by a process finishing the
            # save too has left the commit folder (a rename is atomic)
            if name not in ours and os.path.lexists(folder / name) and os.path.lexists(commit / name):
                raise not_ours(folder / name, "the interrupted save would replace it")
        # The new manifest may make ours only what is ours already and what the commit folder
        # brings in (all that a save's manifest lists): a name more, a file of the user's, would
        # be deleted or overwritten by the next save as one of ours. The files brought in go into
        # the folder's manifest before they move, so that a process carrying the save out again
        # (this one killed, or another at once) that no longer finds them here counts them too.
        # Only the names the commit folder's own manifest lists: a file put into the commit folder
        # by anyone else moves with the save but stays the user's (not deletable by a later save).
        listed = owned_files(commit)
        claimable = ours | (set(moves) & listed)
        claim(folder, claimable)
        for name in moves:
            with contextlib.suppress(FileNotFoundError):  # moved by a process finishing it too
                os.replace(commit / name, folder / name)
        for name in remove:
            # only model files of ours: all that a save removes (stale shards, index, checksums)
            if _plain_name(name) and name in ours and MODEL_FILES.fullmatch(name):
                (folder / name).unlink(missing_ok=True)
        # last: the old manifest listed the removed files. An unreadable one lists nothing: it
        # goes in as it is, and then nothing in the folder counts as ours.
        if listed <= claimable:
            with contextlib.suppress(FileNotFoundError):  # moved by a process finishing it too
                os.replace(commit / MANIFEST_FILE, folder / MANIFEST_FILE)
        else:  # it names files that are not ours: left out
            atomic_write(folder / MANIFEST_FILE, manifest_bytes(listed & claimable))
            (commit / MANIFEST_FILE).unlink(missing_ok=True)
        fsync_dir(folder)
        shutil.rmtree(commit)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, FileNotFoundError) and not commit.exists():
            return  # another process completed it meanwhile
        raise XLSTMKitError(f"{folder} holds a save that was interrupted after it was complete ({COMMIT_DIR}), "
                            f"and completing it failed: {getattr(e, 'strerror', None) or e}") from None


def _remove_uncommitted(folder: Path) -> None:
    for name in os.listdir(folder):
        p = folder / name
        if _STAGING.fullmatch(name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif _MANIFEST_TMP.fullmatch(name) and p.is_file() and not p.is_symlink():
            p.unlink(missing_ok=True)


def save_folder(target: str | Path, write: Callable[[Path], list[str]]) -> Path:
    """Save a model into the folder ``target`` atomically (see the module docstring).

    ``write(folder)`` writes the model's files into an empty folder and returns their names.
    Files in ``target`` that no manifest lists stay as they are; one of a name loading reads
    (MODEL_FILES, or one ``write`` produced) makes it refuse, before anything is written where
    the name pattern already shows it. Returns ``target``."""
    target = Path(target)
    if target.exists() and not target.is_dir():
        raise XLSTMKitError(f"cannot save a model to {str(target)!r}: it exists and is not a folder")
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _make_hidden_dir(target.parent, f".{target.name}.tmp-")
        try:
            names = write(tmp)
            (tmp / MANIFEST_FILE).write_bytes(manifest_bytes(names))
            fsync_tree(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(target.parent)
        return target

    finish_interrupted_save(target)
    _remove_uncommitted(target)
    owned = {n for n in owned_files(target) | _earlier_model_files(target) if os.path.lexists(target / n)}
    _refuse_foreign(target, _foreign_model_files(target, owned))
    staging = _make_hidden_dir(target, STAGING_PREFIX)
    try:
        names = write(staging)
        _refuse_foreign(target, _foreign_model_files(target, owned, names))
        stale = sorted(n for n in owned if MODEL_FILES.fullmatch(n) and n not in names)
        (staging / MANIFEST_FILE).write_bytes(manifest_bytes((owned - set(stale)) | set(names)))
        (staging / PLAN_FILE).write_text(json.dumps({"remove": stale}) + "\n")
        fsync_tree(staging)
        # The files of an earlier version's model (no manifest) into the manifest first:
        # finishing the save replaces or removes only what the manifest lists, and once the
        # new files are in, the earlier weights that vouch for the others may be gone.
        claim(target, owned)
        try:
            os.rename(staging, target / COMMIT_DIR)  # the commit point
        except OSError as e:
            busy = (target / COMMIT_DIR).exists()  # another save committed meanwhile and is completing
            raise XLSTMKitError(f"cannot save into {target}: "
                                + ("another save into it is under way" if busy else str(e.strerror or e))) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_dir(target)
    finish_interrupted_save(target)
    return target
