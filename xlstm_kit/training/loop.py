"""The training loop of the library: typed functions, no printing.

``train`` runs AdamW (weight-decay groups) with a warmup + cosine schedule, gradient clipping
and accumulation, bf16 autocast on CUDA, periodic validation, atomic resumable checkpoints, a
metrics log and a loss-curve PNG. Progress is reported to a callback (the command line turns it
into a progress bar). The same function runs under ``torchrun --nproc_per_node=N``: every rank
computes its slice of each global batch, gradients are averaged by DistributedDataParallel, and
rank 0 alone calls the callback and writes files.

What it trains on is a :class:`~xlstm_kit.training.workload.Workload`: token data for a language
model (validation loss, bits per byte, perplexity), or the synthetic experiments' tasks
(xlstm_kit.experiments.task_loop: their batches, masked loss, accuracy, a schedule fitted to a
time budget). Everything else, resume included, is this loop's and the same for both. Its pieces
are modules of their own, which the training benchmark uses as well: `step` (`train_step`, one
optimizer step; `TimeBudget`), `optim` (AdamW groups, `lr_at` / `continue_schedule`),
`evaluate`, `distributed`, `compiling`, and the checkpoints of xlstm_kit.io.checkpoint.

Output folder layout (``out_dir``): the run folder of ``xlstm_kit.io.checkpoint`` (``latest``,
``checkpoints/step-N/``) plus ``metrics.jsonl`` (one JSON object per logged step / validation;
after a failure it keeps the rows up to the newest checkpoint, and a run that saved none leaves
none) and ``loss.png`` (the loss curve, written at the end when matplotlib is installed).
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import XLSTMKitError
from ..io.checkpoint import (TRAIN_STATE_FILE, CheckpointError, atomic_write, claim_run_files,
                             load_optimizer_state, load_training_state, load_weights_into, read_train_meta,
                             remove_stale_staging, run_lock, resolve_checkpoint, restore_rng, save_checkpoint)
from ..io.sharded import load_sharded_into, resumes_from_shards, save_sharded_checkpoint
from ..models.lora import use_lora
from .compiling import CompileClock, compile_failure, prepare_model
from .config import MAX_SKIPPED_IN_A_ROW, METRICS_FILE, PLOT_FILE, RESUME_FROZEN, TrainConfig
from .data import TokenData
from .distributed import DistInfo, default_device, on_meta, shard_model
from .events import CheckpointEvent, EvalEvent, StepEvent, TrainEvent, TrainResult
from .optim import continue_schedule, lr_at, make_optimizer
from .plots import PLOT_MISSING_NOTE, plot_loss_curve, read_metrics
from .resources import cpu_threads
from .step import NonFiniteStep, StepOutput, TimeBudget
from .workload import LanguageModelling, Workload


class TrainingDiverged(XLSTMKitError):
    """A step's loss or gradient became NaN or infinite; the run stopped before that step's
    update, saving nothing more."""


class _StopRequest:
    """SIGINT/SIGTERM set a flag checked at step boundaries, so the run stops between steps
    and saves a consistent checkpoint. A second Ctrl-C raises KeyboardInterrupt at once."""

    def __init__(self, enabled: bool) -> None:
        self.requested = False
        self._enabled = enabled and threading.current_thread() is threading.main_thread()
        self._old: dict[int, Any] = {}

    def _handler(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __enter__(self) -> "_StopRequest":
        if self._enabled:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


class RunState:
    """The state of one ``train`` call and its bookkeeping (metrics log, validation,
    checkpoints); ``train`` below is the loop. A workload's hooks read ``step`` (steps done),
    ``config``, ``history`` (the metrics rows so far, earlier sessions' included) and
    ``seconds``, and may replace ``config`` (the schedule from the next step on)."""

    def __init__(self, model, work, config, out_dir, dist, device, meta, callback) -> None:
        self.model, self.work, self.config, self.meta = model, work, config, meta
        self.out_dir, self.dist, self.device = out_dir, dist, device
        self.writes = out_dir is not None and dist.is_main
        self.emit = callback if (callback is not None and dist.is_main) else (lambda event: None)
        self.optimizer = make_optimizer(model, config)
        self.step = 0
        self.saved_step: int | None = None  # step of the run's newest checkpoint on disk
        self.committing = False  # inside optimizer.step: an interrupt there cannot be saved
        self.history: list[dict[str, Any]] = []
        self.metrics_path = out_dir / METRICS_FILE if out_dir is not None else None
        self.seconds_before = 0.0  # training time of the sessions before a resume
        self.started = time.perf_counter()
        self.result = TrainResult(step=0, interrupted=False)

    @property
    def seconds(self) -> float:
        """Wall time the run has trained, earlier sessions included."""
        return self.seconds_before + time.perf_counter() - self.started

    def start_commit(self) -> None:
        self.committing = True

    def restore(self) -> None:
        """Weights, optimizer, RNG, step and the workload's state from the run's latest
        checkpoint; the schedule goes on smoothly when ``config.steps`` changed
        (:func:`continue_schedule`)."""
        if self.out_dir is None:
            raise XLSTMKitError("resume=True needs out_dir")
        remove_stale_staging(self.out_dir)
        ckpt = resolve_checkpoint(self.out_dir)
        read_train_meta(ckpt)
        state = load_training_state(ckpt)
        try:
            saved = TrainConfig.from_dict(state["train_config"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / TRAIN_STATE_FILE} holds an invalid train_config: {e}") from None
        for name in RESUME_FROZEN:
            if getattr(saved, name) != getattr(self.config, name):
                raise CheckpointError(
                    f"cannot resume with {name}={getattr(self.config, name)}: the checkpoint was trained "
                    f"with {name}={getattr(saved, name)}"
                )
        extra = state.get("extra") or {}
        try:
            self.work.load_state_dict(extra.get("workload") or {})
            self.seconds_before = float(extra.get("seconds", 0.0))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{ckpt / TRAIN_STATE_FILE} does not hold this run's state: {e}") from None
        if self.config.parallel == "fsdp":
            load_sharded_into(self.model, self.optimizer, ckpt)
        else:
            load_optimizer_state(self.optimizer, state["optimizer"], ckpt / TRAIN_STATE_FILE)
            load_weights_into(self.model, ckpt)
        restore_rng(state, self.device, ckpt / TRAIN_STATE_FILE)
        self.step = self.saved_step = int(state["step"])
        self.config = continue_schedule(saved, self.config, self.step)

    def open_log(self, resume: bool) -> None:
        if not self.writes:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # before anything is written: a metrics log or plot of someone else's is refused, not overwritten
        claim_run_files(self.out_dir, (METRICS_FILE, PLOT_FILE))
        remove_stale_staging(self.out_dir)
        if resume:  # drop rows of steps after the checkpoint (a run killed between checkpoints)
            self.history = read_metrics(self.metrics_path, self.step)
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.history))

    def log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if self.writes:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def log_step(self, loss: torch.Tensor, lr: float, grad_norm: torch.Tensor, dt: float,
                 skipped_steps: int | None = None) -> None:
        value = float(loss)  # waits for the device: only on logged steps
        self.result.losses.append((self.step, value))
        self.log({"step": self.step, "loss": value, "lr": lr,
                  **({} if skipped_steps is None else {"skipped_steps": skipped_steps})})
        tokens = self.config.batch_size * self.config.seq_len
        self.emit(StepEvent(self.step, self.config.steps, value, lr, float(grad_norm), tokens / max(dt, 1e-9)))

    def abandon_log(self) -> None:
        """After a failure: metrics.jsonl keeps the rows up to the newest checkpoint, the point a
        resume continues from; a run that saved none (nothing to resume) leaves no log."""
        if not self.writes or not self.metrics_path.exists():
            return
        if self.saved_step is None:
            self.metrics_path.unlink(missing_ok=True)
        else:
            rows = [r for r in self.history if r.get("step", 0) <= self.saved_step]
            atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in rows))

    def validate(self) -> None:
        done = self.work.validate()
        if done is None:
            return
        metrics, row = done
        self.result.evals.append((self.step, metrics))
        self.log({"step": self.step, **row})
        self.emit(EvalEvent(self.step, metrics))

    def save(self, barrier: bool = True) -> None:
        if self.config.parallel == "fsdp" and self.out_dir is not None:  # every rank writes its shards
            self.result.checkpoint = save_sharded_checkpoint(
                self.out_dir, self.model, self.optimizer, self.step, self.config, self.meta,
                keep=self.config.keep_checkpoints, extra={"seconds": self.seconds, "workload": self.work.state_dict()})
            self.saved_step = self.step
            self.emit(CheckpointEvent(self.step, self.result.checkpoint))
        elif self.writes:
            self.result.checkpoint = save_checkpoint(
                self.out_dir, self.model, self.optimizer, self.step, self.config, self.meta,
                keep=self.config.keep_checkpoints, extra={"seconds": self.seconds, "workload": self.work.state_dict()})
            self.saved_step = self.step
            self.emit(CheckpointEvent(self.step, self.result.checkpoint))
        if barrier and self.dist.enabled:
            torch_dist.barrier()

    def agree(self, loss: torch.Tensor, stop: bool, late: bool, save_due: bool) -> tuple[torch.Tensor, bool, bool, bool]:
        """Under several processes one small all-reduce carries the loss for logging and any
        rank's stop request, spent time budget or due timed checkpoint, so that every rank stops
        (and saves: a sharded save is collective, a DDP save ends in a barrier) after the same
        step. A single process does not wait for the device here: it reads the loss on logged
        steps only."""
        if not self.dist.enabled:
            return loss, stop, late, save_due
        flags = torch.stack([loss.float()] + [torch.tensor(float(f), device=loss.device) for f in (stop, late, save_due)])
        torch_dist.all_reduce(flags)
        flags[0] /= self.dist.world_size
        return flags[0], bool(flags[1] > 0), bool(flags[2] > 0), bool(flags[3] > 0)

    def finish(self) -> TrainResult:
        self.result.step = self.step
        self.result.config, self.result.history, self.result.seconds = self.config, self.history, self.seconds
        if self.writes:
            try:
                self.result.plot = plot_loss_curve(self.history, self.out_dir / PLOT_FILE)
            except ImportError:
                self.result.plot_note = PLOT_MISSING_NOTE
        return self.result


def train(
    model: nn.Module,
    data: TokenData | Workload,
    config: TrainConfig,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    callback: Callable[[TrainEvent], None] | None = None,
    device: torch.device | str | None = None,
    dist: DistInfo | None = None,
    meta: dict[str, Any] | None = None,
    handle_signals: bool = True,
    time_limit_s: float | None = None,
    threads: int | str | None = "auto",
) -> TrainResult:
    """Train ``model`` on ``data``: token data (a language model, tokens [B, T] -> logits
    [B, T, V], validated on ``data.val``) or any :class:`Workload`.

    out_dir: where checkpoints, metrics and the loss curve go (None: write nothing).
    resume: continue from ``out_dir``'s latest checkpoint: weights, optimizer, step (hence data
      position and learning rate), RNG and the workload's state are restored, so the run
      continues exactly as if it had not stopped. The RESUME_FROZEN settings must be the
      checkpoint's; ``config.steps`` may differ from the checkpoint's: the cosine decay then
      continues from the current learning rate to the new end (:func:`continue_schedule`).
    callback: receives StepEvent (on logged steps: every ``config.log_interval``-th, the first
      and the last) / EvalEvent / CheckpointEvent / CompileEvent on rank 0 only.
    dist: from :func:`init_distributed`; with world_size > 1 the model is wrapped in
      DistributedDataParallel and each rank trains on its slice of every global batch.
    meta: JSON-serialisable facts stored with each checkpoint (tokenizer, data spec, preset);
      meta["tokenizer"] also goes into the checkpoint's tokenizer.json.
    handle_signals: stop cleanly on SIGINT/SIGTERM, saving a resumable checkpoint.
    time_limit_s: wall-clock budget of this call; when spent, the run validates, saves a
      checkpoint and returns early with ``time_limited`` set (the schedule is not shortened).

    threads: torch's CPU threads during the call, restored afterwards (CPU runs only). "auto":
      the command line's policy (:func:`resources.default_threads`: fewer threads when other
      processes keep the cores busy; a thread that shares its core with a busy process stalls
      every operator, which made training 20x slower on a loaded 2-core machine), applied only
      while torch's setting is its own default: after your ``torch.set_num_threads(n)`` (n other
      than torch's default) or with OMP_NUM_THREADS / MKL_NUM_THREADS set, yours is kept. An int:
      that many. None: torch's setting as it is.

    Returns a :class:`TrainResult`; ``interrupted`` is True when a signal, KeyboardInterrupt or
    the workload's "pause" stopped the run (after saving a checkpoint of the last completed step
    when ``out_dir``). Raises :class:`TrainingDiverged` when a step's loss or gradient norm is
    NaN or infinite (unless the workload records divergence instead; with ``config.on_nonfinite="skip"``: the MAX_SKIPPED_IN_A_ROW-th in a row; before, such a
    step's update is skipped): it stops before that step's update, nothing more is saved, and
    the newest checkpoint stays for a resume. ``out_dir`` is locked while the run writes it
    (:func:`run_lock`: another run into the same folder gets RunLocked).
    """
    dist = dist or DistInfo()
    out_dir = Path(out_dir) if out_dir is not None else None
    target = torch.device(device) if device is not None else default_device(dist)
    with run_lock(out_dir) if out_dir is not None and dist.is_main else contextlib.nullcontext(), \
            cpu_threads(target, threads):
        return _train(model, data, config, out_dir, resume, callback, device, dist, meta, handle_signals,
                      time_limit_s)


def _train(model, data, config, out_dir, resume, callback, device, dist, meta, handle_signals,
           time_limit_s) -> TrainResult:
    device = torch.device(device) if device is not None else default_device(dist)
    per_rank = config.batch_size // (dist.world_size * config.grad_accum)
    if per_rank * dist.world_size * config.grad_accum != config.batch_size:
        raise XLSTMKitError(
            f"batch_size {config.batch_size} is not divisible by world_size*grad_accum = "
            f"{dist.world_size * config.grad_accum}"
        )
    if isinstance(data, Workload):
        work = data
    else:
        work = LanguageModelling(model, data, config, dist, device)
        meta = {"tokenizer": getattr(data.tokenizer, "name", None), **(meta or {})}  # generate(text) after load
    shapes_only = on_meta(model)
    if shapes_only and not (config.parallel == "fsdp" and dist.enabled):
        raise XLSTMKitError("the model is on the meta device (shapes without weights): only parallel='fsdp' with "
                            "several processes may pass one (ranks other than 0, or every rank resuming from a "
                            "sharded checkpoint); build it with its weights")
    if not shapes_only:  # a meta model gets its shards from shard_model, their values from rank 0 or restore()
        model.to(device)
    model.train()
    if config.lora:  # before the optimizer is built: it takes the trainable parameters only
        use_lora(model, config.lora, config.lora_alpha, config.lora_targets, seed=config.seed)
    prepare_model(model, config, device)
    if config.parallel == "fsdp":  # before the optimizer is built: it must hold the sharded parameters
        # restore() overwrites every weight from a sharded checkpoint: rank 0's would go for nothing
        from_shards = resume and out_dir is not None and resumes_from_shards(out_dir)
        shard_model(model, dist, device, config.precision, weights_from="checkpoint" if from_shards else "rank0")
    run = RunState(model, work, config, out_dir, dist, device, meta, callback)
    if resume:
        run.restore()
    else:
        torch.manual_seed(config.seed)
    run.open_log(resume)
    run.result.step = run.step

    forward_model = model
    if dist.enabled and config.parallel == "ddp":
        forward_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    budget = TimeBudget(time_limit_s)
    compile_clock = CompileClock(config.compile or work.compiles)
    compile_errors = (torch._dynamo.exc.TorchDynamoException,) if config.compile else ()
    work.start(run)
    run.started = last_save = time.perf_counter()
    skipped_in_a_row = 0
    with _StopRequest(handle_signals) as stop:
        try:
            if run.step == 0 and run.config.eval_at_start:
                run.validate()
            while run.step < run.config.steps:
                config = run.config
                t0 = time.perf_counter()
                lr = lr_at(run.step, config)
                try:
                    out = work.step(forward_model, run.optimizer, work.batches(run.step), lr=lr,
                                    n_micro=config.grad_accum, precision=config.precision,
                                    grad_clip=config.grad_clip, before_update=run.start_commit,
                                    check_finite=work.stops_on_nonfinite)
                except compile_errors as e:
                    raise compile_failure(e) from e
                except NonFiniteStep as e:
                    # refused before the update: the weights and optimizer state are still those
                    # of the step before
                    skipped_in_a_row += 1
                    if config.on_nonfinite == "stop" or skipped_in_a_row > MAX_SKIPPED_IN_A_ROW:
                        # nothing more is saved, no finite checkpoint is pruned
                        kept = "no checkpoint was written" if run.saved_step is None else \
                            f"the last checkpoint (step {run.saved_step}) is kept"
                        again = f" ({skipped_in_a_row} steps in a row)" if config.on_nonfinite == "skip" else ""
                        raise TrainingDiverged(
                            f"training diverged at step {run.step + 1}{again}: loss {e.loss}, gradient norm "
                            f"{e.grad_norm} (lr {lr:.3g}); {kept}: lower the learning rate or lengthen the warmup, "
                            f"then resume"
                        ) from None
                    run.result.skipped_steps += 1
                    out = StepOutput(torch.tensor(e.loss, device=device), torch.tensor(e.grad_norm, device=device))
                else:
                    skipped_in_a_row = 0
                run.step += 1
                run.committing = False
                timed_save = bool(config.checkpoint_every_s) and time.perf_counter() - last_save >= config.checkpoint_every_s
                loss, stop_now, out_of_time, timed_save = run.agree(out.loss, stop.requested, budget.spent(), timed_save)
                if compile_clock.enabled and len(compile_clock.times) < 2 and device.type == "cuda":
                    torch.cuda.synchronize(device)  # a compiling step is timed to the end of its device work
                dt = time.perf_counter() - t0
                logged = run.step == 1 or run.step % config.log_interval == 0
                logged = logged or skipped_in_a_row > 0  # a skipped step is always in the log
                if logged:
                    run.log_step(loss, lr, out.grad_norm, dt, run.result.skipped_steps if skipped_in_a_row else None)
                decision = work.after_step(run)
                config = run.config
                at_end = run.step >= config.steps or decision == "end"
                if at_end and not logged:  # the curve ends at the run's last step
                    run.log_step(loss, lr, out.grad_norm, dt)
                compiled = compile_clock.event(run.step, dt, last=at_end)
                if compiled is not None:
                    run.log({"step": compiled.step, "compile_s": compiled.compile_s,
                             "first_step_s": compiled.first_step_s, "step_s": compiled.step_s})
                    run.emit(compiled)
                stop_now = stop_now or decision == "pause"
                if (config.eval_interval and run.step % config.eval_interval == 0) or at_end \
                        or (out_of_time and not stop_now):
                    run.validate()
                if stop_now:
                    run.result.interrupted = True
                    run.save()
                    break
                if (config.checkpoint_interval and run.step % config.checkpoint_interval == 0) or at_end \
                        or out_of_time or timed_save:
                    run.save()
                    last_save = time.perf_counter()
                if at_end:
                    break
                if out_of_time:
                    run.result.time_limited = True
                    break
        except KeyboardInterrupt:
            # A KeyboardInterrupt outside optimizer.step leaves weights and optimizer state at
            # the last completed step (partial gradients are discarded): save that and stop.
            # One during optimizer.step cannot be saved consistently; the last checkpoint stays.
            run.result.interrupted = True
            run.optimizer.zero_grad(set_to_none=True)
            # a sharded save is collective: the other ranks, not interrupted, would never join it
            if not run.committing and not (config.parallel == "fsdp" and dist.enabled):
                run.save(barrier=False)
        except BaseException:
            run.abandon_log()
            raise
    return run.finish()
