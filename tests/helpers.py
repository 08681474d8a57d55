"""Shared test utilities: the relative error every tolerance in the tests is stated in, and
hostile files in place of the files the library reads."""
import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| computed in float64; fails on NaN/inf in `a`."""
    a = a.detach().double()
    b = b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values in the tested tensor"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_outside_interpreter(code: str) -> str:
    """stdout of `python -c code` from the repository root without TRITON_INTERPRET (under it
    Triton kernels are not compilable objects): the sm_90 compile checks. Fails on a non-zero
    exit with the end of its stderr."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


HOSTILE_FILES = ("fifo", "oversized", "nested")
"""The kinds of hostile file `make_hostile` puts in place of a file the library reads."""


def make_hostile(path, kind: str, max_bytes: int) -> None:
    """Replace the file ``path`` (if any) by a FIFO without a writer (a plain read blocks for
    ever), a sparse file one byte larger than ``max_bytes`` (its reader's bound; no disk used), or
    JSON nested 100,000 levels deep (json.loads: RecursionError; 200 kB, so it reaches
    the parser of readers whose bound is larger)."""
    import os
    from pathlib import Path

    path = Path(path)
    if path.is_symlink() or path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "oversized":
        with open(path, "wb") as f:
            f.truncate(max_bytes + 1)
    elif kind == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
    else:
        raise ValueError(f"unknown kind {kind!r}; one of {HOSTILE_FILES}")


HOSTILE_MESSAGES = {"fifo": "not a regular file", "oversized": "more than the", "nested": "nested"}
"""A phrase of the one-line error that each kind of `make_hostile` file gets from xlstm_kit.io.jsonfile."""
