"""Helpers the GPU benchmark scripts of benchmarks/ share (each script imports only xlstm_kit):
jobs in child processes with a time limit, the peers' wheels on the children's path, CUDA-event
timing, and the packed-sequence lengths of the varlen scripts. torch is imported inside the
helpers that need it: a script's parent process only starts and watches its children, which
import torch themselves."""
from __future__ import annotations

import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, children first, from Linux's /proc (elsewhere: none)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            # the command name in parentheses may itself hold spaces and parentheses
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every process below it. torchrun starts each worker in
    a session of its own: killing torchrun's group alone would leave the workers running (a hung
    NCCL collective holding its GPU) and holding our pipes open. They are listed before anything
    is killed, since orphans lose their parent link."""
    below = _descendants(pid)
    try:
        os.killpg(pid, signal.SIGKILL)  # the child and its compile workers
    except ProcessLookupError:
        pass
    for p in below:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_child(cmd: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Run `cmd` in its own process group; at the time limit kill it and every process it
    started (its own group and the sessions of its own that torchrun's workers run in). Returns
    rc (None on timeout), the parsed `RESULT {json}` lines printed before it ended, the tail of
    its stderr, and the wall time."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_tree(proc.pid)
        out, err = proc.communicate()
    results = []
    for line in (out or "").splitlines():
        if line.startswith("RESULT "):
            try:
                results.append(json.loads(line[len("RESULT "):]))
            except json.JSONDecodeError:
                pass
    return dict(rc=None if timed_out else proc.returncode, timed_out=timed_out, results=results,
                stderr=(err or "")[-4000:], wall_s=time.time() - t0)


def child_exit(job) -> None:
    """Run a child process's job (a callable) and leave the process at once: status 0, or 1
    with the traceback printed (the parent reports its last line). No interpreter shutdown: a
    compile-worker pool, a CUDA or NCCL teardown that hangs at exit would otherwise hold the
    job until its time limit, its results already printed."""
    import traceback

    code = 0
    try:
        job()
    except BaseException:  # noqa: BLE001 - any failure, KeyboardInterrupt included, is the parent's to report
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def install_wheels(wheel_dir: str, log) -> tuple[str | None, str]:
    """pip-install DIR/*.whl into a fresh temporary folder -> (folder or None, note)."""
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        return None, f"no wheels in {wheel_dir}"
    site = tempfile.mkdtemp(prefix="e2e-site-")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--target", site, *wheels]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return None, "pip install timed out"
    log.write(f"## pip install\n{r.stdout[-2000:]}{r.stderr[-2000:]}\n")
    if r.returncode != 0:
        return None, f"pip install failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}"
    return site, "installed " + ", ".join(os.path.basename(w).split("-")[0] + " " + os.path.basename(w).split("-")[1]
                                          for w in wheels)


def event_ms(fn, reps: int, warmup: int = 1, cuda: bool | None = None) -> list[float]:
    """ms of each of `reps` calls of fn() after `warmup` calls: CUDA events for GPU work (cuda
    None: when a GPU is there), else the wall clock."""
    import torch

    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


def child_env(wheel_dir: str | None) -> dict:
    """os.environ for the children, with DIR/*.whl installed on their PYTHONPATH (the note on stderr)."""
    env = dict(os.environ)
    if wheel_dir:
        path, note = install_wheels(wheel_dir, sys.stderr)
        if path:
            env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
        print(note, file=sys.stderr)
    return env


def packed_lengths(n: int, total: int, lo: int, hi: int) -> list[int]:
    """`n` sequence lengths in [lo, hi] (seed 0) that add up to `total`, for packed-sequence runs."""
    import torch

    g = torch.Generator().manual_seed(0)
    raw = torch.randint(lo, hi + 1, (n,), generator=g).double()
    ls = (raw * total / raw.sum()).floor().long().clamp(1, None)
    ls[torch.argmax(ls)] += total - int(ls.sum())   # the rounding remainder to the longest
    return ls.tolist()


def median_fwbw_ms(fn, xs, reps: int, device) -> float:
    """Median ms of forward + backward of fn(*xs)[0] (event_ms, two warm-up calls)."""
    import torch

    def once():
        out = fn(*xs)[0]
        out.backward(torch.ones_like(out))
    return statistics.median(event_ms(once, reps, warmup=2, cuda=device.type == "cuda"))
