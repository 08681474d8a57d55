"""The paper's training protocol for the synthetic tasks: a learning-rate grid x seeds
per (task, model), the best learning rate reported as mean +- spread over the seeds.

    plan = formal_plan(["parity"], ["xlstm[1:1]"], PROTOCOLS["paper"])   # one Job per grid point
    run_plan(plan, out_dir, device="cuda")     # resumable; one worker process per visible GPU
    write_protocol_report(load_protocol_results(out_dir / "runs"), out_dir)

Protocols:
  "paper"  AdamW betas (0.9, 0.99), weight decay 0.1, 10 % linear warmup, cosine to 1e-5,
           batch 256, learning rates {1e-2, 1e-3, 1e-4} (MQAR: Zoology's four, logspace(-4, -2, 4)),
           seeds 0 and 1; formal tasks in the paper's format (task_set "paper", no teacher
           forcing, sLSTM preset "paper", width 128) scored on 40 sequences per test length
           (41-256: 8,640 sequences); MQAR with the language-model sLSTM blocks (the
           conv-free "paper" preset is the formal-language configuration only), Zoology's
           power-law query spacing, trained at the setting's own pairs. Step budgets (FORMAL_STEPS, MQAR_STEPS): the paper trains
           up to 100k steps (formal) and 100k samples x 64 epochs = 25k steps of 256 (MQAR). We keep
           MQAR's 25k and give the formal tasks 20k (parity and the other regular tasks 10k):
           in our probes every model that learned a formal task at all did so within 8k steps
           (the LSTM on parity: 1.00 after 8,064 steps; xLSTM[0:1]: by step 2,000), and 100k
           steps x 6 models x 12 tasks x 6 grid points does not fit the device time we have.
           MQAR runs train until converged (MQAR_CONVERGED_LOSS) or 25k steps, whichever comes
           first; the formal tasks always train their whole budget (they are scored on longer
           inputs than they train on, so a training loss of 0 says nothing about the score).
           Runs on CUDA train through the compiled step (RunConfig.compile "auto": forward,
           loss and backward compiled, CUDA graphs); on a CPU they stay eager.
  "quick"  the CPU smoke version: tiny widths, 30 steps, 2 learning rates x 2 seeds.

Every grid point writes runs/<job id>.json; a finished one (no "error") is skipped when the
plan runs again, so an interrupted sweep resumes where it stopped. An MQAR grid point with a time
limit (--time-limit, --mqar-time-limit) is a grid point of its own, "T2048-N48-t1050": its score
means a different budget, so it is neither pooled with nor taken for the step-budget one.
"""
from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import re
import shutil
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..errors import XLSTMKitError
from ..io.jsonfile import JSONFileError, parse, read_bytes
from .experiment import (MAX_RUN_FILE_BYTES, MODEL_NAMES, RunConfig, RunPaused, check_model_name, model_slug,
                         progress_path, run_formal, run_mqar)
from .mqar import MQAR_SETTINGS, check_mqar_shape
from .registry import get_task, task_set

FORMAL_STEPS = {"parity": 10_000, "even_pairs": 10_000, "cycle_navigation": 10_000, "majority": 10_000}
"""Formal step budgets of the paper protocol where they differ from FORMAL_STEPS_DEFAULT."""
FORMAL_STEPS_DEFAULT = 20_000
MQAR_STEPS = 25_000
"""Zoology: 100k training samples x 64 epochs at batch 256."""
MQAR_CONVERGED_LOSS = 0.01
"""MQAR runs end early once the training loss stays below this (experiment.CONVERGED_LOGS logged
losses in a row): MQAR's test sequences come from its training distribution, and every batch is
fresh, so the test accuracy is then reached (a mean cross entropy of 0.01 per query puts the
answer's probability at 0.99 on average)."""
PAPER_LRS = (1e-2, 1e-3, 1e-4)
MQAR_PAPER_LRS = tuple(float(f"{x:.3g}") for x in np.logspace(-4, -2, 4))
SEEDS = (0, 1)

PAPER_FIGURE12 = {
    # scaled accuracy of the paper's Figure 12 (reverse string, stack manipulation); our model names
    "reverse_string": {"transformer": 0.06, "lstm": 0.17, "xlstm[0:1]": 0.14, "xlstm[1:0]": 0.22, "xlstm[1:1]": 0.20},
    "stack_manipulation": {"transformer": 0.11, "lstm": 0.25, "xlstm[0:1]": 0.13, "xlstm[1:0]": 0.25, "xlstm[1:1]": 0.17},
}
"""The paper's values where it states them (Llama -> our transformer, LSTM (Block) -> lstm;
its Mamba row has no counterpart here: Mamba 0.13 / 0.21)."""


@dataclass(frozen=True)
class Protocol:
    name: str
    lrs: tuple[float, ...]
    mqar_lrs: tuple[float, ...]
    seeds: tuple[int, ...]
    formal: dict[str, Any]
    """RunConfig fields of the formal runs (steps: FORMAL_STEPS per task unless given)."""
    mqar: dict[str, Any]
    """RunConfig fields of the MQAR runs."""
    mqar_widths: tuple[int, ...] | None = None
    """Widths swept in MQAR (None: the setting's)."""
    mqar_shapes: tuple[tuple[int, int], ...] | None = None
    """(seq_len, pairs) of the MQAR runs (None: the setting's)."""


DEFAULT_HEADS = 4
"""Heads of every model of the protocol's runs (attention, mLSTM and sLSTM heads; the formal
tasks' paper sLSTM preset has its own)."""

_COMMON = dict(batch_size=256, betas=(0.9, 0.99), weight_decay=0.1, min_lr=1e-5)
PROTOCOLS: dict[str, Protocol] = {
    "paper": Protocol(
        "paper", PAPER_LRS, MQAR_PAPER_LRS, SEEDS,
        formal=dict(_COMMON, d_model=128, n_heads=DEFAULT_HEADS, tasks="paper", teacher_forcing=False, slstm="paper",
                    eval_samples=40, precision="bf16", compile="auto"),
        mqar=dict(_COMMON, n_heads=DEFAULT_HEADS, steps=MQAR_STEPS, converged_loss=MQAR_CONVERGED_LOSS, mqar_vocab=8192, mqar_spacing="powerlaw", mqar_train_mix=False,
                  eval_samples=16, precision="bf16", compile="auto"),
    ),
    "quick": Protocol(
        "quick", (1e-2, 1e-3), (1e-2, 1e-3), SEEDS,
        formal=dict(steps=30, batch_size=8, d_model=32, n_heads=DEFAULT_HEADS, tasks="paper", teacher_forcing=False,
                    slstm="paper", train_lengths=(3, 8), test_lengths=(9, 12), eval_samples=2, eval_batch_size=8,
                    min_lr=1e-5, betas=(0.9, 0.99), log_every=5),
        mqar=dict(steps=30, batch_size=8, mqar_vocab=256, mqar_spacing="powerlaw", mqar_train_mix=False,
                  eval_samples=1, eval_batch_size=64, min_lr=1e-5, betas=(0.9, 0.99), log_every=5),
        mqar_widths=(16, 32), mqar_shapes=((64, 4),),
    ),
}


def get_protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise XLSTMKitError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return PROTOCOLS[name]


@dataclass(frozen=True)
class Job:
    """One grid point: kind "formal" (task = formal task) or "mqar" (task = "T256-N16")."""

    kind: str
    task: str
    model: str
    lr: float
    seed: int
    config: dict[str, Any]
    """RunConfig fields (lr, seed, d_model, ... included)."""

    @property
    def width(self) -> int:
        return int(self.config["d_model"])

    @property
    def id(self) -> str:
        return f"{self.kind}__{self.task}__{model_slug(self.model)}__d{self.width}__lr{self.lr:g}__s{self.seed}"


def _warmup(fields: dict[str, Any]) -> dict[str, Any]:
    return {**fields, "warmup_steps": max(1, round(0.1 * fields["steps"]))}  # 10 % warmup


def formal_plan(tasks: Sequence[str], models: Sequence[str], protocol: Protocol, *,
                lrs: Sequence[float] | None = None, seeds: Sequence[int] | None = None,
                overrides: dict[str, Any] | None = None) -> list[Job]:
    """Jobs of the formal grid: tasks x models x lrs x seeds (the protocol's unless given)."""
    jobs = []
    for t in tasks:
        name = get_task(t, protocol.formal.get("tasks", "small")).name
        for m in models:
            for lr in lrs or protocol.lrs:
                for seed in seeds or protocol.seeds:
                    f = {"steps": FORMAL_STEPS.get(name, FORMAL_STEPS_DEFAULT), **protocol.formal,
                         **(overrides or {}), "lr": float(lr), "seed": int(seed)}
                    f["min_lr"] = min(f.get("min_lr", 1e-5), f["lr"])
                    jobs.append(Job("formal", name, check_model_name(m), float(lr), int(seed), _warmup(f)))
    return jobs


def mqar_plan(models: Sequence[str], protocol: Protocol, setting: str, *, widths: Sequence[int] | None = None,
              lrs: Sequence[float] | None = None, seeds: Sequence[int] | None = None,
              overrides: dict[str, Any] | None = None,
              shapes: Sequence[tuple[int, int]] | None = None) -> list[Job]:
    """Jobs of an MQAR setting (mqar.MQAR_SETTINGS): shapes x widths x models x lrs x seeds;
    `shapes`: (seq_len, pairs) pairs to run instead of the setting's (and the protocol's).
    Task labels: "T256-N16", with "-t<S>" for a time limit and "-h<H>" for a head count other than
    DEFAULT_HEADS (`overrides` n_heads)."""
    if setting not in MQAR_SETTINGS:
        raise XLSTMKitError(f"unknown MQAR setting {setting!r}; choose one of {', '.join(MQAR_SETTINGS)}")
    s = MQAR_SETTINGS[setting]
    jobs = []
    for T, N in shapes or protocol.mqar_shapes or s["shapes"]:
        check_mqar_shape(int(T), int(N), int(protocol.mqar.get("mqar_vocab", 8192)))
        for d in widths or protocol.mqar_widths or s["widths"]:
            for m in models:
                for lr in lrs or protocol.mqar_lrs:
                    for seed in seeds or protocol.seeds:
                        f = {**protocol.mqar, **(overrides or {}), "mqar_seq_len": T, "mqar_pairs": N,
                             "d_model": int(d), "lr": float(lr), "seed": int(seed)}
                        f["min_lr"] = min(f.get("min_lr", 1e-5), f["lr"])
                        limit, heads = f.get("time_limit_s"), f.get("n_heads", DEFAULT_HEADS)
                        # a time limit or another head count is another experiment: its own task label,
                        # so that the report neither pools it with nor takes it for the default runs
                        task = (f"T{T}-N{N}" + ("" if limit is None else f"-t{limit:g}")
                                + ("" if heads == DEFAULT_HEADS else f"-h{heads}"))
                        jobs.append(Job("mqar", task, check_model_name(m), float(lr), int(seed), _warmup(f)))
    return jobs


# ------------------------------------------------------------------------------------ running
def read_run_file(path: str | Path) -> dict[str, Any] | None:
    """A grid point's results or progress file; None when its content is not a JSON object (a file
    cut short by a killed run, or otherwise damaged: it is run or left out again). A file that is
    not a regular file or is larger than MAX_RUN_FILE_BYTES is none that a run writes: a one-line
    JSONFileError, rather than a sweep that passes over it or a read that never ends."""
    data = read_bytes(path, MAX_RUN_FILE_BYTES)
    try:
        return parse(data, path, expect=dict)
    except JSONFileError:
        return None


def finished(job: Job, runs_dir: str | Path) -> bool:
    """Whether `job` has a results file without an error (a resumed plan skips it)."""
    path = Path(runs_dir) / f"{job.id}.json"
    if not path.exists():
        return False
    r = read_run_file(path)
    return r is not None and "error" not in r


def run_job(job: Job, runs_dir: str | Path, device: str, progress=None, stop_at: float | None = None,
            score_paused: bool = False) -> dict[str, Any]:
    """Run one grid point on `device` and write runs_dir/<job.id>.json (an error is recorded too).

    Training is checkpointed to the run folder runs_dir/<job.id>.ckpt (xlstm_kit.io.checkpoint's
    format), its losses so far to <job.id>.progress (both deleted when the run is done), and continues from there if the checkpoint exists.
    Past `stop_at` (a time.time() value) the run saves its checkpoint and returns
    {..., "paused": True} without a results file (with `score_paused`, after scoring the model
    as it stands into the progress file); a grid point not started by then returns that at once."""
    runs_dir = Path(runs_dir)
    runs_dir.mkdir(parents=True, exist_ok=True)
    base = {"id": job.id, "kind": job.kind, "task": job.task, "model": job.model, "lr": job.lr, "seed": job.seed,
            "width": job.width}
    ckpt = runs_dir / f"{job.id}.ckpt"
    if stop_at is not None and time.time() >= stop_at:
        return {**base, "paused": True, "steps_done": 0}
    try:
        cfg = RunConfig(**{**job.config, "device": device})
        if device.startswith("cuda:"):
            torch.cuda.set_device(device)
        kw = dict(progress=progress, checkpoint=ckpt, stop_at=stop_at, score_paused=score_paused)
        if job.kind == "mqar":
            r = run_mqar(job.model, cfg, None, label=job.task, **kw)
        else:
            r = run_formal(job.task, job.model, cfg, None, **kw)
        r.update(base)
    except RunPaused as e:
        return {**base, "paused": True, "message": str(e)}
    except Exception as e:  # one failed grid point must not stop the others (its checkpoint stays)
        r = {**base, "error": f"{type(e).__name__}: {e}"}
    path = runs_dir / f"{job.id}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(r, indent=1))
    os.replace(tmp, path)
    if "error" not in r:
        shutil.rmtree(ckpt, ignore_errors=True)
        progress_path(ckpt).unlink(missing_ok=True)
    return r


_DEVICE = None


def _claim_device(queue, threads: int) -> None:
    global _DEVICE

    torch.set_num_threads(threads)  # the workers share the host's cores
    import torch._inductor.config as inductor_config

    # and so do the Inductor compile workers of their compiled steps (each would start one per core)
    inductor_config.compile_threads = threads
    _DEVICE = queue.get()


def _run_on_claimed(job: Job, runs_dir: str, stop_at: float | None, score_paused: bool) -> dict[str, Any]:
    return run_job(job, runs_dir, _DEVICE, stop_at=stop_at, score_paused=score_paused)


def plan_devices(device: str) -> list[str]:
    """One entry per worker: every visible GPU for "cuda", else [device] (one process)."""
    if device == "cuda" and torch.cuda.is_available():
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


def worker_devices(device: str, jobs_per_device: int = 1) -> list[str]:
    """The device of each worker process: plan_devices(device), each `jobs_per_device` times."""
    return [d for d in plan_devices(device) for _ in range(jobs_per_device)]


def run_plan(jobs: Sequence[Job], out_dir: str | Path, *, device: str = "cpu", jobs_per_device: int = 1,
             on_result: Callable[[int, int, dict[str, Any]], None] | None = None,
             stop_after_s: float | None = None, score_paused: bool = False) -> list[dict[str, Any]]:
    """Run the jobs not finished yet (see `finished`) into out_dir/runs, the longest first:
    `jobs_per_device` worker processes per GPU (the small models leave a GPU mostly idle, so
    several share one well; 1 process in all: in this process). Returns the new results.
    `stop_after_s`: after so many seconds the running grid points save their checkpoints and
    the rest wait (results {"paused": True}); the same call later goes on from there.
    `score_paused`: the paused runs are scored as they stand too (see `run_job`)."""
    stop_at = None if stop_after_s is None else time.time() + stop_after_s
    if isinstance(jobs_per_device, bool) or not isinstance(jobs_per_device, int) or jobs_per_device < 1:
        raise XLSTMKitError(f"jobs_per_device must be a positive integer, got {jobs_per_device!r}")
    runs_dir = Path(out_dir) / "runs"
    todo = sorted((j for j in jobs if not finished(j, runs_dir)), key=lambda j: -j.config.get("steps", 0) * j.width)
    devices = worker_devices(device, jobs_per_device)
    results: list[dict[str, Any]] = []

    def done(r: dict[str, Any]) -> None:
        results.append(r)
        if on_result is not None:
            on_result(len(results), len(todo), r)

    if len(devices) == 1 or len(todo) <= 1:
        for j in todo:
            done(run_job(j, runs_dir, devices[0], stop_at=stop_at, score_paused=score_paused))
        return results

    ctx = mp.get_context("spawn")  # CUDA cannot be used in forked children
    with ctx.Manager() as manager:
        queue = manager.Queue()  # each worker takes one device slot at start and keeps it
        for d in devices:
            queue.put(d)
        with ProcessPoolExecutor(len(devices), mp_context=ctx, initializer=_claim_device,
                                 initargs=(queue, max(1, (os.cpu_count() or 1) // len(devices)))) as pool:
            for f in as_completed([pool.submit(_run_on_claimed, j, str(runs_dir), stop_at, score_paused) for j in todo]):
                done(f.result())
    return results


# ------------------------------------------------------------------------------------ report
def load_protocol_results(runs_dir: str | Path) -> list[dict[str, Any]]:
    """Every grid-point file under runs_dir (those with an "id")."""
    out = []
    for p in sorted(Path(runs_dir).glob("*.json")):
        r = read_run_file(p)
        if r is not None and "id" in r:
            out.append(r)
    return out


def aggregate(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (kind, task, model, width): the mean and spread (population std) over seeds of every
    learning rate, and the best learning rate by mean (score: scaled accuracy; MQAR: accuracy).
    Errors count as missing. Returns one row per cell with "best" = {lr, mean, std, n, scores}."""
    cells: dict[tuple, dict[float, list[float]]] = {}
    errors: dict[tuple, int] = {}
    for r in results:
        key = (r["kind"], r["task"], r["model"], int(r["width"]))
        if "error" in r:
            errors[key] = errors.get(key, 0) + 1
            cells.setdefault(key, {})
            continue
        cells.setdefault(key, {}).setdefault(float(r["lr"]), []).append(float(r["scaled_accuracy"]))
    rows = []
    for key, by_lr in cells.items():
        per_lr = {lr: {"mean": float(np.mean(v)), "std": float(np.std(v)), "n": len(v), "scores": v}
                  for lr, v in sorted(by_lr.items())}
        best = max(per_lr.items(), key=lambda kv: kv[1]["mean"]) if per_lr else None
        rows.append({"kind": key[0], "task": key[1], "model": key[2], "width": key[3], "per_lr": per_lr,
                     "best": None if best is None else {"lr": best[0], **best[1]}, "errors": errors.get(key, 0)})
    return rows


def _fmt(best: dict[str, Any] | None) -> str:
    if best is None:
        return "error"
    return f"{best['mean']:.2f} ± {best['std']:.2f} (lr {best['lr']:g}, n={best['n']})"


def _ended_by(r: dict[str, Any]) -> str:
    done, planned, nominal = r.get("steps_done"), r.get("planned_steps"), r.get("config", {}).get("steps")
    if r.get("converged_at") is not None:
        return "converged"
    if None in (done, planned, nominal):
        return "?"
    if planned < nominal:  # the schedule was fitted to the time limit
        return "time limit" + (f", {planned - done:,} steps short of the fitted schedule" if done < planned else "")
    return "step budget"


def plateau_end(losses: Sequence[Sequence[float]], pairs: int) -> int | None:
    """The first logged step whose MQAR training loss is below ln(pairs), or None. A model that
    has not learned the lookup sits near ln(vocabulary half) (8.3 at 8192), one that only knows
    the value is among the pairs' values at ln(pairs): below it, the lookup has started to work,
    and the runs that learn fall through it within a few hundred steps (their plateau's end)."""
    bound = math.log(pairs)
    return next((int(step) for step, loss in losses if loss < bound), None)


def _plateau(losses, pairs) -> str:
    if pairs is None:
        return "?"
    end = plateau_end(losses or [], pairs)
    return "—" if end is None else f"{end:,}"


def _mqar_runs(results: Sequence[dict[str, Any]], panels: list[str], models: list[str]) -> list[str]:
    # MQAR runs end on convergence, at the step budget or at a time limit (with a schedule fitted
    # to it), so the same accuracy can mean different budgets: every run is listed with its own
    runs = [r for r in results if r["kind"] == "mqar" and "error" not in r]
    if not runs:
        return []
    order = {m: i for i, m in enumerate(models)}
    runs.sort(key=lambda r: (panels.index(r["task"]), order.get(r["model"], len(order)), r["width"], r["lr"],
                             r["seed"], r.get("repeat", 1)))
    lines = ["", "MQAR, every run: accuracy, optimizer steps done / in the schedule, how the run ended, the "
             "plateau's end (first logged step with the training loss below ln pairs; — : not reached)", "",
             "| setting | model | width | lr | seed | accuracy | steps | ended by | plateau end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        steps = (f"{r['steps_done']:,} / {r['planned_steps']:,}" if "steps_done" in r and "planned_steps" in r
                 else "?")
        lines.append(f"| {r['task']} | {r['model']} | {r['width']} | {r['lr']:g} | {r['seed']} | "
                     f"{r['scaled_accuracy']:.3f} | {steps} | {_ended_by(r)} | "
                     f"{_plateau(r.get('losses'), r.get('config', {}).get('mqar_pairs'))} |")
    return lines


def _unfinished(runs_dir: Path) -> list[str]:
    # a paused run whose checkpoint was lost (a lent machine given back) leaves its curve only
    rows = []
    for p in sorted(runs_dir.glob("*.progress")):
        if p.with_suffix(".json").exists():
            continue
        g = read_run_file(p)
        if g is None:
            continue
        try:
            last = f"{g['losses'][-1][1]:.4f}" if g.get("losses") else "—"
            score = f"{g['at_pause']['scaled_accuracy']:.3f}" if "at_pause" in g else "—"
            pairs = re.match(r"mqar__T\d+-N(\d+)", p.stem)
            end = _plateau(g.get("losses"), int(pairs[1])) if pairs else ""
            rows.append(f"| {p.stem} | {g['steps_done']:,} / {g['planned_steps']:,} | {last} | {score} | {end} | "
                        f"{g['seconds']:.0f} |")
        except (KeyError, IndexError, TypeError, ValueError):  # fields missing or mistyped: damaged like the above
            continue
    if not rows:
        return []
    return ["", "Unfinished runs (paused, not resumed): steps, last training loss, the score at the pause "
            "(--score-paused), MQAR's plateau end as above — not a result of the protocol's budget", "",
            "| run | steps | loss | score at pause | plateau end | seconds |", "|---|---|---|---|---|---|", *rows]


def write_protocol_report(results: Sequence[dict[str, Any]], out_dir: str | Path, *,
                          command: str | None = None) -> dict[str, Path | None]:
    """out_dir/summary.json (aggregate), report.md (Figure 4 table models x tasks, the paper's
    Figure 12 values next to ours, MQAR accuracy vs width per setting), figure4.png and
    mqar.png (without matplotlib: None)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = aggregate(results)
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    cell = {(r["kind"], r["task"], r["model"], r["width"]): r for r in rows}
    formal = [r for r in rows if r["kind"] == "formal"]
    models = [m for m in MODEL_NAMES if any(r["model"] == m for r in rows)]
    tasks = [t for t in task_set("paper") if any(r["task"] == t for r in formal)]
    lines = (["Produced by:", "", "```", command, "```", ""] if command else [])
    lines += ["Best learning rate per cell: mean ± std over its runs (the seeds, and repeats of a seed where the "
              "grid was run twice) of the scaled accuracy on the test lengths (formal: 0 = chance, 1 = perfect; "
              "MQAR: accuracy).", ""]
    figure4 = {}
    if formal:
        lines += ["## Formal languages (Figure 4)", "", "| model | width | " + " | ".join(tasks) + " |",
                  "|---" * (len(tasks) + 2) + "|"]
        for m in models:
            for w in sorted({r["width"] for r in formal if r["model"] == m}):
                vals = [cell.get(("formal", t, m, w)) for t in tasks]
                figure4[(m, w)] = [v["best"]["mean"] if v and v["best"] else math.nan for v in vals]
                lines.append(f"| {m} | {w} | " + " | ".join("—" if v is None else _fmt(v["best"]) for v in vals) + " |")
        shown = [t for t in PAPER_FIGURE12 if t in tasks]
        if shown:
            lines += ["", "Paper (Figure 12) next to ours (best lr, mean over seeds)", "",
                      "| model | " + " | ".join(f"{t} paper | {t} ours" for t in shown) + " |",
                      "|---" * (2 * len(shown) + 1) + "|"]
            for m in models:
                parts = []
                for t in shown:
                    ours = [r for r in formal if r["task"] == t and r["model"] == m and r["best"]]
                    paper = PAPER_FIGURE12[t].get(m)
                    parts += ["—" if paper is None else f"{paper:.2f}",
                              ", ".join(f"{r['best']['mean']:.2f}" for r in ours) or "—"]
                lines.append(f"| {m} | " + " | ".join(parts) + " |")
    if formal:
        # the best-lr mean hides whether runs fail together or one at a time (on these tasks a run
        # either extrapolates or stays near chance), so every run's score is listed too
        lines += ["", "Every learning rate: each run's score, and how many reached 0.9", "",
                  "| task | model | width | lr | runs | ≥ 0.9 |", "|---|---|---|---|---|---|"]
        for t in tasks:
            for m in models:
                for r in (r for r in formal if r["task"] == t and r["model"] == m):
                    for lr, v in r["per_lr"].items():
                        sc = sorted(v["scores"], reverse=True)
                        lines.append(f"| {t} | {m} | {r['width']} | {lr:g} | {', '.join(f'{x:.2f}' for x in sc)} | "
                                     f"{sum(x >= 0.9 for x in sc)}/{len(sc)} |")
    mqar = [r for r in rows if r["kind"] == "mqar"]
    panels = sorted({r["task"] for r in mqar}, key=lambda s: tuple(float(x[1:]) for x in s.split("-")))
    for p in panels:
        widths = sorted({r["width"] for r in mqar if r["task"] == p})
        lines += ["", f"## MQAR {p} (accuracy vs width)", "", "| model | " + " | ".join(f"d={w}" for w in widths) + " |",
                  "|---" * (len(widths) + 1) + "|"]
        for m in models:
            if any(r["model"] == m and r["task"] == p for r in mqar):
                lines.append(f"| {m} | " + " | ".join(
                    "—" if cell.get(("mqar", p, m, w)) is None else _fmt(cell[("mqar", p, m, w)]["best"])
                    for w in widths) + " |")
    lines += _mqar_runs(results, panels, models)
    lines += _unfinished(out_dir / "runs")
    report = out_dir / "report.md"
    report.write_text("\n".join(lines) + "\n")
    paths: dict[str, Path | None] = {"summary": out_dir / "summary.json", "report": report, "figure4": None, "mqar": None}
    try:
        import matplotlib
    except ImportError:
        return paths
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if figure4:
        labels = [f"{m} (d={w})" for m, w in figure4]
        grid = np.array(list(figure4.values()))
        fig, ax = plt.subplots(figsize=(1.0 * len(tasks) + 3, 0.5 * len(labels) + 2))
        ax.imshow(np.clip(grid, 0, 1), cmap="Blues", vmin=0, vmax=1, aspect="auto")
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                v = grid[i, j]
                ax.text(j, i, "—" if math.isnan(v) else f"{v:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if not math.isnan(v) and v > 0.6 else "black")
        ax.set_xticks(range(len(tasks)), [t.replace("_", "\n") for t in tasks], fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_title("Scaled accuracy at the best lr,\nmean over runs (0 = chance, 1 = perfect)", fontsize=9)
        fig.tight_layout()
        fig.savefig(out_dir / "figure4.png", dpi=120)
        plt.close(fig)
        paths["figure4"] = out_dir / "figure4.png"
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
        for ax, p in zip(axes[0], panels):
            for m in models:
                pts = sorted((r["width"], r["best"]) for r in mqar if r["task"] == p and r["model"] == m and r["best"])
                if pts:
                    ax.errorbar([w for w, _ in pts], [b["mean"] for _, b in pts], yerr=[b["std"] for _, b in pts],
                                marker="o", capsize=2, label=m)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"MQAR {p}", fontsize=9)
            ax.set_xlabel("model width")
        axes[0][0].set_ylabel("accuracy")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out_dir / "mqar.png", dpi=120)
        plt.close(fig)
        paths["mqar"] = out_dir / "mqar.png"
    return paths
