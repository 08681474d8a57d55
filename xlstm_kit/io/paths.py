"""Checks of a path before anything is written to it or read from it, each failure one line.

A folder or file about to be written is refused when a name in it is longer than the file
system allows (counting what a save adds to the name for its staging copy), when a folder above
it is a file, or when it or a folder above it is a symbolic link to nothing; the operating
system's own errors for these name a temporary file or say only "File exists".

No torch here: the command line runs these before importing it.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import XLSTMKitError

DEFAULT_NAME_MAX = 255  # bytes per name on Linux, macOS and Windows file systems


class PathError(XLSTMKitError):
    """A path that cannot be written or read as asked."""


def _name_max(path: Path) -> int:
    """NAME_MAX of the file system of the nearest existing folder above ``path``."""
    for p in path.parents:
        try:
            if p.is_dir():
                return os.pathconf(p, "PC_NAME_MAX")
        except (OSError, ValueError, AttributeError):  # a name too long itself; no pathconf (Windows)
            continue
    return DEFAULT_NAME_MAX


def _dangling(p: Path) -> bool:
    return os.path.islink(p) and not p.exists()


def check_names(path: str | Path, what: str, extra_bytes: int = 0) -> Path:
    """PathError when a name of ``path`` is longer than the file system allows; ``extra_bytes``:
    what a save adds to the last name (its staging copy ".NAME.tmp-XXXXXXXXXXXX")."""
    path = Path(path).expanduser()
    limit = _name_max(path)
    for i, part in enumerate(path.parts):
        room = limit - (extra_bytes if i == len(path.parts) - 1 else 0)
        n = len(os.fsencode(part))
        if n > room:
            shown = str(path) if len(str(path)) <= 60 else str(path)[:57] + "..."
            raise PathError(f"{what} {shown}: the name {part[:24]!r}... is {n} bytes long; a name may have at "
                            f"most {room} bytes here")
    return path


def check_writable(path: str | Path, what: str, *, folder: bool, extra_bytes: int = 0) -> Path:
    """Refuse (PathError, "WHAT PATH: the problem") a ``path`` that cannot become a folder
    (``folder``) or a file: a name too long, a file or a link to nothing above it, a link to
    nothing at it, or (for a folder) a file in its place or (for a file) a folder. Creates nothing."""
    path = check_names(path, what, extra_bytes)
    if _dangling(path):
        raise PathError(f"{what} {path}: it is a symbolic link to {os.readlink(path)}, which does not exist")
    if path.exists() and folder and not path.is_dir():
        raise PathError(f"{what} {path}: it is a file, not a folder")
    if path.exists() and not folder and path.is_dir():
        raise PathError(f"{what} {path}: it is a folder; name a file")
    for parent in path.parents:
        if _dangling(parent):
            raise PathError(f"{what} {path}: {parent} is a symbolic link to {os.readlink(parent)}, which does not exist")
        if parent.exists() and not parent.is_dir():
            raise PathError(f"{what} {path}: {parent} is a file, not a folder")
    return path


def check_readable(path: str | Path, what: str) -> Path:
    """Refuse (PathError) a ``path`` that does not exist, or is a link to nothing."""
    path = check_names(path, what)
    if _dangling(path):
        raise PathError(f"{what} {path}: it is a symbolic link to {os.readlink(path)}, which does not exist")
    if not path.exists():
        raise PathError(f"{what} {path} does not exist")
    return path
