"""The paper's synthetic experiments as typed functions (models by name in `models`, settings in
`config`, training and evaluation in `task_loop`; here the runs): build a model by name, train it on a
formal-language task or on MQAR within a step and time budget, evaluate, write results.

    build_model("xlstm[0:1]", vocab_size)          # 2 blocks, same width for every model
    run_formal("parity", "xlstm[0:1]", RunConfig(), out_dir)  -> result dict (+ JSON file)
    run_mqar("xlstm[1:1]", RunConfig(), out_dir)               -> result dict (+ JSON file)
    run_sweep(tasks, models, RunConfig(), out_dir, jobs=4)     -> results + table.md + heatmap.png

Model names: "xlstm[0:1]" (sLSTM blocks only), "xlstm[1:0]" (mLSTM only), "xlstm[1:1]" (one of
each: mLSTM first), "transformer" (Llama-style), "lstm" (nn.LSTM in the sLSTM block frame: the
paper's "LSTM (Block)"), "lstm-plain" (a plain n_blocks-layer nn.LSTM language model), "dplr"
(KDA-style DPLR blocks); the ablation "transformer-conv" (ABLATION_MODELS) runs when named only.

Training: the library's training loop (`xlstm_kit.training.train`: AdamW with weight-decay
groups, warmup + cosine schedule, clipping, autocast, checkpoints and resume) with the task as its
workload (`task_loop.TaskWorkload`), cross entropy on the scored tokens only.
With a time limit, the run first times a few steps (`xlstm_kit.training.TimeBudget`) and then
shortens its schedule to what fits, so the cosine decay still ends. With `RunConfig.compile`
the forward and the loss (hence the backward) run compiled, with CUDA graphs on CUDA
(`xlstm_kit.training.compiling.CompiledLoss`); evaluation stays eager (its lengths vary).

Results go to `runs/experiments/` by default (the command line's `--out`); the command-line
parsing lives in `xlstm_kit.cli.experiment`. The paper's protocol (learning-rate grid x seeds, its
task format and optimiser settings, `--protocol paper`) is `xlstm_kit.experiments.protocol`; it runs
these functions once per grid point.
"""
from __future__ import annotations

import dataclasses
import json
import math
import multiprocessing as mp
import os
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import XLSTMKitError
from ..io.jsonfile import read_bytes, read_json
from .config import RunConfig
from .formal import TaskBatch, sample_train_batch, scaled_accuracy
from .models import MODEL_NAMES, build_model, check_model_name, model_slug
from .mqar import mqar_batch
from .registry import get_task, task_set
from .task_loop import (ProgressFn, RunPaused, TrainLog, _write_progress, evaluate_formal, evaluate_mqar,
                        progress_path, train_on_task)


RESULTS_TABLE = "table.md"
RESULTS_PLOT = "heatmap.png"
RESULTS_ALL = "results.json"
COMMAND_FILE = "command.txt"
MAX_COMMAND_BYTES = 1 << 20
"""The most the sweep's command.txt may hold: one command line, a few hundred bytes (Linux
caps one argument at 128 KiB and all of them with the environment at 2 MiB by default)."""
MAX_RUN_FILE_BYTES = 16 << 20
"""The most a run's results or progress file may hold: its loss curve, one row per logged step,
is most of it: tens of kB at the paper protocol's 25,000 steps logged every 25, a few MB with
every step of 100,000 logged."""


def _run_header(kind: str, task: str, model_name: str, model: nn.Module, cfg: RunConfig) -> dict[str, Any]:
    return {
        "kind": kind, "task": task, "model": model_name, "config": cfg.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": torch.cuda.get_device_name(0) if torch.device(cfg.device).type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def _finish(result: dict[str, Any], log: TrainLog, t_start: float, out_dir: str | Path | None) -> dict[str, Any]:
    result.update(steps_done=log.steps_done, planned_steps=log.planned_steps, train_seconds=round(log.seconds, 2),
                  total_seconds=round(time.perf_counter() - t_start, 2), losses=log.losses,
                  loss_first=log.losses[0][1], loss_last=log.losses[-1][1])
    if log.converged_at is not None:
        result["converged_at"] = log.converged_at
    if log.compiled is not None:
        result["compiled"] = log.compiled
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{result['kind']}__{result['task']}__{model_slug(result['model'])}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
        result["path"] = str(path)
    return result


def _budget(cfg: RunConfig, share: float) -> float | None:
    # the rest of the time limit is kept for evaluation
    return None if cfg.time_limit_s is None else share * cfg.time_limit_s


def _train_scoring_a_pause(model: nn.Module, sample, cfg: RunConfig, share: float, progress, checkpoint,
                           stop_at, score: Callable[[], dict[str, Any]] | None) -> TrainLog:
    # With `score`, a paused run is also scored as it stands: where its checkpoint cannot outlive
    # the machine (the last call of a lent slot), the accuracy it reached is kept in its
    # progress file ("at_pause") and its RunPaused message.
    try:
        return train_on_task(model, sample, cfg, _budget(cfg, share), progress, checkpoint=checkpoint, stop_at=stop_at)
    except RunPaused as e:
        if score is None:
            raise
        fields = score()
        path = progress_path(checkpoint)
        # not a file of someone else's: the save at the pause has just written it, in this process
        curve = json.loads(path.read_text())
        curve["at_pause"] = {k: fields[k] for k in ("accuracy", "scaled_accuracy")}
        _write_progress(path, curve)
        raise RunPaused(f"{e}; scored {fields['scaled_accuracy']:.3f} as it stands") from None


def run_formal(task_name: str, model_name: str, cfg: RunConfig, out_dir: str | Path | None = None, *,
               progress: ProgressFn | None = None, checkpoint: str | Path | None = None,
               stop_at: float | None = None, score_paused: bool = False) -> dict[str, Any]:
    """Train `model_name` on formal task `task_name`, evaluate on the test and training lengths,
    and write `out_dir`/formal__TASK__MODEL.json (when out_dir is given). Returns the results.
    `checkpoint`, `stop_at`: as for `train_on_task` (RunPaused when stopped); `score_paused`:
    a paused run is evaluated too, into its progress file (see `progress_path`)."""
    t_start = time.perf_counter()
    task = get_task(task_name, cfg.tasks)
    model_name = check_model_name(model_name)
    torch.manual_seed(cfg.seed)
    model = build_model(model_name, task.vocab_size, d_model=cfg.d_model, n_heads=cfg.n_heads,
                        n_blocks=cfg.n_blocks, backend=cfg.backend, slstm=cfg.slstm).to(cfg.device)
    result = _run_header("formal", task.name, model_name, model, cfg)

    def score() -> dict[str, Any]:
        kw = dict(batch_size=cfg.eval_batch_size, device=cfg.device, precision=cfg.precision,
                  teacher_forcing=cfg.teacher_forcing)
        test = evaluate_formal(model, task, cfg.test_lengths, cfg.eval_samples, seed=cfg.seed + 1, **kw)
        lo, hi = cfg.train_lengths
        in_dist = evaluate_formal(model, task, range(lo, hi + 1), max(1, cfg.eval_samples // 2), seed=cfg.seed + 2, **kw)
        return dict(chance=task.chance, accuracy=test["accuracy"], scaled_accuracy=test["scaled_accuracy"],
                    per_length=test["per_length"], train_lengths_scaled_accuracy=in_dist["scaled_accuracy"])

    log = _train_scoring_a_pause(
        model, lambda rng: sample_train_batch(task, rng, cfg.batch_size, cfg.train_lengths, cfg.teacher_forcing),
        cfg, 0.85, progress, checkpoint, stop_at, score if score_paused else None)
    result.update(score())
    return _finish(result, log, t_start, out_dir)


def mqar_label(cfg: RunConfig, with_lr: bool = False) -> str:
    """The task name of an MQAR run: "T256-N64", or "T256-N64-lr0.001" where a sweep tries several lrs."""
    return f"T{cfg.mqar_seq_len}-N{cfg.mqar_pairs}" + (f"-lr{cfg.lr:g}" if with_lr else "")


def run_mqar(model_name: str, cfg: RunConfig, out_dir: str | Path | None = None, *,
             label: str | None = None, progress: ProgressFn | None = None, checkpoint: str | Path | None = None,
             stop_at: float | None = None, score_paused: bool = False) -> dict[str, Any]:
    """Train `model_name` on MQAR at cfg.mqar_seq_len and evaluate with cfg.mqar_pairs pairs;
    writes `out_dir`/mqar__LABEL__MODEL.json (LABEL: `label` or mqar_label(cfg)). Training batches draw the number of pairs
    from 4, 8, ... up to mqar_pairs (the easier ones teach the lookup faster; Zoology trains on a
    mix of sizes as well). `checkpoint`, `stop_at`, `score_paused`: as for `run_formal`."""
    t_start = time.perf_counter()
    model_name = check_model_name(model_name)
    T, N, V = cfg.mqar_seq_len, cfg.mqar_pairs, cfg.mqar_vocab
    pair_choices = ([n for n in (4, 8, 16, 32, 64, 128) if n < N] if cfg.mqar_train_mix else []) + [N]
    torch.manual_seed(cfg.seed)
    model = build_model(model_name, V, d_model=cfg.d_model, n_heads=cfg.n_heads, n_blocks=cfg.n_blocks,
                        backend=cfg.backend, slstm=cfg.slstm).to(cfg.device)
    result = _run_header("mqar", label or mqar_label(cfg), model_name, model, cfg)

    def sample(rng: np.random.Generator) -> TaskBatch:
        return mqar_batch(rng, cfg.batch_size, T, int(rng.choice(pair_choices)), V, cfg.mqar_spacing)

    def score() -> dict[str, Any]:
        acc = evaluate_mqar(model, T, N, 64 * cfg.eval_samples, vocab_size=V, batch_size=cfg.eval_batch_size,
                            seed=cfg.seed + 1, device=cfg.device, precision=cfg.precision, spacing=cfg.mqar_spacing)
        return dict(accuracy=acc, chance=1.0 / (V - V // 2), scaled_accuracy=acc, train_pairs=pair_choices)

    log = _train_scoring_a_pause(model, sample, cfg, 0.9, progress, checkpoint, stop_at, score if score_paused else None)
    result.update(score())
    return _finish(result, log, t_start, out_dir)


# =============================================================================================
# Sweep
# =============================================================================================
def _run_one(job: tuple[str, str, str, dict[str, Any], str, int], progress: ProgressFn | None = None) -> dict[str, Any]:
    kind, task, model, cfg_dict, out_dir, threads = job
    if threads:
        torch.set_num_threads(threads)
    cfg = RunConfig(**cfg_dict)
    if cfg.device.startswith("cuda:"):  # this process's CUDA context on its own GPU only
        torch.cuda.set_device(cfg.device)
    try:
        if kind == "mqar":
            return run_mqar(model, cfg, out_dir, label=task, progress=progress)
        return run_formal(task, model, cfg, out_dir, progress=progress)
    except Exception as e:  # one failed run must not lose the others; the table shows the error
        result = {"kind": kind, "task": task, "model": model, "error": f"{type(e).__name__}: {e}"}
        path = Path(out_dir) / f"{kind}__{task}__{model_slug(model)}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))  # a report rebuilt from the files shows it too
        return result


def sweep_devices(device: str) -> list[str]:
    """The devices a sweep spreads its runs over: every visible GPU for a bare "cuda", else `device`."""
    if device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [device]


def run_sweep(tasks: Sequence[str], models: Sequence[str], cfg: RunConfig, out_dir: str | Path, *,
              mqar: bool = True, mqar_cfg: RunConfig | Sequence[RunConfig] | None = None, jobs: int = 1,
              steps_for: dict[str, int] | None = None, command: str | None = None,
              on_result: Callable[[int, int, dict[str, Any]], None] | None = None,
              progress: Callable[[str, str, str], ProgressFn] | None = None) -> list[dict[str, Any]]:
    """Every (task, model) run, plus MQAR for every model when `mqar`; then the report
    (see write_report); `mqar_cfg` may be a list (e.g. one per learning rate), and then every
    model runs MQAR once per entry, each its own column. `steps_for` maps a formal task to its own step count (hard tasks need
    more steps than easy ones). `jobs` > 1 runs that many in parallel processes (small models
    leave a GPU mostly idle, so several runs share it well); with cfg.device "cuda" and several
    GPUs, the runs are dealt out over all of them. `on_result(k, n, result)` is called as the
    k-th of n runs finishes; `progress(kind, task, model)` gives the progress function of each
    run (see train_on_task; picklable when jobs > 1). Returns the per-run results in plan order."""
    tasks = [get_task(t, cfg.tasks).name for t in tasks]
    models = [check_model_name(m) for m in models]
    steps_for = {get_task(t, cfg.tasks).name: n for t, n in (steps_for or {}).items()}
    for t, n in steps_for.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise XLSTMKitError(f"steps_for[{t!r}] must be a positive integer, got {n!r}")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise XLSTMKitError(f"jobs must be a positive integer, got {jobs!r}")
    out_dir = Path(out_dir)
    runs_dir = out_dir / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if command:  # kept for a report rebuilt later from the run files
        (out_dir / COMMAND_FILE).write_text(command + "\n")
    threads = max(1, (os.cpu_count() or 1) // jobs) if jobs > 1 else 0
    plan = []  # (kind, task, model, config): the longest runs first, so the workers end together
    if mqar:
        mcs = [mqar_cfg or cfg] if isinstance(mqar_cfg, RunConfig) or mqar_cfg is None else list(mqar_cfg)
        plan += [("mqar", mqar_label(mc, with_lr=len(mcs) > 1), m, mc) for mc in mcs for m in models]
    formal = [("formal", t, m, dataclasses.replace(cfg, steps=steps_for.get(t, cfg.steps))) for t in tasks for m in models]
    plan += sorted(formal, key=lambda w: -w[3].steps)  # stable: task order kept among equals
    devices = sweep_devices(cfg.device)
    work = [(kind, task, m, {**c.to_dict(), "device": devices[i % len(devices)]}, str(runs_dir), threads)
            for i, (kind, task, m, c) in enumerate(plan)]
    results: list[dict[str, Any] | None] = [None] * len(work)

    def done(i: int, r: dict[str, Any]) -> None:
        results[i] = r
        if on_result is not None:
            on_result(sum(x is not None for x in results), len(work), r)

    if jobs == 1:
        for i, w in enumerate(work):
            done(i, _run_one(w, progress(*w[:3]) if progress is not None else None))
    else:
        # spawn: CUDA cannot be used in forked children
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, w, progress(*w[:3]) if progress is not None else None): i
                       for i, w in enumerate(work)}
            for f in as_completed(futures):
                done(futures[f], f.result())
    write_report(results, out_dir, command=command)
    return results


def load_results(runs_dir: str | Path) -> list[dict[str, Any]]:
    """Every results file under `runs_dir` (as written by run_formal / run_mqar); a one-line
    JSONFileError (an XLSTMKitError) for one that is not a regular file, is larger than
    MAX_RUN_FILE_BYTES or is not a JSON object."""
    return [read_json(p, MAX_RUN_FILE_BYTES) for p in sorted(Path(runs_dir).glob("*.json"))]


def read_command(out_dir: str | Path) -> str | None:
    """The sweep's command saved in `out_dir`/command.txt, None without one; a one-line
    XLSTMKitError for one that is not a regular file (a FIFO would block the read), is larger
    than MAX_COMMAND_BYTES or is not UTF-8 text."""
    path = Path(out_dir) / COMMAND_FILE
    if not path.exists():  # exists(), not is_file(): a FIFO or a folder of that name is refused
        return None
    data = read_bytes(path, MAX_COMMAND_BYTES, error=XLSTMKitError)
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError as e:
        raise XLSTMKitError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def write_report(results: Sequence[dict[str, Any]], out_dir: str | Path, *, command: str | None = None) -> dict[str, Path]:
    """Write `out_dir`/results.json (summaries), table.md (scaled accuracy, models x tasks, plus
    steps and seconds per run) and heatmap.png (Figure-4 style). Returns the paths. Without
    `command`, the sweep's command saved in `out_dir`/command.txt heads the table. Without
    matplotlib the heatmap is skipped: "plot" is then None."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if command is None:
        command = read_command(out_dir)
    keep = ("kind", "task", "model", "scaled_accuracy", "accuracy", "train_lengths_scaled_accuracy",
            "steps_done", "planned_steps", "train_seconds", "total_seconds", "parameters", "loss_first",
            "loss_last", "device", "error")
    summary = [{k: r[k] for k in keep if k in r} for r in results]
    (out_dir / RESULTS_ALL).write_text(json.dumps(summary, indent=1))

    models = [m for m in MODEL_NAMES if any(r["model"] == m for r in summary)]
    columns = []  # (kind, task) in first-seen order, formal tasks in Figure 4's task order
    for kind, names in (("formal", list(task_set("paper"))), ("mqar", sorted({r["task"] for r in summary if r["kind"] == "mqar"}))):
        columns += [(kind, t) for t in names if any(r["kind"] == kind and r["task"] == t for r in summary)]
    cell = {(r["kind"], r["task"], r["model"]): r for r in summary}

    def label(col):
        return col[1] if col[0] == "formal" else f"MQAR {col[1]}"

    def fmt(r, key="scaled_accuracy"):
        if r is None:
            return "—"
        return "error" if "error" in r else f"{r[key]:.2f}"

    lines = []
    if command:
        lines += ["Produced by:", "", "```", command, "```", ""]
    lines += ["Scaled accuracy on test lengths (formal tasks: 0 = chance, 1 = perfect; MQAR: plain accuracy)", ""]
    lines += ["| model | " + " | ".join(label(c) for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for m in models:
        lines.append(f"| {m} | " + " | ".join(fmt(cell.get((*c, m))) for c in columns) + " |")
    lines += ["", "Scaled accuracy on the training lengths (formal) — did the model learn the task at all", ""]
    formal_cols = [c for c in columns if c[0] == "formal"]
    lines += ["| model | " + " | ".join(label(c) for c in formal_cols) + " |", "|---" * (len(formal_cols) + 1) + "|"]
    for m in models:
        lines.append(f"| {m} | " + " | ".join(fmt(cell.get((*c, m)), "train_lengths_scaled_accuracy") for c in formal_cols) + " |")
    lines += ["", "Runs", "", "| kind | task | model | params | steps | train s | loss first → last | note |",
              "|---|---|---|---|---|---|---|---|"]
    for r in summary:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['task']} | {r['model']} | | | | | {r['error'][:120]} |")
        else:
            lines.append(f"| {r['kind']} | {r['task']} | {r['model']} | {r['parameters']:,} | {r['steps_done']} | "
                         f"{r['train_seconds']:.0f} | {r['loss_first']:.3f} → {r['loss_last']:.3f} | {r.get('device', '')} |")
    table = out_dir / RESULTS_TABLE
    table.write_text("\n".join(lines) + "\n")

    plot = out_dir / RESULTS_PLOT
    try:
        import matplotlib
    except ImportError:
        return {"results": out_dir / RESULTS_ALL, "table": table, "plot": None}

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.full((len(models), len(columns)), np.nan)
    for i, m in enumerate(models):
        for j, c in enumerate(columns):
            r = cell.get((*c, m))
            if r is not None and "error" not in r:
                grid[i, j] = r["scaled_accuracy"]
    fig, ax = plt.subplots(figsize=(1.1 * len(columns) + 2.5, 0.55 * len(models) + 1.8))
    ax.imshow(np.clip(grid, 0, 1), cmap="Blues", vmin=0, vmax=1, aspect="auto")
    for i in range(len(models)):
        for j in range(len(columns)):
            v = grid[i, j]
            txt = "—" if math.isnan(v) else f"{v:.2f}"
            ax.text(j, i, txt, ha="center", va="center", fontsize=8,
                    color="white" if not math.isnan(v) and v > 0.6 else "black")
    ax.set_xticks(range(len(columns)), [label(c).replace("_", "\n") for c in columns], fontsize=8)
    ax.set_yticks(range(len(models)), models, fontsize=9)
    ax.set_title("Scaled accuracy on test lengths (0 = chance, 1 = perfect)", fontsize=10)
    fig.tight_layout()
    fig.savefig(plot, dpi=120)
    plt.close(fig)
    return {"results": out_dir / RESULTS_ALL, "table": table, "plot": plot}
