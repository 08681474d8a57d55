"""Training and evaluating on a synthetic task: masked losses over the scored positions, the
task as a workload of the library's training loop (`xlstm_kit.training.train`: batches from a
sampler, a schedule fitted to a time budget, a stop once converged, a pause at a given time; the
loop does the steps, checkpoints and resume), and the formal-language and MQAR accuracies."""
from __future__ import annotations

import dataclasses
import itertools
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import XLSTMKitError
from ..io.checkpoint import LATEST_FILE, CheckpointError, atomic_write, read_train_meta, resolve_checkpoint
from ..io.jsonfile import regular_file_exists
from ..training import (CheckpointEvent, RunState, StepEvent, TimeBudget, TrainConfig, Workload, autocast, train,
                        train_step)
from ..training.compiling import CompiledLoss
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


def _write_progress(path: Path, curve: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(curve))


def progress_path(checkpoint: str | Path) -> Path:
    """The JSON file (steps_done, planned_steps, seconds, losses) that every save of the run
    folder `checkpoint` rewrites; a finished run deletes both."""
    return Path(checkpoint).with_suffix(".progress")


def _curve(history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in history if "loss" in r]


class TaskWorkload(Workload):
    """A synthetic task as the training loop's workload: a batch of `cfg.batch_size` sequences
    from `sample(rng)` per step (the generator's state goes into each checkpoint), the loss over
    the scored positions, eager or compiled as one region with the forward (`cfg.compiles`)."""

    # a grid point that diverges is a result of the protocol (its loss NaN, its accuracy at
    # chance), not an error: the protocol would run it again and again
    stops_on_nonfinite = False

    def __init__(self, model: nn.Module, sample: Callable[[np.random.Generator], TaskBatch], cfg: RunConfig,
                 time_budget_s: float | None, stop_at: float | None) -> None:
        self.sample, self.cfg, self.time_budget_s, self.stop_at = sample, cfg, time_budget_s, stop_at
        self.device = torch.device(cfg.device)
        self.rng = np.random.default_rng(cfg.seed)
        # batches with per-row scored positions (MQAR) run the head at those positions only
        at_positions = sample(np.random.default_rng(0)).positions is not None
        self.net = _AtPositions(model) if at_positions else model
        self.inputs_of = (lambda b: (b.inputs, b.positions)) if at_positions else (lambda b: b.inputs)  # noqa: E731
        self.loss = positions_loss if at_positions else masked_loss
        self.compiled = (CompiledLoss(self.net, positions_loss if at_positions else masked_loss_static, self.device,
                                      hint=NO_COMPILE_HINT) if cfg.compiles else None)
        self.compiles = self.compiled is not None
        self.converged_at: int | None = None
        self.paused = False
        self.run: RunState | None = None

    def batches(self, step: int) -> list[tuple[Any, TaskBatch]]:
        batch = self.sample(self.rng)
        batch = (batch.pin_memory() if self.device.type == "cuda" else batch).to(self.device)
        return [(self.inputs_of(batch), batch)]

    def step(self, model, optimizer, micro_batches, **kw):
        # `model` is the plain one: a task run is a single process, and `self.net` wraps it
        if self.compiled is None:
            return train_step(self.net, optimizer, micro_batches, self.loss, **kw)
        pairs = [(pair, None) for pair in micro_batches]
        return self.compiled.run(lambda m: train_step(m, optimizer, pairs, _loss_itself, **kw),
                                 undo=lambda: optimizer.zero_grad(set_to_none=True))

    def start(self, run: RunState) -> None:
        self.run = run
        left = None if self.time_budget_s is None else max(0.0, self.time_budget_s - run.seconds_before)
        # compilation and any fallback fall in the first SETTLE_CALLS steps: never timed as step time
        self.budget = TimeBudget(left, skip_steps=run.step + max(5, CompiledLoss.SETTLE_CALLS + 2), device=self.device)

    def after_step(self, run: RunState) -> str | None:
        cfg, step = self.cfg, run.step
        if cfg.converged_loss is not None and (step % cfg.log_every == 0 or step == 1):
            tail = list(itertools.islice((r["loss"] for r in reversed(run.history) if "loss" in r), CONVERGED_LOGS))
            if len(tail) == CONVERGED_LOGS and all(v < cfg.converged_loss for v in tail):
                self.converged_at = step
                return "end"
        if self.time_budget_s is not None:
            remeasure = step in (20, 200)  # again at 200: parallel runs sharing a GPU change speed
            self.budget.step_done(step, measure=remeasure)
            fit = self.budget.steps_that_fit(step, most=cfg.steps) if remeasure else None
            if fit is not None:  # (None: resumed too close to the step to have measured)
                # the warmup keeps its share of the run (the paper protocol's 10 %)
                warm = max(1, round(cfg.warmup_steps * fit / cfg.steps)) if cfg.warmup_steps else 0
                run.config = dataclasses.replace(run.config, steps=fit, warmup_steps=min(warm, fit // 5))
            if self.budget.spent():  # slower than measured: stop here
                return "end"
        if self.stop_at is not None and step < run.config.steps and time.time() >= self.stop_at:
            self.paused = True
            return "pause"
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"numpy_rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "numpy_rng" not in state:
            raise XLSTMKitError("it is not a checkpoint of a synthetic-task run (no sampler state)")
        self.rng.bit_generator.state = state["numpy_rng"]

    def progress_record(self) -> dict[str, Any]:
        """What the run's progress file holds: steps done and planned, seconds, the loss curve."""
        run = self.run
        return {"steps_done": run.step, "planned_steps": run.config.steps, "seconds": round(run.seconds, 1),
                "losses": _curve(run.history)}


def train_on_task(model: nn.Module, sample: Callable[[np.random.Generator], TaskBatch], cfg: RunConfig,
                  time_budget_s: float | None = None, progress: ProgressFn | None = None, *,
                  checkpoint: str | Path | None = None, stop_at: float | None = None) -> TrainLog:
    """Train `model` (already on cfg.device) on batches from `sample(rng)` with the library's
    training loop (`xlstm_kit.training.train`).

    With `time_budget_s`, steps 6..20 (and 6..200) are timed and the schedule is cut to the
    steps that fit (the first steps carry one-time costs such as kernel compilation; with
    `cfg.compile` the compilation and any fallback happen within the first three steps, so
    they count against the budget but not as step time).
    `checkpoint`: the run folder that the run continues from when it holds a checkpoint (model,
    optimizer, data and torch random states, step, schedule, loss curve: the continued run
    equals an uninterrupted one), saves to every CHECKPOINT_EVERY_S seconds and at the end, and
    locks while it trains; every save also rewrites its `progress_path`. `stop_at` (a
    time.time() value, needs `checkpoint`): past it, the run saves and raises RunPaused.
    """
    if stop_at is not None and checkpoint is None:
        raise XLSTMKitError("stop_at needs a checkpoint file to save the run to")
    checkpoint = None if checkpoint is None else Path(checkpoint)
    config = TrainConfig(steps=cfg.steps, lr=cfg.lr, min_lr=cfg.min_lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                         warmup_steps=min(cfg.warmup_steps, cfg.steps // 5), grad_clip=cfg.grad_clip,
                         precision=cfg.precision, batch_size=cfg.batch_size, seed=cfg.seed, log_interval=cfg.log_every,
                         eval_interval=0, eval_at_start=False, checkpoint_interval=0,
                         checkpoint_every_s=CHECKPOINT_EVERY_S, keep_checkpoints=1)
    # not is_file(): a FIFO or a folder at `latest` is refused in one line, not taken for a fresh start
    resume = checkpoint is not None and regular_file_exists(checkpoint / LATEST_FILE, CheckpointError)
    if resume:  # the schedule a time budget fitted is the run's own: the checkpoint's
        saved = read_train_meta(resolve_checkpoint(checkpoint))["train_config"]
        config = dataclasses.replace(config, steps=saved["steps"], warmup_steps=saved["warmup_steps"])
    work = TaskWorkload(model, sample, cfg, time_budget_s, stop_at)

    def on_event(event) -> None:
        if isinstance(event, StepEvent) and progress is not None:
            progress(event.step, event.total_steps, event.loss)
        elif isinstance(event, CheckpointEvent):
            # the curve also in a small text file beside the run folder: the checkpoint is too
            # big to bring back from a lent machine, and a run lost with it keeps its curve
            _write_progress(progress_path(checkpoint), work.progress_record())

    try:
        result = train(model, work, config, checkpoint, resume=resume, callback=on_event, device=cfg.device,
                       handle_signals=False)
    finally:
        if work.compiled is not None:  # the options that trained (after any fallback); caches freed
            compiled_summary = work.compiled.summary()
            work.compiled.close()
    losses = _curve(result.history)
    if result.interrupted and not work.paused:
        raise KeyboardInterrupt
    if work.paused:
        last = f", loss {losses[-1][1]:.4f}" if losses else ""  # how far it got, in the sweep's log
        raise RunPaused(f"paused after step {result.step} of {result.config.steps}{last}; saved to {checkpoint}")
    compile_rows = [r for r in result.history if "compile_s" in r]
    return TrainLog(steps_done=result.step, planned_steps=result.config.steps, seconds=result.seconds, losses=losses,
                    converged_at=work.converged_at,
                    compiled=None if work.compiled is None else
                    {**compiled_summary, "compile_s": round(compile_rows[-1]["compile_s"], 2) if compile_rows else None})


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
