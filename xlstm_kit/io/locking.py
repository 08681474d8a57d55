"""The lock of a run folder: one run writes a folder at a time."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

from ..errors import XLSTMKitError

try:
    import fcntl
except ImportError:  # not on Windows: run folders go unlocked there
    fcntl = None

RUN_LOCK_FILE = ".xlstm-kit.lock"  # held by the run that writes the folder (run_lock)


class RunLocked(XLSTMKitError):
    """Another process is writing the run folder."""


@contextlib.contextmanager
def run_lock(out_dir: str | Path):
    """Hold an exclusive lock on the run folder `out_dir` (created if missing) while a run
    writes it: two runs into one folder would interleave their logs and delete each other's
    staging folders. An advisory lock (flock) on the file RUN_LOCK_FILE inside the folder: the
    system releases it when the process ends, however it ends, so a killed run leaves no stale
    lock, and the file itself stays (deleting it would race with a run taking it).
    RunLocked (one line) when another process holds it."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RUN_LOCK_FILE
    if fcntl is None:  # no flock on this system: no lock
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLocked(f"{out_dir} is being written by another run (it holds {path.name}); wait for it "
                            f"to end or choose another output folder") from None
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
