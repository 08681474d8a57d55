"""``xlstm-kit experiment``: the command line of the synthetic experiments (xlstm_kit.experiments).

    xlstm-kit experiment formal --task parity --model "xlstm[0:1]"
    xlstm-kit experiment mqar --model "xlstm[1:1]"
    xlstm-kit experiment sweep [--tasks ...] [--models ...] [--jobs N]

With ``--protocol paper`` (or ``quick`` for a CPU smoke run) each command runs the paper's grid
instead (xlstm_kit.experiments.protocol: learning rates x seeds, the paper's task format, optimiser and
step budgets), skips grid points finished earlier, deals them over the visible GPUs and writes
report.md, figure4.png and mqar.png:

    xlstm-kit experiment formal --task parity --model "xlstm[1:1]" --protocol paper
    xlstm-kit experiment mqar --model "xlstm[1:1]" --setting zoology --protocol paper
    xlstm-kit experiment sweep --tasks parity,majority --models ... --setting fig5 --protocol paper

Results go to ``runs/experiments/`` (gitignored) unless ``--out`` says otherwise. Progress goes
to stderr: a line when a run starts, a line per ``PROGRESS_EVERY_S`` seconds of training (and
its first and last step), and a line as each run of a sweep finishes.
"""
from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import torch

from .._extras import install_hint
from ..errors import XLSTMKitError
from ..experiments import experiment as ex, protocol as pr
from ..experiments.config import RunConfig, quick_config
from ..experiments.formal import TASKS
from ..experiments.models import DEFAULT_MODELS, MQAR_LR
from ..experiments.registry import get_task, task_set
from .args import PROG, UsageError
from .common import check_out_dir, pick_device

PROGRESS_EVERY_S = 15.0


# --------------------------------------------------------------------------------------------
# Parsing the sweep's list options
# --------------------------------------------------------------------------------------------


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_steps_for(text: str | None) -> dict[str, int]:
    """"parity=4000,majority=1500" -> {"parity": 4000, "majority": 1500} (task names checked)."""
    steps_for = {}
    for item in _split(text or ""):
        name, sep, n = item.partition("=")
        if not sep or not n.strip().isdigit() or int(n) < 1:
            raise UsageError(f"--steps-for wants TASK=N items with N a positive integer, got {item!r}")
        steps_for[get_task(name.strip()).name] = int(n)
    return steps_for


def parse_lrs(text: str | None) -> list[float | None]:
    """"1e-3,3e-3" -> [0.001, 0.003]; None -> [None] (the default rate)."""
    if not text:
        return [None]
    try:
        lrs = [float(x) for x in _split(text)]
    except ValueError:
        lrs = []
    if not lrs or not all(x > 0 and math.isfinite(x) for x in lrs):
        raise UsageError(f"--mqar-lr wants positive numbers separated by commas, got {text!r}")
    return lrs


def _run_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields = {"steps": args.steps, "time_limit_s": args.time_limit, "batch_size": args.batch_size, "lr": args.lr,
              "d_model": args.d_model, "n_heads": args.heads, "mqar_seq_len": args.seq_len, "mqar_pairs": args.pairs, "seed": args.seed,
              "precision": args.precision, "backend": args.backend, "eval_samples": args.eval_samples,
              "compile": args.compile}
    fields = {k: v for k, v in fields.items() if v is not None}
    if "lr" in fields:
        fields["min_lr"] = fields["lr"] / 10
    return fields


def _mqar_fields(fields: dict[str, Any], quick: bool, lr=None, steps=None, time_limit=None) -> dict[str, Any]:
    f = dict(fields)
    lr = lr if lr is not None else fields.get("lr", None if quick else MQAR_LR)
    if lr is not None:
        f.update(lr=lr, min_lr=lr / 10)
    if steps is not None:
        f["steps"] = steps
    if time_limit is not None:
        f["time_limit_s"] = time_limit
    return f


# --------------------------------------------------------------------------------------------
# Progress and result lines
# --------------------------------------------------------------------------------------------


class ProgressLines:
    """A progress function for ``train_on_task``: prints "LABEL: step S/N  loss L  (T s)" for
    the first and the last step and at most once per ``every_s`` seconds in between. Picklable
    (stream None: the process's stderr), so a sweep's worker processes report too."""

    def __init__(self, label: str, stream: TextIO | None = None, every_s: float = PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.stream, self.every_s, self.clock = label, stream, every_s, clock
        self.start: float | None = None
        self.last = -math.inf

    def __call__(self, step: int, planned: int, loss: float) -> None:
        now = self.clock()
        if self.start is None:
            self.start = now
        if step == 1 or step >= planned or now - self.last >= self.every_s:
            self.last = now
            print(f"  {self.label}: step {step}/{planned}  loss {loss:.3f}  ({now - self.start:.0f} s)",
                  file=self.stream or sys.stderr, flush=True)


def result_line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['kind']} {r['task']} {r['model']}: {r['error']}"
    what = "scaled accuracy" if r["kind"] == "formal" else "accuracy"
    compiled = "" if r.get("compiled") is None else f", {r['compiled']['compile_s'] or 0:.0f} s of it compiling"
    return (f"{r['kind']} {r['task']} {r['model']}: {what} {r['scaled_accuracy']:.3f} after "
            f"{r['steps_done']} steps ({r['train_seconds']:.0f} s{compiled}), loss {r['loss_first']:.3f} -> "
            f"{r['loss_last']:.3f}" + (f" -> {r['path']}" if "path" in r else ""))


def _report_paths(paths: dict[str, Path | None]) -> str:
    plot = paths["plot"] or f"no heatmap (matplotlib is not installed: {install_hint('matplotlib')})"
    return f"report: {paths['table']} and {plot}"


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def cmd_experiment(args: argparse.Namespace) -> int:
    if args.experiment == "formal":  # names first: a typo must not cost a training run
        get_task(args.task, "paper" if args.protocol else "small")
    if args.experiment in ("formal", "mqar"):
        ex.check_model_name(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    command = " ".join([PROG] + [shlex.quote(a) for a in sys.argv[1:]])
    if args.experiment == "sweep" and args.report_only and args.protocol:
        results = pr.load_protocol_results(out / "runs")
        if not results:
            raise UsageError(f"--report-only: {out / 'runs'} holds no grid-point results to report")
        paths = pr.write_protocol_report(results, out, command=ex.read_command(out))
        print(f"report: {paths['report']}")
        return 0
    if args.experiment == "sweep" and args.report_only:
        if not any((out / "runs").glob("*.json")):
            raise UsageError(f"--report-only: {out / 'runs'} holds no results (*.json) to report; "
                             f"run the sweep first, or pass its --out")
        try:
            results = ex.load_results(out / "runs")
        except XLSTMKitError as e:  # a results file that cannot be read; the message names it
            raise UsageError(f"--report-only: {e}") from None
        paths = ex.write_report(results, out)  # keeps the sweep's command
        print(_report_paths(paths))
        return 0
    device = pick_device(args.device)
    check_out_dir(out)
    if args.score_paused and args.stop_after is None:
        raise UsageError("--score-paused needs --stop-after")
    if args.protocol:
        return cmd_protocol(args, out, str(device), command)
    if args.stop_after is not None:
        raise UsageError("--stop-after needs --protocol (its grid points are checkpointed and continued)")
    if getattr(args, "shapes", None):
        raise UsageError("--shapes needs --protocol (without it, --seq-len and --pairs give the one shape)")
    fields = _run_fields(args)
    make = quick_config if args.quick else RunConfig

    if args.experiment in ("formal", "mqar"):
        if args.experiment == "mqar":
            cfg = make(device=str(device), **_mqar_fields(fields, args.quick))
            label = f"mqar {ex.mqar_label(cfg)} {args.model}"
        else:
            cfg = make(device=str(device), **fields)
            label = f"formal {get_task(args.task).name} {args.model}"
        limit = (f", time limit {cfg.time_limit_s:g} s" if cfg.time_limit_s else "") + (", compiled" if cfg.compiles else "")
        print(f"{label}: up to {cfg.steps} steps on {device}{limit} -> {out / 'runs'}", file=sys.stderr, flush=True)
        progress = ProgressLines(label)
        if args.experiment == "mqar":
            r = ex.run_mqar(args.model, cfg, out / "runs", progress=progress)
        else:
            r = ex.run_formal(args.task, args.model, cfg, out / "runs", progress=progress)
        print(result_line(r))
        return 0

    tasks = _tasks(args.tasks, TASKS)
    models = _split(args.models) if args.models else list(DEFAULT_MODELS)
    for t in tasks:
        get_task(t)
    for m in models:
        ex.check_model_name(m)
    steps_for = parse_steps_for(args.steps_for)
    mqar_cfg = [make(device=str(device), **_mqar_fields(fields, args.quick, lr, args.mqar_steps, args.mqar_time_limit))
                for lr in parse_lrs(args.mqar_lr)]
    cfg = make(device=str(device), **fields)
    n_runs = len(tasks) * len(models) + (0 if args.no_mqar else len(mqar_cfg) * len(models))
    print(f"sweep: {n_runs} runs on {device} ({args.jobs} at a time) -> {out}", file=sys.stderr, flush=True)

    def on_result(k: int, n: int, r: dict[str, Any]) -> None:
        print(f"[{k}/{n}] {result_line(r)}", file=sys.stderr, flush=True)

    results = ex.run_sweep(tasks, models, cfg, out, mqar=not args.no_mqar, mqar_cfg=mqar_cfg, jobs=args.jobs,
                           steps_for=steps_for, command=command, on_result=on_result,
                           progress=lambda kind, task, model: ProgressLines(f"{kind} {task} {model}"))
    for r in results:
        print(result_line(r))
    print(_report_paths({"table": out / ex.RESULTS_TABLE,
                         "plot": out / ex.RESULTS_PLOT if (out / ex.RESULTS_PLOT).exists() else None}))
    return 0


# --------------------------------------------------------------------------------------------
# --protocol: the paper's grid
# --------------------------------------------------------------------------------------------


def _tasks(text: str | None, default) -> list[str]:
    """--tasks: the names given, every task of `default` without it, none for "none"."""
    if text is not None and text.strip().lower() == "none":
        return []
    return _split(text) if text else list(default)


def _numbers(text: str | None, kind, option: str) -> list | None:
    if not text:
        return None
    try:
        vals = [kind(x) for x in _split(text)]
    except ValueError:
        vals = []
    if not vals or not all(v >= 0 and math.isfinite(v) for v in vals):
        raise UsageError(f"{option} wants numbers separated by commas, got {text!r}")
    return vals


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in _split(text):
        T, sep, N = item.lower().partition("x")
        if not (sep and T.isdigit() and N.isdigit() and int(T) > 0 and int(N) > 0):
            raise UsageError(f"--shapes wants sequence length x pairs separated by commas (256x16,2048x48), got {text!r}")
        out.append((int(T), int(N)))
    if not out:
        raise UsageError("--shapes wants at least one shape, e.g. 256x16")
    return out


def cmd_protocol(args: argparse.Namespace, out: Path, device: str, command: str) -> int:
    proto = pr.get_protocol(args.protocol)
    clash = [o for o, v in (("--lr", args.lr), ("--seed", args.seed), ("--quick", args.quick),
                            ("--mqar-lr", getattr(args, "mqar_lr", None)),
                            ("--steps-for", getattr(args, "steps_for", None))) if v]
    if clash:
        raise UsageError(f"{', '.join(clash)} do not apply with --protocol (it sets them: use --lrs, --seeds, "
                         "--setting, --steps)")
    if (args.seq_len is None) != (args.pairs is None):
        raise UsageError("with --protocol, --seq-len and --pairs go together (the one MQAR shape to run)")
    shapes = None if args.seq_len is None else [(args.seq_len, args.pairs)]
    if getattr(args, "shapes", None):
        if shapes:
            raise UsageError("--shapes and --seq-len/--pairs both name the MQAR shapes: give one of them")
        shapes = _shapes(args.shapes)
    lrs = _numbers(args.lrs, float, "--lrs")
    seeds = _numbers(args.seeds, int, "--seeds")
    overrides = {k: v for k, v in {"steps": args.steps, "batch_size": args.batch_size, "precision": args.precision,
                                   "backend": args.backend, "time_limit_s": args.time_limit,
                                   "eval_samples": args.eval_samples, "compile": args.compile}.items() if v is not None}
    models = [args.model] if args.experiment in ("formal", "mqar") else (
        _split(args.models) if args.models else list(DEFAULT_MODELS))
    jobs = []
    if args.experiment in ("formal", "sweep"):
        tasks = [args.task] if args.experiment == "formal" else _tasks(args.tasks, task_set("paper"))
        if tasks and args.heads:  # the formal run ids carry no head count: it would pass for the default's
            raise UsageError("--heads with --protocol applies to MQAR runs only (sweep: add --tasks none)")
        f_over = dict(overrides, **({"d_model": args.d_model} if args.d_model else {}))
        jobs += pr.formal_plan(tasks, models, proto, lrs=lrs, seeds=seeds, overrides=f_over)
    if args.experiment == "mqar" or (args.experiment == "sweep" and not args.no_mqar):
        widths = _numbers(args.widths, int, "--widths") or ([args.d_model] if args.d_model else None)
        m_over = dict(overrides, **{k: v for k, v in (("steps", getattr(args, "mqar_steps", None)),
                                                      ("time_limit_s", getattr(args, "mqar_time_limit", None)),
                                                      ("n_heads", args.heads))
                                    if v is not None})
        jobs += pr.mqar_plan(models, proto, args.setting or "zoology", widths=widths, lrs=lrs, seeds=seeds,
                             overrides=m_over, shapes=shapes)
    out.mkdir(parents=True, exist_ok=True)
    (out / ex.COMMAND_FILE).write_text(command + "\n")
    todo = [j for j in jobs if not pr.finished(j, out / "runs")]
    gpus = pr.plan_devices(device)
    print(f"protocol {proto.name}: {len(jobs)} grid points, {len(jobs) - len(todo)} finished before, "
          f"{len(todo)} to run on {', '.join(gpus)} ({args.jobs} per device) -> {out}", file=sys.stderr, flush=True)

    def on_result(k: int, n: int, r: dict[str, Any]) -> None:
        if r.get("paused"):
            what = r.get("message", "not started (--stop-after)")
        else:
            what = r.get("error") or f"{r['scaled_accuracy']:.3f} after {r['steps_done']} steps ({r['train_seconds']:.0f} s)"
        print(f"[{k}/{n}] {r['id']}: {what}", file=sys.stderr, flush=True)

    results = pr.run_plan(jobs, out, device=device, jobs_per_device=args.jobs, on_result=on_result,
                          stop_after_s=args.stop_after, score_paused=args.score_paused)
    paused = sum(1 for r in results if r.get("paused"))
    if paused:
        print(f"{paused} grid points paused or not started: run the same command again to continue them",
              file=sys.stderr, flush=True)
    paths = pr.write_protocol_report(pr.load_protocol_results(out / "runs"), out, command=command)
    print(f"report: {paths['report']}" + "".join(f", {paths[k]}" for k in ("figure4", "mqar") if paths[k]))
    return 0
