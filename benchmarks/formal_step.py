"""Training steps/s of the synthetic experiments' models, eager against compiled, in one GPU call.

    PYTHONPATH=. python benchmarks/formal_step.py --out $OUT

Every row trains as a grid point of the paper protocol trains (`protocol.PROTOCOLS["paper"]`
formal fields: width 128, 2 blocks, 4 heads, batch 256, bf16 autocast, the paper's task set
and format, sLSTM preset "paper") on parity, through `experiment.train_on_task`: the batch
sampled on the host each step, `train_step`, the loss read back every 25 steps. Steps/s is
25 / the time between two loss reads, the median over such windows after a warm-up of 50
steps. "compiled" is `RunConfig(compile=True)` (`compiling.CompiledLoss`: Inductor with CUDA
graphs, falling back to Inductor alone); "compiled-pageable" (--pageable-models) the same with
the batches copied from pageable host memory, as before pinned batches.

Phases, each child process with its own time limit (a crash or hang costs its rows only):
1. warm (not --quick): every model's compiled step compiled once, all models at once, from empty
   Inductor and Triton caches (a fresh TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR for the
   call): "cold compile s" is the time to the first step under the contention of the others.
2. single: per model one child, eager then compiled (then compiled-pageable); "compile s" is the
   first compiled step's extra time from the warm caches, what a further grid point of the same
   model pays. Also the host's time to sample one batch ("sample ms").
3. parallel: P (--parallel, default 4 and 12) runs of one model (--parallel-model) on the GPU at
   once, eager and compiled, measured over a common window after all have warmed up:
   steps/s per run (median over runs) and their total, the protocol's --jobs P situation.
The call stops starting phase-3 experiments that would end past --deadline-s.

Writes DIR/formal_step.jsonl (one row per measurement) and DIR/formal_step.md (the tables),
DIR = --out, else $OUT, else the current directory. --quick: a tiny CPU smoke run (width 32,
batch 8, aot_eager), used by tests/bench/test_formal_step.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from xlstm_kit.bench.scripts import child_env, run_child

MODELS = ("xlstm[0:1]", "xlstm[1:1]", "xlstm[1:0]", "transformer", "lstm", "lstm-plain")
LOG_EVERY = 25  # the RunConfig default: the loss is read back (a device sync) every 25 steps
WARM_STEPS = 50


class _Enough(Exception):
    """Raised from the progress callback: the measurement is complete."""


# ------------------------------------------------------------------------------ child
def _config(quick: bool, mode: str):
    import torch

    from xlstm_kit.experiments import protocol as pr
    from xlstm_kit.experiments.config import RunConfig

    fields = {**pr.PROTOCOLS["paper"].formal, "steps": 10**7, "lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 1000,
              "log_every": LOG_EVERY if not quick else 5, "compile": mode != "eager",
              "device": "cuda" if torch.cuda.is_available() and not quick else "cpu"}
    if quick:
        fields.update(d_model=32, batch_size=8, train_lengths=(3, 8), precision="fp32")
    return RunConfig(**fields)


def measure(name: str, mode: str, quick: bool, start_at: float | None, window_s: float) -> dict:
    """One model trained as a grid point trains, until `window_s` seconds of steps were timed
    (at least 3 windows) after the warm-up (and after `start_at`, a time.time(), if given)."""
    import numpy as np
    import torch

    from xlstm_kit.training import compiling
    from xlstm_kit.experiments import task_loop as ex
    from xlstm_kit.experiments.models import build_model
    from xlstm_kit.experiments.formal import TaskBatch, sample_train_batch
    from xlstm_kit.experiments.registry import get_task

    cfg = _config(quick, mode)
    dev = torch.device(cfg.device)
    if quick:  # Inductor's C++ builds take minutes on a small CPU
        compiling.TRAINING_COMPILE_TRIES["cpu"] = ({"backend": "aot_eager"},)
    pin = TaskBatch.pin_memory
    if mode == "compiled-pageable":
        TaskBatch.pin_memory = lambda self: self
    made = []

    class Recorded(compiling.CompiledLoss):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    ex.CompiledLoss = Recorded
    task = get_task("parity", cfg.tasks)
    torch.manual_seed(0)
    model = build_model(name, task.vocab_size, d_model=cfg.d_model, n_heads=cfg.n_heads, n_blocks=cfg.n_blocks,
                           backend=cfg.backend, slstm=cfg.slstm).to(dev)

    def sample(rng):
        return sample_train_batch(task, rng, cfg.batch_size, cfg.train_lengths, cfg.teacher_forcing)

    rng = np.random.default_rng(1)
    t_sample = []
    for _ in range(10):
        t = time.perf_counter()
        sample(rng)
        t_sample.append(time.perf_counter() - t)
    warm = WARM_STEPS if not quick else 10
    marks: list[tuple[int, float]] = []
    state = {"from": None, "wall": None}
    losses = []

    def progress(step, planned, loss):
        now = time.perf_counter()
        losses.append(loss)
        marks.append((step, now))
        if mode == "warm":
            raise _Enough
        if state["from"] is None:
            if step >= warm and (start_at is None or time.time() >= start_at):
                state["from"], state["wall"] = len(marks) - 1, time.time()
            return
        first = marks[state["from"]]
        if now - first[1] >= window_s and len(marks) - 1 - state["from"] >= 3:
            raise _Enough

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        ex.train_on_task(model, sample, cfg, progress=progress)
    except _Enough:
        pass
    finally:
        TaskBatch.pin_memory = pin
        ex.CompiledLoss = compiling.CompiledLoss
    row = dict(model=name, mode=mode, device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
               torch=torch.__version__, batch=cfg.batch_size, d_model=cfg.d_model, precision=cfg.precision,
               seq_len=int(sample(rng).inputs.shape[1]), sample_ms=1e3 * statistics.median(t_sample),
               first_step_s=marks[0][1] - t0, finite=all(np.isfinite(losses)))
    if made:
        row["compiled"] = made[-1].summary()
    if mode != "warm":
        i = state["from"]
        rates = [(b[0] - a[0]) / (b[1] - a[1]) for a, b in zip(marks[i:], marks[i + 1:])]
        row.update(steps_per_s=statistics.median(rates), rates=[round(r, 2) for r in rates],
                   step_ms=1e3 / statistics.median(rates), steps_timed=marks[-1][0] - marks[i][0])
        # the first step's extra time over a typical one: compilation (and graph recording)
        row["compile_s"] = max(0.0, row["first_step_s"] - row["step_ms"] / 1e3) if mode != "eager" else None
        if start_at is not None:  # this run began its window after the common start
            row["late_s"] = max(0.0, state["wall"] - start_at)
    else:
        row["compile_s"] = row["first_step_s"]
    if dev.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def child(name: str, modes: list[str], quick: bool, start_at: float | None, window_s: float, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    for mode in modes:
        try:
            row = measure(name, mode, quick, start_at, window_s)
        except Exception as e:  # noqa: BLE001 - reported in the row; the next mode still runs
            row = dict(model=name, mode=mode, status=f"{type(e).__name__}: {str(e)[:300]}")
        print("RESULT " + json.dumps(row), flush=True)


# ------------------------------------------------------------------------------ parent
def _fmt(v, spec=",.1f", none="—"):
    return none if v is None else format(v, spec)


def _cell(text: str, most: int = 400) -> str:
    return " ".join(str(text).replace("|", "/").split())[:most]  # one table cell: no pipes, no line breaks


def render(rows: list[dict], header: str) -> str:
    single = [r for r in rows if r.get("phase") == "single"]
    warm = {r["model"]: r for r in rows if r.get("phase") == "warm" and "status" not in r}
    lines = [header, "", "## One run at a time", "",
             "| model | eager steps/s | compiled steps/s | speed-up | compiled, pageable | cold compile s "
             "| compile s (warm caches) | 10k steps eager / compiled (min) | sample ms | compiled with | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    models = list(dict.fromkeys(r["model"] for r in single))
    for m in models:
        by = {r["mode"]: r for r in single if r["model"] == m}
        e, c, p = by.get("eager", {}), by.get("compiled", {}), by.get("compiled-pageable", {})
        es, cs = e.get("steps_per_s"), c.get("steps_per_s")
        how = c.get("compiled", {})
        note = (how.get("options", "") + (f"; fell back from {how['fallbacks']}" if how.get("fallbacks") else "")
                + (f"; CUDA graph skips: {how['cudagraph_skips']}" if how.get("cudagraph_skips") else ""))
        errs = "; ".join(f"{k}: {r['status']}" for k, r in by.items() if "status" in r)
        lines.append("| " + " | ".join([
            m, _fmt(es), _fmt(cs), _fmt(cs / es if es and cs else None, ".2f") + ("×" if es and cs else ""),
            _fmt(p.get("steps_per_s")), _fmt(warm.get(m, {}).get("compile_s")), _fmt(c.get("compile_s")),
            f"{_fmt(1e4 / es / 60 if es else None)} / {_fmt(1e4 / cs / 60 if cs else None)}",
            _fmt(e.get("sample_ms") or c.get("sample_ms"), ".2f"), _cell(note + (" ERROR " + errs if errs else "")),
            _fmt(max([r["peak_gb"] for r in by.values() if "peak_gb" in r], default=None), ".2f")]) + " |")
    par = [r for r in rows if r.get("phase") == "parallel"]
    if par:
        lines += ["", "## Runs in parallel on the one GPU (protocol --jobs P)", "",
                  "| model | mode | P | runs measured | steps/s per run (median, min) | total steps/s "
                  "| vs one run alone | late starts (s, max) |", "|---|---|---|---|---|---|---|---|"]
        for key in dict.fromkeys((r["model"], r["mode"], r["parallel"]) for r in par):
            rs = [r for r in par if (r["model"], r["mode"], r["parallel"]) == key]
            ok = [r for r in rs if "steps_per_s" in r]
            alone = next((r.get("steps_per_s") for r in single if (r["model"], r["mode"]) == key[:2]), None)
            if not ok:
                lines.append(f"| {key[0]} | {key[1]} | {key[2]} | 0 | {_cell(rs[0].get('status', ''), 200)} | | | |")
                continue
            per = [r["steps_per_s"] for r in ok]
            total = sum(per)
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {len(ok)} of {key[2]} | {statistics.median(per):,.1f}, "
                         f"{min(per):,.1f} | {total:,.1f} | {_fmt(total / alone, '.2f') + '×' if alone else '—'} "
                         f"| {_fmt(max(r.get('late_s') or 0 for r in ok), '.1f')} |")
    notes = [r for r in rows if r.get("phase") == "note"]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {r['text']}" for r in notes]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--only", help="comma-separated models (default: " + ",".join(MODELS) + ")")
    ap.add_argument("--parallel", default="4,12", help="runs at once in phase 3 (comma-separated; '' skips it)")
    ap.add_argument("--parallel-model", default=None,
                    help="the model of phase 3 (default: xlstm[1:1], or the first of --only without it)")
    ap.add_argument("--pageable-models", default="xlstm[1:1]",
                    help="models also timed compiled with batches from pageable memory ('' for none)")
    ap.add_argument("--window-s", type=float, default=None, help="seconds of timed steps per measurement (default 4)")
    ap.add_argument("--limit-s", type=float, default=240, help="time limit of one child")
    ap.add_argument("--deadline-s", type=float, default=540, help="start no phase-3 experiment that would end later")
    ap.add_argument("--quick", action="store_true", help="tiny CPU smoke run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--modes", default="eager,compiled", help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args()
    window = a.window_s if a.window_s is not None else (0.5 if a.quick else 4.0)
    if a.child:
        child(a.child, a.modes.split(","), a.quick, a.start_at, window, a.threads)
        return 0
    t_start = time.time()
    env = child_env(None)
    if not a.quick:  # cold compile times: no Inductor or Triton cache from an earlier call
        cache = tempfile.mkdtemp(prefix="formal-step-cache-")
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), TRITON_CACHE_DIR=os.path.join(cache, "triton"))
    models = [m.strip() for m in a.only.split(",")] if a.only else list(MODELS)
    pageable = {m.strip() for m in a.pageable_models.split(",") if m.strip()}
    cpus = os.cpu_count() or 1

    def cmd(model, modes, start_at=None, threads=1):
        return ([sys.executable, os.path.abspath(__file__), "--child", model, "--modes", ",".join(modes),
                 "--window-s", str(window), "--threads", str(threads)] + (["--quick"] if a.quick else [])
                + ([] if start_at is None else ["--start-at", repr(start_at)]))

    def rows_of(res, phase, model, modes, **extra):
        out = [dict(r, phase=phase, **extra) for r in res["results"]]
        done = {r["mode"] for r in out}
        for mode in modes:
            if mode not in done:
                why = "timed out" if res["timed_out"] else f"rc {res['rc']}"
                out.append(dict(model=model, mode=mode, phase=phase, status=f"no result ({why}): {res['stderr'][-300:]}",
                                **extra))
        return out

    rows: list[dict] = []
    def left() -> float:
        return a.deadline_s - (time.time() - t_start)

    if not a.quick:  # Inductor's compile workers shared out among the concurrent compilations
        warm_env = dict(env, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, cpus // len(models))))
        with ThreadPoolExecutor(len(models)) as pool:
            warm = list(pool.map(lambda m: run_child(cmd(m, ["warm"], threads=max(1, cpus // len(models))),
                                                     min(a.limit_s, left()), warm_env), models))
        for m, res in zip(models, warm):
            rows += rows_of(res, "warm", m, ["warm"])
        print(f"[{time.time() - t_start:.0f} s] warm: {len(models)} models compiled", file=sys.stderr, flush=True)
    for m in models:
        modes = ["eager", "compiled"] + (["compiled-pageable"] if m in pageable else [])
        if left() < 30:
            rows.append(dict(phase="note", text=f"{m} not timed: past --deadline-s {a.deadline_s:g} s"))
            continue
        rows += rows_of(run_child(cmd(m, modes, threads=max(1, cpus // 2)), min(a.limit_s, left()), env),
                        "single", m, modes)
        print(f"[{time.time() - t_start:.0f} s] single: {m}", file=sys.stderr, flush=True)
    model = a.parallel_model or ("xlstm[1:1]" if "xlstm[1:1]" in models else models[0])
    alone = {r["mode"]: r for r in rows if r.get("phase") == "single" and r["model"] == model}
    for p in [int(x) for x in a.parallel.split(",") if x.strip()]:
        for mode in ("eager", "compiled"):
            # every run's import, compilation (warm caches) and warm-up before the common window
            ready = 5.0 + (2.0 * (alone.get("compiled", {}).get("compile_s") or 20.0) if mode == "compiled" else 0.0) \
                + (WARM_STEPS / (alone.get(mode, {}).get("steps_per_s") or 10.0)) * min(p, 4)
            lead = 0.0 if a.quick else 8.0 + ready  # (a smoke run need not overlap its runs)
            if lead + window + 30 > left():
                rows.append(dict(phase="note", text=f"parallel {mode} x{p} of {model} skipped: past --deadline-s "
                                                      f"{a.deadline_s:g} s"))
                continue
            start_at = time.time() + lead
            par_env = dict(env, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, cpus // p)))  # as the protocol's workers
            with ThreadPoolExecutor(p) as pool:
                res = list(pool.map(lambda i: run_child(cmd(model, [mode], start_at, max(1, cpus // p)),
                                                        lead + window + a.limit_s / 2, par_env), range(p)))
            for i, r in enumerate(res):
                rows += rows_of(r, "parallel", model, [mode], parallel=p, rank=i)
            print(f"[{time.time() - t_start:.0f} s] parallel: {mode} x{p}", file=sys.stderr, flush=True)
    rows.append(dict(phase="note", text=f"whole call {time.time() - t_start:.0f} s"))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "formal_step.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    dev = next((r["device"] for r in rows if r.get("device")), "?")
    header = (f"# formal_step — {time.strftime('%Y-%m-%d')}, {dev}\n\nParity, the paper protocol's formal runs "
              f"(batch {next((r['batch'] for r in rows if 'batch' in r), '?')}, width "
              f"{next((r['d_model'] for r in rows if 'd_model' in r), '?')}, "
              f"{next((r['precision'] for r in rows if 'precision' in r), '?')}), steps/s of "
              f"`train_on_task` (median over {5 if a.quick else LOG_EVERY}-step windows).")
    table = render(rows, header)
    with open(os.path.join(a.out, "formal_step.md"), "w") as f:
        f.write(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
