"""Shared test utilities: the relative error every tolerance in the tests is stated in, and
hostile files in place of the files the library reads (and a call that must not block on one)."""
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


def without_hang(call, fifo, seconds: float = 2):
    """``call()`` in a thread: its exception (None: it returned). A call still blocked after
    ``seconds`` (opening the FIFO ``fifo`` without a writer) is let go by a writer's open and close,
    and fails the test. Where pytest-timeout cannot end a hang: an open blocked in native code
    (safetensors' Rust) retries after the timeout's signal and never returns to Python."""
    import os
    import threading

    result = {}

    def run():
        try:
            call()
        except Exception as e:  # noqa: BLE001 - returned to the test
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    while thread.is_alive():  # each blocked open of the FIFO returns once a writer opens it
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        thread.join(0.2)
    assert not hung, "reading a FIFO blocked"
    return result.get("error")


def in_child(call, seconds: float = 30) -> tuple[str, str, bool] | None:
    """``call()`` in a forked child process: (type name, message, whether an XLSTMKitError) of its
    exception, None when it returned. A child still running after ``seconds`` is killed and fails
    the test. For a call that may block in native code without letting go of the GIL (safetensors'
    open of a FIFO), which neither pytest-timeout's signal nor a thread's join can end."""
    import multiprocessing

    from xlstm_kit.errors import XLSTMKitError

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def run():
        try:
            call()
            send.send(None)
        except BaseException as e:  # noqa: BLE001 - returned to the test
            send.send((type(e).__name__, str(e), isinstance(e, XLSTMKitError)))

    child = ctx.Process(target=run, daemon=True)
    child.start()
    child.join(seconds)
    hung = child.is_alive()
    if hung:
        child.kill()
        child.join()
    assert not hung, f"the call was still running after {seconds} s (blocked on a FIFO?)"
    assert receive.poll(), f"the child ended without a result (exit code {child.exitcode})"
    return receive.recv()


def destroy_together() -> None:
    """``destroy_process_group()`` in a worker of ``spawn_ranks``, every rank entering it and
    leaving (towards its process's exit) together, through the rendezvous store: gloo aborted
    a rank (SIGABRT, "terminate called without an active exception") whose peer tore down its
    connections, or exited, while it was still in a collective's tail or its own teardown."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store, world = _get_default_store(), dist.get_world_size()

    def all_here(key: str) -> None:
        if store.add(key, 1) == world:
            store.set(f"{key}/all", b"1")
        store.wait([f"{key}/all"])

    all_here("teardown/enter")
    dist.destroy_process_group()
    all_here("teardown/leave")


def spawn_ranks(worker, world: int, *args) -> None:
    """``torch.multiprocessing.spawn(worker, (world, port, *args), world)`` as torchrun runs its
    workers: the rendezvous store is served by this process, not by rank 0, so a rank that
    finishes first takes nothing away from the others while they tear down their process group.
    The store picks its own free port (no window in which another test takes it)."""
    import os
    from datetime import timedelta

    import torch.multiprocessing as mp
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    saved = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # read by the workers' rendezvous: connect, don't serve
    try:
        mp.spawn(worker, args=(world, store.port, *args), nprocs=world, join=True)
    finally:
        if saved is None:
            del os.environ["TORCHELASTIC_USE_AGENT_STORE"]
        else:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = saved
        del store
