"""benchmarks/scaling.py: the weak-scaling driver run end to end on the CPU (torchrun, gloo, 1 and
2 processes, DDP and FSDP2), its efficiency and table, its one-line refusals; and a job whose
workers run in sessions of their own (torchrun's) killed whole at its time limit."""
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.bench.test_bench import table_rows
from xlstm_kit.bench.scripts import run_child

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "scaling.py"


def _load():
    spec = importlib.util.spec_from_file_location("scaling", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


scaling = _load()


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


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("scaling")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("OUT", None)
    argv = ["--quick", "--device", "cpu", "--gpus", "1,2", "--parallel", "ddp,fsdp", "--out", str(out)]
    run = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=out, env=env, capture_output=True, text=True,
                         timeout=300)
    rows = [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()] \
        if (out / "scaling.jsonl").exists() else []
    return run, rows, out, argv


def test_quick_cpu_run_measures_every_row(quick_run):
    run, rows, _, _ = quick_run
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert sorted((r["parallel"], r["gpus"]) for r in rows) == [("ddp", 1), ("ddp", 2), ("fsdp", 1), ("fsdp", 2)]
    for r in rows:
        assert r["status"] == "ok" and r["model"] == "tiny" and r["device"] == "cpu"
        assert r["tok_s_per_gpu"] > 0 and r["step_ms"] > 0 and r["steps"] == 2 and r["loss_finite"]
        assert r["tok_s"] == pytest.approx(r["tok_s_per_gpu"] * r["gpus"])
        assert r["tok_s_per_gpu"] == pytest.approx(2 * 64 / r["step_ms"] * 1e3)
        assert r["global_batch"] == 2 * r["gpus"] and r["params_m"] > 0.1
        assert r["command"].startswith(f"torchrun --standalone --nproc-per-node {r['gpus']} benchmarks/scaling.py "
                                       f"worker --model tiny --parallel {r['parallel']} ")
    by = {(r["parallel"], r["gpus"]): r for r in rows}
    for gpus in (1, 2):  # the same weights and tokens: DDP and FSDP2 start from the same loss
        assert by["ddp", gpus]["loss_first"] == pytest.approx(by["fsdp", gpus]["loss_first"], rel=1e-5)
    # rank 1 reads other tokens than rank 0: the 2-process loss is the mean over both
    assert by["ddp", 2]["loss_first"] != pytest.approx(by["ddp", 1]["loss_first"], rel=1e-6)


def test_quick_cpu_run_efficiency_is_against_the_one_process_row(quick_run):
    _, rows, _, _ = quick_run
    by = {(r["parallel"], r["gpus"]): r for r in rows}
    for parallel in ("ddp", "fsdp"):
        one, two = by[parallel, 1], by[parallel, 2]
        assert one["efficiency"] == 1.0 and one["efficiency_base_gpus"] == 1
        assert two["efficiency_base_gpus"] == 1
        assert two["efficiency"] == pytest.approx(two["tok_s_per_gpu"] / one["tok_s_per_gpu"])


def test_quick_cpu_run_writes_a_dated_table_naming_each_row(quick_run):
    _, rows, out, argv = quick_run
    md = (out / "scaling.md").read_text()
    assert f"Command: `python3 benchmarks/scaling.py {' '.join(argv)}`" in md
    assert rows[0]["date"] in md and "Machine: CPU" in md
    table = table_rows(md)
    assert len(table) == len(rows) == 4
    for r in rows:
        [line] = [t for t in table if (t["model"], t["parallel"], t["GPUs"]) == ("tiny", r["parallel"], str(r["gpus"]))]
        assert line["status"] == "ok"
        assert line["efficiency"] == f"{r['efficiency']:.2f}"
        assert line["tokens/s per GPU"] == f"{r['tok_s_per_gpu']:,.0f}"


def test_efficiency_falls_back_to_the_smallest_count_that_ran():
    rows = [dict(model="xlstm-7b", parallel="fsdp", gpus=1, batch_per_gpu=8, status="does not fit: 104 GiB"),
            dict(model="xlstm-7b", parallel="fsdp", gpus=2, batch_per_gpu=8, status="oom"),
            dict(model="xlstm-7b", parallel="fsdp", gpus=4, batch_per_gpu=8, status="ok", tok_s_per_gpu=1000.0),
            dict(model="xlstm-7b", parallel="fsdp", gpus=8, batch_per_gpu=8, status="ok", tok_s_per_gpu=900.0)]
    scaling.add_efficiency(rows)
    assert "efficiency" not in rows[0] and "efficiency" not in rows[1]
    assert (rows[3]["efficiency"], rows[3]["efficiency_base_gpus"]) == (pytest.approx(0.9), 4)
    header = dict(date="today", command="c", models=["xlstm-7b"], gpus_here=8, settings="s")
    table = {t["GPUs"]: t for t in table_rows(scaling.render(rows, header))}
    assert table["8"]["efficiency"] == "0.90 (vs 4 GPUs)" and table["1"]["efficiency"] == "—"
    assert table["1"]["status"] == "does not fit: 104 GiB"


def test_out_of_memory_at_the_smallest_count_halves_that_model_and_modes_batch(tmp_path, monkeypatch):
    calls = []

    def fake_job(args, model, parallel, n, batch, limit, env):
        calls.append((parallel, n, batch))
        fits = batch <= (4 if parallel == "ddp" else 8) and not (parallel == "fsdp" and n == 2)
        return dict(model=model, parallel=parallel, gpus=n, batch_per_gpu=batch, seq=args.seq,
                    **(dict(status="ok", tok_s_per_gpu=100.0 * batch / n ** 0.1, step_ms=1.0) if fits
                       else dict(status="oom")))

    monkeypatch.setattr(scaling, "run_job", fake_job)
    assert scaling.main(["--device", "cpu", "--models", "125M-7:1", "--gpus", "1,2,4", "--out", str(tmp_path)]) == 1
    assert calls == [("ddp", 1, 16), ("ddp", 1, 8), ("ddp", 1, 4), ("fsdp", 1, 16), ("fsdp", 1, 8),
                     ("ddp", 4, 4), ("fsdp", 4, 8), ("ddp", 2, 4), ("fsdp", 2, 8)]  # no halving above 1 GPU
    rows = {(r["parallel"], r["gpus"]): r for r in
            map(json.loads, (tmp_path / "scaling.jsonl").read_text().splitlines())}
    assert rows["ddp", 4]["efficiency"] == pytest.approx(4 ** -0.1) and rows["ddp", 4]["efficiency_base_gpus"] == 1
    assert rows["fsdp", 2]["status"] == "oom" and "efficiency" not in rows["fsdp", 2]
    table = {(t["parallel"], t["GPUs"]): t for t in table_rows((tmp_path / "scaling.md").read_text())}
    assert table["ddp", "1"]["batch per GPU"] == "4 × 2048" and table["fsdp", "4"]["batch per GPU"] == "8 × 2048"


@pytest.mark.parametrize("results, rc, timed_out, status", [
    # rank 1 fails in its collective before rank 0 reports the out-of-memory that caused it
    ([{"status": "error: DistBackendError: NCCL error", "rank": 1}, {"status": "oom", "rank": 0}], 1, False, "oom"),
    ([], None, True, "timeout after 42 s"),
    ([], 1, False, "exit 1: RuntimeError: boom"),
    ([{"status": "ok", "tok_s_per_gpu": 5.0}], None, True, "ok"),  # measured, then hung in its teardown
])
def test_a_jobs_row_says_what_stopped_it(results, rc, timed_out, status, monkeypatch):
    # a worker's traceback, then torchrun's summary
    stderr = ("Traceback (most recent call last):\nRuntimeError: boom\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60
              + "\n[1]:\n  exitcode  : 1\n")
    monkeypatch.setattr(scaling, "run_child", lambda cmd, limit, env: dict(
        rc=rc, timed_out=timed_out, results=results, stderr=stderr, wall_s=1.0))
    args = scaling._defaults(scaling.build_parser().parse_args(["--device", "cpu"]))
    row = scaling.run_job(args, "large-350M", "fsdp", 8, 16, 42.0, {})
    assert row["status"] == status
    assert (row["model"], row["parallel"], row["gpus"], row["batch_per_gpu"]) == ("large-350M", "fsdp", 8, 16)
    assert row["command"].startswith("torchrun --standalone --nproc-per-node 8 benchmarks/scaling.py worker "
                                     "--model large-350M --parallel fsdp --batch 16 --seq 2048 ")


def test_jobs_run_the_one_gpu_rows_first_then_the_widest():
    order = scaling.job_order(["m"], ["ddp", "fsdp"], [1, 2, 4, 8])
    assert [(p, g) for _, p, g in order] == [("ddp", 1), ("fsdp", 1), ("ddp", 8), ("fsdp", 8), ("ddp", 4),
                                             ("fsdp", 4), ("ddp", 2), ("fsdp", 2)]


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "1,two"], "--gpus takes positive integers"),
    (["--gpus", "0,2"], "--gpus takes positive integers"),
    (["--parallel", "ddp,zero3"], "--parallel zero3: choose from ddp, fsdp"),
    (["--models", "large-350M-7:1"], "--models large-350M-7:1: large-family models have mLSTM blocks only"),
    (["--models", "huge"], "--models huge: unknown preset 'huge'"),
    (["--steps", "0"], "--steps must be at least 1"),
])
def test_bad_options_are_one_line(argv, message, tmp_path, capsys):
    assert scaling.main(["--quick", "--device", "cpu", "--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not list(tmp_path.iterdir())  # refused before any job


def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert scaling.main(["--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU here; --device cpu" in err[0]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert scaling.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "--gpus 8 asks for more GPUs than the 4 here" in capsys.readouterr().err
