"""The one reader of the JSON files the library opens: a model folder's config.json,
tokenizer.json, tokenizer_config.json, model.safetensors.index.json and checksums.json, a
checkpoint's train_meta.json, a run's metrics.jsonl.

Such a file may be damaged or written by someone else, and Python's json module turns some of
that into exceptions far from a one-line error: nesting deeper than the interpreter's recursion
limit (RecursionError), an integer of more than 4300 digits (ValueError, and smaller huge
integers overflow wherever they are used), bytes that are not UTF-8. Here each of those, a file
that is not a regular file (a FIFO would block, /dev/zero never end), one larger than its kind
of file can be, and a value of the wrong JSON type is an XLSTMKitError naming the file.
"""
from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from ..errors import MissingFileError, XLSTMKitError

MAX_DEPTH = 64  # the files above nest a few levels; tokenizers' files under ten
MAX_INT_DIGITS = 24  # every integer of these files fits in 64 bits (20 digits)
MAX_LINE_BYTES = 1 << 20  # a metrics.jsonl row is a few hundred bytes
# The largest each kind of file can be: configs, metadata and indexes are kilobytes; the
# tokenizer.json of a 256K vocabulary is ~35 MB.
MAX_CONFIG_BYTES = 1 << 20
MAX_META_BYTES = 16 << 20
MAX_INDEX_BYTES = 64 << 20
MAX_TOKENIZER_BYTES = 256 << 20
# tokenizer_config.json carries the added-tokens table (and often the chat template) besides
# BOS/EOS: hundreds of kB where a vocabulary has thousands of special tokens, so the bound of
# other configs is too tight. One bound for its every reader (loading a tokenizer's BOS/EOS,
# serving's chat template): a folder that serves also loads, and the other way round.
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20

_TYPE_NAMES = {dict: "a JSON object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "true or false", type(None): "null"}


class JSONFileError(XLSTMKitError):
    """A JSON file that cannot be read as the library needs it."""


def _bounded_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ValueError(f"it holds an integer of {digits} digits")
    return int(text)


def _depth(value: Any) -> int:
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if d > MAX_DEPTH:
                break
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def describe(value: Any) -> str:
    """The JSON type of ``value`` in words ("a list", "null")."""
    return _TYPE_NAMES.get(type(value), type(value).__name__)


def parse(text: str | bytes, source: str | Path, expect: type | tuple | None = None,
          error: type[XLSTMKitError] = JSONFileError) -> Any:
    """``text`` (bytes: UTF-8) as JSON, refused (``error``, naming ``source``) when it is not
    UTF-8, not JSON, nested deeper than MAX_DEPTH, holds an integer of more than MAX_INT_DIGITS
    digits, or (``expect``) is not of that Python type."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{source} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        value = json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise error(f"{source} is nested too deeply to be one of the library's JSON files") from None
    except json.JSONDecodeError as e:
        raise error(f"{source} is not valid JSON ({e.msg}: line {e.lineno} column {e.colno})") from None
    except ValueError as e:  # from _bounded_int, or the interpreter's own limit on digits
        raise error(f"{source} is not usable JSON: {str(e).split(';')[0]}") from None
    if _depth(value) > MAX_DEPTH:
        raise error(f"{source} is nested more than {MAX_DEPTH} levels deep")
    if expect is not None and not isinstance(value, expect):
        wanted = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in (expect if isinstance(expect, tuple) else (expect,)))
        raise error(f"{source} must hold {wanted}, not {describe(value)}")
    return value


def _open_regular(path: Path, error: type[XLSTMKitError]) -> tuple[int, os.stat_result]:
    """A descriptor of ``path`` opened for reading, and its stat, once it is known to be a regular
    file. Opened first and checked after (fstat): a check of the name before opening would let a
    FIFO put there in between block the open; O_NONBLOCK keeps the open of a FIFO from waiting
    for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (FileNotFoundError, NotADirectoryError):  # the latter: a file where a folder of its path should be
        raise MissingFileError(f"{path} does not exist") from None
    except OSError as e:
        raise error(f"{path}: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path} is not a regular file")
        # a regular file reads the same with or without O_NONBLOCK; cleared anyway, so that
        # nothing depends on that
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str | Path, error: type[XLSTMKitError] = JSONFileError) -> BinaryIO:
    """``path`` opened for binary reading, refused (``error``) unless the open descriptor is a
    regular file; no bound on its size (for files that are read in pieces or may be gigabytes,
    such as a training corpus). MissingFileError when it does not exist."""
    fd, _ = _open_regular(Path(path), error)
    return open(fd, "rb")


def regular_file_exists(path: str | Path, error: type[XLSTMKitError] = JSONFileError) -> bool:
    """Whether the file ``path`` is there: False when nothing is (nor at the end of a link), True
    for a regular file, ``error`` for anything else (a FIFO, a socket, a device, a folder) or one
    that cannot be opened. For files that may be absent: a check of the name (``is_file``) passes
    over such a file as if it were absent, and a model would load without the file it has. Opened
    and checked as :func:`open_regular` does, then closed. Where a reader opens the file by name
    afterwards (a run's ``latest``), this refuses what is there now; what is put there in
    between is the reader's to refuse. safetensors is handed :func:`checked_path`'s name."""
    try:
        fd, _ = _open_regular(Path(path), error)
    except MissingFileError:
        return False
    os.close(fd)
    return True


def _descriptor_name(fd: int, st: os.stat_result) -> str | None:
    """A name whose open opens the file open as ``fd`` again, not whatever is at the file's name
    by then: /proc/self/fd/``fd`` (Linux), else /dev/fd/``fd`` (macOS and the BSDs, where its
    open duplicates the descriptor), whichever is there and names that file. None elsewhere."""
    for name in (f"/proc/self/fd/{fd}", f"/dev/fd/{fd}"):
        try:
            there = os.stat(name)
        except OSError:
            continue
        if (there.st_dev, there.st_ino) == (st.st_dev, st.st_ino):
            return name
    return None


@contextlib.contextmanager
def checked_path(path: str | Path, error: type[XLSTMKitError] = JSONFileError) -> Iterator[str]:
    """A name to hand a reader that opens files only by name (safetensors), for ``path`` opened
    and checked as :func:`open_regular` does; the descriptor stays open until the block ends.

    safetensors opens the name itself, in native code that holds the GIL: a FIFO at that name
    blocks the whole process for ever, beyond any timeout, and any check of the name before
    (even through a descriptor then closed) leaves it free to be swapped in between. The name
    yielded is that of the checked descriptor, /proc/self/fd/N or /dev/fd/N, whose open reopens
    the file that was checked. Where there is no such name (neither is mounted) it is ``path``
    itself, and a FIFO put there after the check still blocks: safetensors takes neither a
    descriptor nor a file object, and reading the file into memory instead would not do for
    weights of many gigabytes. ``error`` for anything but a regular file; MissingFileError when
    nothing is there."""
    path = Path(path)
    fd, st = _open_regular(path, error)
    try:
        yield _descriptor_name(fd, st) or str(path)
    finally:
        os.close(fd)


def read_bytes(path: str | Path, max_bytes: int, error: type[XLSTMKitError] = JSONFileError) -> bytes:
    """The content of the regular file ``path``, refused when it is larger than ``max_bytes``."""
    path = Path(path)
    fd, st = _open_regular(path, error)
    with open(fd, "rb") as f:
        if st.st_size > max_bytes:
            raise error(f"{path} is {st.st_size:,} bytes, more than the {max_bytes:,} such a file may have")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise error(f"{path}: {e.strerror or e}") from None
    if len(data) > max_bytes:  # grew since the stat
        raise error(f"{path} is more than the {max_bytes:,} bytes such a file may have")
    return data


def read_json(path: str | Path, max_bytes: int, expect: type | tuple | None = dict,
              error: type[XLSTMKitError] = JSONFileError) -> Any:
    """The JSON value of the file ``path`` (see :func:`parse` and :func:`read_bytes`);
    MissingFileError (also a FileNotFoundError) when it does not exist."""
    return parse(read_bytes(path, max_bytes, error), path, expect, error)


def read_json_lines(path: str | Path, error: type[XLSTMKitError] = JSONFileError) -> list[tuple[int, Any]]:
    """(line number, value) of each non-empty line of a JSON-lines file, read line by line; a
    last line without its newline that does not parse (a process killed while appending it) is
    left out, any other bad line refused."""
    path = Path(path)
    fd, _ = _open_regular(path, error)
    rows: list[tuple[int, Any]] = []
    with open(fd, "rb") as f:
        n = 0
        while line := f.readline(MAX_LINE_BYTES + 1):
            n += 1
            if len(line) > MAX_LINE_BYTES:
                raise error(f"{path} line {n} is more than {MAX_LINE_BYTES:,} bytes long; its rows are a few hundred")
            if not line.strip():
                continue
            try:
                rows.append((n, parse(line, f"{path} line {n}", error=error)))
            except XLSTMKitError:
                if not line.endswith(b"\n") and not f.read(1):
                    break
                raise
    return rows
