"""benchmarks/scaling.py's helpers: a job whose workers run in sessions of their own (torchrun's)
is killed whole at its time limit."""
import sys
import time
from pathlib import Path

from xlstm_kit.bench.scripts import run_child


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie has ended; only its parent's wait is missing


def test_time_limit_kills_workers_in_their_own_sessions():
    # as torchrun starts its workers: a new session each, holding the parent's stdout
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
            "print('RESULT {\"pid\": %d}' % p.pid, flush=True)\n"
            "time.sleep(120)\n")
    res = run_child([sys.executable, "-c", code], 3)
    assert res["timed_out"] and res["rc"] is None
    assert res["wall_s"] < 30  # not held until the worker ends by itself
    pid = res["results"][0]["pid"]
    deadline = time.time() + 10
    while _alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
