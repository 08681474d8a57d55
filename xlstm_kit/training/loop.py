"""Training and evaluation of language models: typed functions, no printing.

``train`` runs AdamW (weight-decay groups) with a warmup + cosine schedule, gradient clipping
and accumulation, bf16 autocast on CUDA, periodic validation (loss, bits per byte, perplexity),
atomic resumable checkpoints and a loss-curve PNG. Progress is reported to a callback (the
command line turns it into a progress bar). The same function runs under
``torchrun --nproc_per_node=N``: every rank computes its slice of each global batch, gradients
are averaged by DistributedDataParallel, and rank 0 alone calls the callback and writes files.

Its pieces are modules of their own, which the synthetic experiments' task loop
(xlstm_kit.experiments.task_loop) and the training benchmark use as well: `step` (`train_step`,
one optimizer step: forward under autocast, loss, backward with accumulation, clipping, learning
rate, update; `TimeBudget`, how many steps fit a wall-clock budget), `optim` (AdamW groups,
`lr_at` / `continue_schedule`), `evaluate`, `distributed`, `compiling`, and the checkpoints of
xlstm_kit.io.checkpoint.

Output folder layout (``out_dir``): the run folder of ``xlstm_kit.io.checkpoint`` (``latest``,
``checkpoints/step-N/``) plus ``metrics.jsonl`` (one JSON object per step / validation; after
a failure it keeps the rows up to the newest checkpoint, and a run that saved none leaves none)
and ``loss.png`` (the loss curve, written at the end when matplotlib is installed).
"""
from __future__ import annotations

import contextlib
import inspect
import json
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import XLSTMKitError
from ..io.checkpoint import (TRAIN_STATE_FILE, CheckpointError, atomic_write, load_optimizer_state,
                             load_training_state, load_weights_into, read_train_meta, remove_stale_staging, run_lock,
                             resolve_checkpoint, restore_rng, save_checkpoint)
from .compiling import CompileClock, compile_failure, prepare_model
from .config import MAX_SKIPPED_IN_A_ROW, METRICS_FILE, PLOT_FILE, RESUME_FROZEN, TrainConfig
from .data import BatchSampler, TokenData, val_batches
from .distributed import DistInfo, default_device
from .evaluate import evaluate
from .events import CheckpointEvent, EvalEvent, StepEvent, TrainEvent, TrainResult
from .optim import continue_schedule, lr_at, make_optimizer
from .packing import PackedSampler
from .plots import PLOT_MISSING_NOTE, plot_loss_curve, read_metrics
from .resources import cpu_threads
from .step import NonFiniteStep, StepOutput, TimeBudget, lm_loss, train_step


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


class _Run:
    """The state of one ``train`` call and its bookkeeping (metrics log, validation,
    checkpoints); ``train`` below is the loop."""

    def __init__(self, model, data, config, out_dir, dist, device, meta, callback) -> None:
        self.model, self.data, self.config, self.meta = model, data, config, meta
        self.out_dir, self.dist, self.device = out_dir, dist, device
        self.writes = out_dir is not None and dist.is_main
        self.emit = callback if (callback is not None and dist.is_main) else (lambda event: None)
        self.optimizer = make_optimizer(model, config)
        self.step = 0
        self.saved_step: int | None = None  # step of the run's newest checkpoint on disk
        self.committing = False  # inside optimizer.step: an interrupt there cannot be saved
        self.history: list[dict[str, Any]] = []
        self.metrics_path = out_dir / METRICS_FILE if out_dir is not None else None
        self.token_bytes = data.tokenizer.token_byte_lengths()
        self.packed = config.pack if config.pack is not None else (
            data.train_docs is not None and "cu_seqlens" in inspect.signature(model.forward).parameters)
        if self.packed and data.train_docs is None:
            raise XLSTMKitError(f"pack=True needs data with documents (several files, or an EOS token in "
                                f"the text, loaded with documents=True); {data.source!r} has none")
        self.sampler = (PackedSampler(data.train, data.train_docs, config.seq_len, config.batch_size, seed=config.seed)
                        if self.packed else BatchSampler(data.train, config.seq_len, config.batch_size, seed=config.seed))
        self.result = TrainResult(step=0, interrupted=False)

    def micro_batches(self) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches of the next optimizer step, on the device."""
        n = self.config.grad_accum
        for micro in range(n):
            x, y = self.sampler.batch(self.step, rank=self.dist.rank, world_size=self.dist.world_size,
                                      micro=micro, n_micro=n)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def start_commit(self) -> None:
        self.committing = True

    def restore(self) -> None:
        """Weights, optimizer, RNG and step from the run's latest checkpoint; the schedule goes
        on smoothly when ``config.steps`` changed (:func:`continue_schedule`)."""
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
        load_optimizer_state(self.optimizer, state["optimizer"], ckpt / TRAIN_STATE_FILE)
        load_weights_into(self.model, ckpt)
        restore_rng(state, self.device, ckpt / TRAIN_STATE_FILE)
        self.step = self.saved_step = int(state["step"])
        self.config = continue_schedule(saved, self.config, self.step)

    def open_log(self, resume: bool) -> None:
        if not self.writes:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(self.out_dir)
        if resume:  # drop rows of steps after the checkpoint (a run killed between checkpoints)
            self.history = read_metrics(self.metrics_path, self.step)
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in self.history))

    def log(self, row: dict[str, Any]) -> None:
        self.history.append(row)
        if self.writes:
            with open(self.metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

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
        c = self.config
        m = evaluate(self.model, self.data.val, seq_len=c.seq_len, batch_size=c.batch_size,
                     max_batches=c.eval_batches or None, token_bytes=self.token_bytes, device=self.device,
                     precision=c.precision, dist=self.dist, doc_starts=self.data.val_docs if self.packed else None)
        self.result.evals.append((self.step, m))
        self.log({"step": self.step, "val_loss": m.loss, "val_bpb": m.bits_per_byte, "val_ppl": m.perplexity,
                  "val_batches": m.batches, "val_tokens": m.tokens})
        self.emit(EvalEvent(self.step, m))

    def save(self, barrier: bool = True) -> None:
        if self.writes:
            self.result.checkpoint = save_checkpoint(self.out_dir, self.model, self.optimizer, self.step,
                                                     self.config, self.meta, keep=self.config.keep_checkpoints)
            self.saved_step = self.step
            self.emit(CheckpointEvent(self.step, self.result.checkpoint))
        if barrier and self.dist.enabled:
            torch_dist.barrier()

    def agree(self, loss: torch.Tensor, stop: bool, late: bool) -> tuple[float, bool, bool]:
        """One small all-reduce carries the loss for logging and any rank's stop request or
        spent time budget, so that every rank stops after the same step."""
        flags = torch.stack([loss.float(), torch.tensor(float(stop), device=loss.device),
                             torch.tensor(float(late), device=loss.device)])
        if self.dist.enabled:
            torch_dist.all_reduce(flags)
            flags[0] /= self.dist.world_size
        return float(flags[0]), bool(flags[1] > 0), bool(flags[2] > 0)

    def finish(self) -> TrainResult:
        self.result.step = self.step
        if self.writes:
            try:
                self.result.plot = plot_loss_curve(self.history, self.out_dir / PLOT_FILE)
            except ImportError:
                self.result.plot_note = PLOT_MISSING_NOTE
        return self.result


def train(
    model: nn.Module,
    data: TokenData,
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
    """Train ``model`` (tokens [B, T] -> logits [B, T, V]) on ``data``.

    out_dir: where checkpoints, metrics and the loss curve go (None: write nothing).
    resume: continue from ``out_dir``'s latest checkpoint: weights, optimizer, step (hence data
      position and learning rate) and RNG are restored, so the run continues exactly as if it
      had not stopped. ``config.steps`` may differ from the checkpoint's: the cosine decay then
      continues from the current learning rate to the new end (:func:`continue_schedule`).
    callback: receives StepEvent / EvalEvent / CheckpointEvent on rank 0 only.
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

    Returns a :class:`TrainResult`; ``interrupted`` is True when a signal or KeyboardInterrupt
    stopped the run (after saving a checkpoint of the last completed step when ``out_dir``).
    Raises :class:`TrainingDiverged` when a step's loss or gradient norm is NaN or infinite
    (with ``config.on_nonfinite="skip"``: the MAX_SKIPPED_IN_A_ROW-th in a row; before, such a
    step's update is skipped): it stops before that step's update, nothing more is saved, and
    the newest checkpoint stays for a resume. ``out_dir`` is locked while the run writes it (:func:`run_lock`: another run
    into the same folder gets RunLocked).
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
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if vocab is not None and vocab < data.vocab_size:
        raise XLSTMKitError(f"model vocab_size {vocab} is smaller than the tokenizer's {data.vocab_size}")

    meta = {"tokenizer": getattr(data.tokenizer, "name", None), **(meta or {})}  # generate(text) after load
    model.to(device)
    model.train()
    prepare_model(model, config, device)
    run = _Run(model, data, config, out_dir, dist, device, meta, callback)
    if resume:
        run.restore()
    else:
        torch.manual_seed(config.seed)
    config = run.config
    run.open_log(resume)
    run.result.step = run.step

    forward_model = model
    if dist.enabled:
        forward_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    budget = TimeBudget(time_limit_s)
    compile_clock = CompileClock(config.compile)
    compile_errors = (torch._dynamo.exc.TorchDynamoException,) if config.compile else ()
    tokens_per_step = config.batch_size * config.seq_len
    skipped_in_a_row = 0
    with _StopRequest(handle_signals) as stop:
        try:
            if run.step == 0 and config.eval_at_start:
                run.validate()
            while run.step < config.steps:
                t0 = time.perf_counter()
                lr = lr_at(run.step, config)
                try:
                    out = train_step(forward_model, run.optimizer, run.micro_batches(), lm_loss, lr=lr,
                                     n_micro=config.grad_accum, precision=config.precision,
                                     grad_clip=config.grad_clip, before_update=run.start_commit,
                                     check_finite=True)
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
                step_loss, stop_now, out_of_time = run.agree(out.loss, stop.requested, budget.spent())
                dt = time.perf_counter() - t0
                run.result.losses.append((run.step, step_loss))
                run.log({"step": run.step, "loss": step_loss, "lr": lr,
                         **({"skipped_steps": run.result.skipped_steps} if skipped_in_a_row else {})})
                run.emit(StepEvent(run.step, config.steps, step_loss, lr, float(out.grad_norm),
                                  tokens_per_step / max(dt, 1e-9)))
                compiled = compile_clock.event(run.step, dt, last=run.step == config.steps)
                if compiled is not None:
                    run.log({"step": compiled.step, "compile_s": compiled.compile_s,
                             "first_step_s": compiled.first_step_s, "step_s": compiled.step_s})
                    run.emit(compiled)
                at_end = run.step == config.steps
                if (config.eval_interval and run.step % config.eval_interval == 0) or at_end \
                        or (out_of_time and not stop_now):
                    run.validate()
                if stop_now:
                    run.result.interrupted = True
                    run.save()
                    break
                if (config.checkpoint_interval and run.step % config.checkpoint_interval == 0) or at_end or out_of_time:
                    run.save()
                if out_of_time and not at_end:
                    run.result.time_limited = True
                    break
        except KeyboardInterrupt:
            # A KeyboardInterrupt outside optimizer.step leaves weights and optimizer state at
            # the last completed step (partial gradients are discarded): save that and stop.
            # One during optimizer.step cannot be saved consistently; the last checkpoint stays.
            run.result.interrupted = True
            run.optimizer.zero_grad(set_to_none=True)
            if not run.committing:
                run.save(barrier=False)
        except BaseException:
            run.abandon_log()
            raise
    return run.finish()
