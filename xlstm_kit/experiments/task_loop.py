"""Training and evaluating on a synthetic task: masked losses over the scored positions, the
task loop (batches from a sampler, the library's `train_step`, a time budget, pause and resume
through a checkpoint file), and the formal-language and MQAR accuracies."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import XLSTMKitError
from ..io.checkpoint import (LATEST_FILE, TRAIN_STATE_FILE, atomic_write, load_optimizer_state, load_training_state,
                             load_weights_into, resolve_checkpoint, restore_rng, save_checkpoint)
from ..training import TimeBudget, TrainConfig, autocast, lr_at, make_optimizer, train_step
from ..training.compiling import CompileClock, CompiledLoss
from .config import RunConfig
from .formal import FormalTask, TaskBatch, make_batch, scaled_accuracy, sequence_accuracy
from .mqar import VOCAB_SIZE, mqar_batch


def masked_loss(logits: torch.Tensor, batch: TaskBatch) -> torch.Tensor:
    """Mean cross entropy over the scored positions (logits [B, T, V], float32 inside)."""
    return F.cross_entropy(logits[batch.mask].float(), batch.targets[batch.mask])


def masked_loss_static(logits: torch.Tensor, batch: TaskBatch) -> torch.Tensor:
    """masked_loss with static shapes (the compiled step's): every position's cross entropy,
    weighted by the mask. A boolean index has a data-dependent shape: it reads the mask back to
    the host and splits a compiled graph. Eagerly this costs float32 copies of all the logits
    (MQAR: [256, T, 8192]), which Inductor fuses away; so the eager step keeps masked_loss."""
    ce = F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.flatten(), reduction="none")
    weight = batch.mask.flatten().to(ce.dtype)
    return (ce * weight).sum() / weight.sum()


def positions_loss(logits: torch.Tensor, batch: TaskBatch) -> torch.Tensor:
    """masked_loss for logits [B, n, V] taken at batch.positions [B, n] only (static shapes)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), batch.targets.gather(1, batch.positions).flatten())


class _AtPositions(nn.Module):
    # model(tokens, logits_to_keep=positions): MQAR scores 16 of 256 positions per row, and the
    # output head over its 8192-token vocabulary is most of a small model's step when it runs
    # at every position (logits [B, T, 8192], their softmax and its gradient)
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        tokens, positions = inputs
        return self.model(tokens, logits_to_keep=positions)


def _loss_itself(loss: torch.Tensor, _target) -> torch.Tensor:
    return loss  # the compiled step's module returns the loss already


NO_COMPILE_HINT = "Run without compile (--no-compile, or RunConfig(compile=False))"


@dataclass
class TrainLog:
    steps_done: int = 0
    planned_steps: int = 0
    seconds: float = 0.0
    losses: list = field(default_factory=list)  # (step, loss)
    converged_at: int | None = None
    """The step at which training stopped on RunConfig.converged_loss (None: it did not)."""
    compiled: dict | None = None
    """A compiled run's CompiledLoss.summary() and "compile_s": the first step's extra time
    (compilation, as CompileClock estimates it; None after a single step)."""


ProgressFn = Callable[[int, int, float], None]
"""progress(step, planned_steps, loss): called at every logged step of a run."""


class RunPaused(Exception):
    """A run stopped at its `stop_at` time with its training saved to its checkpoint; the same
    call with the same checkpoint continues it."""


CONVERGED_LOGS = 8
"""Logged losses in a row below RunConfig.converged_loss that end a run (175 steps at log_every 25)."""

CHECKPOINT_EVERY_S = 120.0
"""Seconds between a run's checkpoints (a killed run loses at most this much training)."""


def _save_checkpoint(path: Path, model: nn.Module, opt, rng: np.random.Generator, step: int, sched: TrainConfig,
                     log: TrainLog, seconds: float) -> None:
    # the library's run folder (atomic, checksummed: a run killed while saving keeps the
    # previous checkpoint); the task sampler's state and the curve ride along as `extra`
    save_checkpoint(path, model, opt, step, sched, keep=1,
                    extra={"numpy_rng": rng.bit_generator.state, "losses": log.losses, "seconds": seconds})
    # the losses so far also in a small text file next to it: the checkpoint (model, optimizer)
    # is too big to bring back from a lent machine, and a run lost with it keeps its curve
    _write_progress(progress_path(path), {"steps_done": step, "planned_steps": sched.steps,
                                          "seconds": round(seconds, 1), "losses": log.losses})


def _write_progress(path: Path, curve: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(curve))


def progress_path(checkpoint: str | Path) -> Path:
    """The JSON file (steps_done, planned_steps, seconds, losses) that every save of the run
    folder `checkpoint` rewrites; a finished run deletes both."""
    return Path(checkpoint).with_suffix(".progress")


def train_on_task(model: nn.Module, sample: Callable[[np.random.Generator], TaskBatch], cfg: RunConfig,
                  time_budget_s: float | None = None, progress: ProgressFn | None = None, *,
                  checkpoint: str | Path | None = None, stop_at: float | None = None) -> TrainLog:
    """Train `model` (already on cfg.device) on batches from `sample(rng)` with `train_step`.

    With `time_budget_s`, steps 6..20 (and 6..200) are timed and the schedule is cut to the
    steps that fit (the first steps carry one-time costs such as kernel compilation; with
    `cfg.compile` the compilation and any fallback happen within the first three steps, so
    they count against the budget but not as step time).
    `checkpoint`: a run folder (xlstm_kit.io.checkpoint's format) that the run continues from
    when it holds a checkpoint (model, optimizer, data and torch random states, step, schedule,
    losses: the continued run equals an uninterrupted one) and saves to every
    CHECKPOINT_EVERY_S seconds. `stop_at` (a time.time() value, needs
    `checkpoint`): past it, the run saves and raises RunPaused.
    """
    if stop_at is not None and checkpoint is None:
        raise XLSTMKitError("stop_at needs a checkpoint file to save the run to")
    device = torch.device(cfg.device)
    rng = np.random.default_rng(cfg.seed)
    sched = TrainConfig(steps=cfg.steps, lr=cfg.lr, min_lr=cfg.min_lr, betas=cfg.betas,
                        weight_decay=cfg.weight_decay, warmup_steps=min(cfg.warmup_steps, cfg.steps // 5))
    opt = make_optimizer(model, sched)
    log = TrainLog(planned_steps=cfg.steps)
    step, loss, seconds_before = 0, torch.zeros(()), 0.0
    checkpoint = None if checkpoint is None else Path(checkpoint)
    if checkpoint is not None and (checkpoint / LATEST_FILE).is_file():
        ck = resolve_checkpoint(checkpoint)
        state = load_training_state(ck)
        load_weights_into(model, ck)
        load_optimizer_state(opt, state["optimizer"], ck / TRAIN_STATE_FILE)
        restore_rng(state, device, ck / TRAIN_STATE_FILE)
        extra = state.get("extra") or {}
        if not {"numpy_rng", "losses", "seconds"} <= set(extra):
            raise XLSTMKitError(f"{ck} is not a checkpoint of a synthetic-task run (no sampler state)")
        rng.bit_generator.state = extra["numpy_rng"]
        step, log.losses, seconds_before = int(state["step"]), list(extra["losses"]), extra["seconds"]
        saved = state["train_config"]
        sched = dataclasses.replace(sched, steps=saved["steps"], warmup_steps=saved["warmup_steps"])
        time_budget_s = None if time_budget_s is None else max(0.0, time_budget_s - seconds_before)
    # batches with per-row scored positions (MQAR) run the head at those positions only
    at_positions = sample(np.random.default_rng(0)).positions is not None
    net = _AtPositions(model) if at_positions else model
    inputs_of = (lambda b: (b.inputs, b.positions)) if at_positions else (lambda b: b.inputs)  # noqa: E731
    compiled = (CompiledLoss(net, positions_loss if at_positions else masked_loss_static, device,
                             hint=NO_COMPILE_HINT) if cfg.compiles else None)
    clock, compile_s = CompileClock(compiled is not None), None
    # compilation and any fallback fall in the first SETTLE_CALLS steps: never timed as step time
    budget = TimeBudget(time_budget_s, skip_steps=step + max(5, CompiledLoss.SETTLE_CALLS + 2), device=device)
    last_save = time.monotonic()
    model.train()
    try:
        while step < sched.steps:
            batch = sample(rng)
            batch = (batch.pin_memory() if device.type == "cuda" else batch).to(device)
            kw = dict(lr=lr_at(step, sched), precision=cfg.precision, grad_clip=cfg.grad_clip)
            if compiled is None:
                loss = train_step(net, opt, [(inputs_of(batch), batch)],
                                  positions_loss if at_positions else masked_loss, **kw).loss
            else:
                t0 = time.perf_counter()
                loss = compiled.run(lambda m: train_step(m, opt, [((inputs_of(batch), batch), None)], _loss_itself, **kw),
                                    undo=lambda: opt.zero_grad(set_to_none=True)).loss
                if len(clock.times) < 2:  # the first two steps, timed to the end of their device work
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    timed = clock.event(step + 1, time.perf_counter() - t0, last=step + 1 == sched.steps)
                    compile_s = compile_s if timed is None else round(timed.compile_s, 2)
            step += 1
            if step % cfg.log_every == 0 or step == 1:
                log.losses.append((step, float(loss)))
                if progress is not None:
                    progress(step, sched.steps, log.losses[-1][1])
                tail = log.losses[-CONVERGED_LOGS:]
                if (cfg.converged_loss is not None and len(tail) == CONVERGED_LOGS
                        and all(v < cfg.converged_loss for _, v in tail)):
                    log.converged_at = step
                    break
            if time_budget_s is not None:
                remeasure = step in (20, 200)  # again at 200: parallel runs sharing a GPU change speed
                budget.step_done(step, measure=remeasure)
                if remeasure:
                    fit = budget.steps_that_fit(step, most=cfg.steps)
                    # the warmup keeps its share of the run (the paper protocol's 10 %)
                    warm = max(1, round(cfg.warmup_steps * fit / cfg.steps)) if cfg.warmup_steps else 0
                    sched = dataclasses.replace(sched, steps=fit, warmup_steps=min(warm, fit // 5))
                if budget.spent():  # slower than measured: stop here
                    break
            if checkpoint is not None and step < sched.steps:
                paused = stop_at is not None and time.time() >= stop_at
                if paused or time.monotonic() - last_save >= CHECKPOINT_EVERY_S:
                    _save_checkpoint(checkpoint, model, opt, rng, step, sched, log, seconds_before + budget.elapsed())
                    last_save = time.monotonic()
                if paused:
                    last = f", loss {log.losses[-1][1]:.4f}" if log.losses else ""  # how far it got, in the sweep's log
                    raise RunPaused(f"paused after step {step} of {sched.steps}{last}; saved to {checkpoint}")
    finally:
        if compiled is not None:  # the options that trained (after any fallback); caches freed
            log.compiled = {**compiled.summary(), "compile_s": compile_s}
            compiled.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    log.steps_done, log.planned_steps = step, sched.steps
    log.seconds = seconds_before + budget.elapsed()
    if not log.losses or log.losses[-1][0] != step:
        log.losses.append((step, float(loss)))
        if progress is not None:
            progress(step, sched.steps, log.losses[-1][1])
    return log


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@torch.no_grad()
def evaluate_formal(model: nn.Module, task: FormalTask, lengths: Sequence[int], samples: int, *,
                    batch_size: int = 256, seed: int = 0, device="cpu", precision: str = "fp32",
                    teacher_forcing: bool = True) -> dict[str, Any]:
    """Accuracy of `model` on `samples` fresh sequences per input length.

    Returns {"accuracy", "scaled_accuracy"} (means over lengths of the per-length means) and
    "per_length": {length: scaled accuracy}. Batches hold sequences of similar length, padded to
    a multiple of 64 tokens so that few distinct shapes reach the kernels.
    """
    device = torch.device(device)
    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    todo = sorted(int(n) for n in lengths for _ in range(samples))
    sums: dict[int, list[float]] = {}
    for i in range(0, len(todo), batch_size):
        chunk = todo[i : i + batch_size]
        pad = _round_up(task.max_seq_len(chunk[-1]), 64)
        batch = make_batch(task, rng, chunk, pad_to=pad, teacher_forcing=teacher_forcing).to(device)
        with autocast(device, precision):
            logits = model(batch.inputs)
        acc = sequence_accuracy(logits, batch.targets, batch.mask).cpu().tolist()
        for n, a in zip(chunk, acc):
            sums.setdefault(n, []).append(a)
    model.train(was_training)
    per_length = {n: float(np.mean(v)) for n, v in sorted(sums.items())}
    accuracy = float(np.mean(list(per_length.values())))
    return {
        "accuracy": accuracy,
        "scaled_accuracy": scaled_accuracy(accuracy, task.chance),
        "per_length": {n: scaled_accuracy(a, task.chance) for n, a in per_length.items()},
    }


@torch.no_grad()
def evaluate_mqar(model: nn.Module, seq_len: int, num_pairs: int, n_sequences: int, *, vocab_size: int = VOCAB_SIZE,
                  batch_size: int = 256, seed: int = 0, device="cpu", precision: str = "fp32",
                  spacing: str = "uniform") -> float:
    """Fraction of MQAR queries answered correctly over `n_sequences` fresh sequences. The head
    runs at the query positions only (`logits_to_keep`), as in training: logits at every
    position were [batch, seq_len, vocab] (8 GiB in float32 at 128 x 2048 x 8192)."""
    device = torch.device(device)
    rng = np.random.default_rng(seed)
    was_training = model.training
    model.eval()
    correct = total = 0
    for i in range(0, n_sequences, batch_size):
        batch = mqar_batch(rng, min(batch_size, n_sequences - i), seq_len, num_pairs, vocab_size, spacing).to(device)
        with autocast(device, precision):
            logits = model(batch.inputs, logits_to_keep=batch.positions)  # [B, num_pairs, V]
        hit = logits.argmax(-1) == batch.targets.gather(1, batch.positions)
        correct += int(hit.sum())
        total += hit.numel()
    model.train(was_training)
    return correct / total
