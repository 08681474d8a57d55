"""The paper's synthetic experiments as typed functions: build a model by name, train it on a
formal-language task or on MQAR within a step and time budget, evaluate, write results.

    build_model("xlstm[0:1]", vocab_size)          # 2 blocks, same width for every model
    run_formal("parity", "xlstm[0:1]", RunConfig(), out_dir)  -> result dict (+ JSON file)
    run_mqar("xlstm[1:1]", RunConfig(), out_dir)               -> result dict (+ JSON file)
    run_sweep(tasks, models, RunConfig(), out_dir, jobs=4)     -> results + table.md + heatmap.png

Model names: "xlstm[0:1]" (sLSTM blocks only), "xlstm[1:0]" (mLSTM only), "xlstm[1:1]" (one of
each: mLSTM first), "transformer" (Llama-style), "lstm" (nn.LSTM in the sLSTM block frame: the
paper's "LSTM (Block)"), "lstm-plain" (a plain n_blocks-layer nn.LSTM language model), "dplr"
(KDA-style DPLR blocks); the ablation "transformer-conv" (ABLATION_MODELS) runs when named only.

Training: the library's optimizer step (`xlstm_kit.train.train_step`: AdamW with weight-decay
groups, warmup + cosine schedule, clipping, autocast), cross entropy on the scored tokens only.
With a time limit, the run first times a few steps (`xlstm_kit.train.TimeBudget`) and then
shortens its schedule to what fits, so the cosine decay still ends. With `RunConfig.compile`
the forward and the loss (hence the backward) run compiled, with CUDA graphs on CUDA
(`xlstm_kit.compiling.CompiledLoss`); evaluation stays eager (its lengths vary).

Results go to `runs/experiments/` by default (the command line's `--out`); the command-line
parsing lives in `xlstm_kit.tasks.cli`. The paper's protocol (learning-rate grid x seeds, its
task format and optimiser settings, `--protocol paper`) is `xlstm_kit.tasks.protocol`; it runs
these functions once per grid point.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..training.compiling import CompileClock, CompiledLoss
from ..models import XLSTMConfig, XLSTMLanguageModel
from ..training import TimeBudget, TrainConfig, autocast, lr_at, make_optimizer, train_step
from .baselines import LSTMLM, PlainLSTMLM, TransformerLM
from .formal import TASKS, FormalTask, TaskBatch, make_batch, sample_train_batch, scaled_accuracy, sequence_accuracy
from .registry import get_task, task_set
from .mqar import SPACINGS, VOCAB_SIZE, check_mqar_shape, mqar_batch
from ..errors import XLSTMKitError

MQAR_LR = 1e-3
"""Default peak learning rate of MQAR runs: in an H200 probe (width 128, T=256, 64 pairs) xLSTM[1:1]
reached 0.99 accuracy by step ~1300 at 1e-3 and stayed at chance for 2900 steps at 3e-3."""

MODEL_NAMES = ("xlstm[0:1]", "xlstm[1:0]", "xlstm[1:1]", "dplr", "transformer", "lstm", "lstm-plain",
               "transformer-conv")
ABLATION_MODELS = ("transformer-conv",)
"""Models for one question each, run when named only: "transformer-conv" is the Transformer with
the mLSTM block's kernel-4 causal convolution in front of q and k (MQAR: is that what its lookup
lacks?)."""
DEFAULT_MODELS = tuple(m for m in MODEL_NAMES if m not in ABLATION_MODELS)
"""The models of a sweep that names none."""
_XLSTM = re.compile(r"^xlstm\[(\d+):(\d+)\]$")
RESULTS_TABLE = "table.md"
RESULTS_PLOT = "heatmap.png"
RESULTS_ALL = "results.json"
COMMAND_FILE = "command.txt"


def check_model_name(name: str) -> str:
    """The canonical model name (lower case, no spaces); ValueError listing the known names."""
    key = str(name).strip().lower().replace(" ", "")
    if key not in MODEL_NAMES:
        raise XLSTMKitError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return key


SLSTM_PRESETS: dict[str, dict[str, Any]] = {
    "lm": dict(conv_kernel_size=4, recurrent_init="zeros", bias_init="powerlaw_blockdependent", heads=None),
    "paper": dict(conv_kernel_size=0, recurrent_init="standard", bias_init="standard", heads=1),
}
"""sLSTM block settings of the experiments. "lm": the language-model blocks (kernel-4 convolution
in front of the i/f gates, zero recurrent weights, power-law forget bias, n_heads heads).
"paper": the paper's formal-language sLSTM (official parity configuration): no convolution,
the official "standard" init (recurrent weights and all gate biases uniform(+-1/sqrt(d_model))),
one head. In an H200 probe only this combination let xLSTM[1:1] extrapolate parity (issue 19)."""


def _paper_slstm_blocks(model: XLSTMLanguageModel, preset: dict[str, Any], backend: str | None) -> None:
    # The preset is an experiment choice, not an XLSTMConfig field: swap the sLSTM layers in place.
    from ..layers.slstm import SLSTMBlock, SLSTMLayer

    cfg = model.config
    for index, block in enumerate(model.blocks):
        if isinstance(block, SLSTMBlock):
            block.layer = SLSTMLayer(
                cfg.d_model, cfg.slstm_num_heads, conv_kernel_size=preset["conv_kernel_size"], block_index=index,
                n_blocks=cfg.n_blocks, dropout=cfg.dropout, backend=backend,
                recurrent_init=preset["recurrent_init"], bias_init=preset["bias_init"],
            )


def build_model(name: str, vocab_size: int, *, d_model: int = 128, n_heads: int = 4,
                n_blocks: int = 2, backend: str | None = None, slstm: str = "lm") -> nn.Module:
    """A model called `name` (see MODEL_NAMES): tokens [B, T] -> logits [B, T, vocab_size].
    `slstm` names the sLSTM block settings (SLSTM_PRESETS; xLSTM models with sLSTM blocks only)."""
    key = check_model_name(name)
    if slstm not in SLSTM_PRESETS:
        raise XLSTMKitError(f"unknown sLSTM preset {slstm!r}; choose one of {', '.join(SLSTM_PRESETS)}")
    match = _XLSTM.match(key)
    if match:
        preset = SLSTM_PRESETS[slstm]
        cfg = XLSTMConfig(vocab_size=vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                          slstm_at=f"{match[1]}:{match[2]}", slstm_heads=preset["heads"], backend=backend)
        model = XLSTMLanguageModel(cfg)
        if slstm != "lm":
            _paper_slstm_blocks(model, preset, backend)
        return model
    if key == "dplr":  # every block a KDA-style DPLR block (xlstm_kit.nn.dplr)
        cfg = XLSTMConfig(vocab_size=vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                          dplr_at=list(range(n_blocks)), backend=backend)
        return XLSTMLanguageModel(cfg)
    if key in ("transformer", "transformer-conv"):
        return TransformerLM(vocab_size, d_model=d_model, n_blocks=n_blocks, n_heads=n_heads,
                             qk_conv=4 if key == "transformer-conv" else 0)
    if key == "lstm-plain":
        return PlainLSTMLM(vocab_size, d_model=d_model, n_layers=n_blocks)
    return LSTMLM(vocab_size, d_model=d_model, n_blocks=n_blocks)


def model_slug(name: str) -> str:
    """File-name form of a model name: "xlstm[1:0]" -> "xlstm-1-0"."""
    return re.sub(r"[^a-z0-9]+", "-", check_model_name(name)).strip("-")


# =============================================================================================
# Configuration
# =============================================================================================
@dataclass
class RunConfig:
    """Settings of one synthetic-task run (saved in its results file)."""

    steps: int = 20000
    """Most optimizer steps; a time limit may shorten the run (the schedule then fits the steps run)."""
    time_limit_s: float | None = None
    """Wall-clock budget for training plus evaluation (None: run all `steps`)."""
    batch_size: int = 128
    lr: float = 3e-3
    """Peak learning rate. Formal tasks: 3e-3 (H200 probe, width 128: xLSTM[0:1] learned parity by
    step 2000 at 3e-3, by step 3500 at 1e-3). MQAR runs of the CLI default to MQAR_LR instead."""
    min_lr: float = 3e-4
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (the paper's synthetic runs: (0.9, 0.99))."""
    grad_clip: float = 1.0
    d_model: int = 128
    n_heads: int = 4
    n_blocks: int = 2
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"
    """"fp32" or "bf16" (autocast; see xlstm_kit.train.autocast)."""
    backend: str | None = None
    """xLSTM ops backend: None (the fastest for the device), "torch" or "triton"."""
    slstm: str = "lm"
    """sLSTM block settings (SLSTM_PRESETS): "lm" or "paper" (no conv, standard init, 1 head)."""
    tasks: str = "small"
    """Formal task set (formal.TASK_VARIANTS): "small" vocabularies or the "paper"'s."""
    teacher_forcing: bool = True
    """Formal tasks: False is the paper's format (outputs at PAD positions after the action marker)."""
    train_lengths: tuple[int, int] = (3, 40)
    """Formal tasks: inclusive range of training input lengths."""
    test_lengths: tuple[int, ...] = tuple(range(41, 257))
    """Formal tasks: input lengths evaluated (the scaled accuracy averages over them)."""
    eval_samples: int = 8
    """Formal tasks: test sequences per test length. MQAR: test sequences = 64 x this."""
    eval_batch_size: int = 256
    mqar_seq_len: int = 256
    mqar_pairs: int = 64
    mqar_vocab: int = VOCAB_SIZE
    mqar_spacing: str = "uniform"
    """MQAR query placement (mqar.SPACINGS): "uniform" or Zoology's "powerlaw"."""
    mqar_train_mix: bool = True
    """MQAR training batches: True draws the pairs from 4, 8, ... up to mqar_pairs; False trains
    at mqar_pairs only (the paper's per-setting runs)."""
    log_every: int = 25
    """Record the training loss every this many steps."""
    converged_loss: float | None = None
    """Stop training once CONVERGED_LOGS logged losses in a row are below this (None: train all
    `steps`). For tasks whose test sequences come from the training distribution (MQAR, with
    fresh batches every step), a training loss this low means the test accuracy is reached; the
    formal tasks are scored on longer inputs than they train on, so they keep training."""
    compile: bool | str = False
    """Train through a compiled step: torch.compile of the forward and the loss (the backward
    through AOTAutograd), Inductor with CUDA graphs on CUDA (xlstm_kit.compiling.CompiledLoss);
    the optimizer stays eager. True, False, or "auto": compile on CUDA only (the paper
    protocol's setting; on a CPU, Inductor's C++ builds cost minutes per model). Evaluation
    runs eagerly either way."""

    def __post_init__(self) -> None:
        self.train_lengths = tuple(int(v) for v in self.train_lengths)
        self.test_lengths = tuple(int(v) for v in self.test_lengths)
        self.betas = tuple(float(b) for b in self.betas)
        for name in ("steps", "batch_size", "d_model", "n_heads", "n_blocks", "eval_samples",
                     "eval_batch_size", "log_every"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise XLSTMKitError(f"RunConfig.{name} must be a positive integer, got {v!r}")
        if self.converged_loss is not None and not self.converged_loss > 0:
            raise XLSTMKitError(f"RunConfig.converged_loss must be positive or None, got {self.converged_loss}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise XLSTMKitError(f"RunConfig.time_limit_s must be positive or None, got {self.time_limit_s}")
        if not (0 < self.lr and 0 <= self.min_lr <= self.lr):
            raise XLSTMKitError(f"need 0 < lr and 0 <= min_lr <= lr, got lr={self.lr}, min_lr={self.min_lr}")
        if self.backend not in (None, "torch", "triton"):
            raise XLSTMKitError(f"RunConfig.backend must be None, 'torch' or 'triton', got {self.backend!r}")
        task_set(self.tasks)  # checks the name
        if self.slstm not in SLSTM_PRESETS:
            raise XLSTMKitError(f"RunConfig.slstm must be one of {', '.join(SLSTM_PRESETS)}, got {self.slstm!r}")
        if not (isinstance(self.compile, bool) or self.compile == "auto"):
            raise XLSTMKitError(f"RunConfig.compile must be True, False or 'auto', got {self.compile!r}")
        if self.precision not in ("fp32", "bf16"):
            raise XLSTMKitError(f"RunConfig.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        lo, hi = self.train_lengths if len(self.train_lengths) == 2 else (0, -1)
        if not 2 <= lo <= hi:
            raise XLSTMKitError(f"RunConfig.train_lengths must be (lo, hi) with 2 <= lo <= hi, got {self.train_lengths}")
        if not self.test_lengths or min(self.test_lengths) < 2:
            raise XLSTMKitError(f"RunConfig.test_lengths must be lengths >= 2, got {self.test_lengths}")
        check_mqar_shape(self.mqar_seq_len, self.mqar_pairs, self.mqar_vocab)
        if self.mqar_spacing not in SPACINGS:
            raise XLSTMKitError(f"RunConfig.mqar_spacing must be one of {', '.join(SPACINGS)}, got {self.mqar_spacing!r}")

    @property
    def compiles(self) -> bool:
        """Whether the training step runs compiled on this config's device."""
        return self.compile is True or (self.compile == "auto" and torch.device(self.device).type == "cuda")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train_lengths"], d["test_lengths"] = list(self.train_lengths), list(self.test_lengths)
        d["betas"] = list(self.betas)
        return d


def quick_config(**overrides) -> RunConfig:
    """A CPU smoke-test configuration: tiny widths, few steps, few short test lengths."""
    base = dict(steps=30, batch_size=8, lr=3e-3, min_lr=3e-4, warmup_steps=3, d_model=32, n_heads=4,
                train_lengths=(3, 8), test_lengths=(9, 12), eval_samples=2, eval_batch_size=8,
                mqar_seq_len=64, mqar_pairs=4, mqar_vocab=256, log_every=1)
    return RunConfig(**{**base, **overrides})


# =============================================================================================
# Training and evaluation
# =============================================================================================
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
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "numpy_rng": rng.bit_generator.state,
                "torch_rng": torch.get_rng_state(), "step": step, "steps": sched.steps,
                "warmup_steps": sched.warmup_steps, "losses": log.losses, "seconds": seconds}, tmp)
    os.replace(tmp, path)  # a run killed while saving keeps the previous checkpoint
    # the losses so far also in a small text file next to it: the checkpoint (model, optimizer)
    # is too big to bring back from a lent machine, and a run lost with it keeps its curve
    _write_progress(progress_path(path), {"steps_done": step, "planned_steps": sched.steps,
                                          "seconds": round(seconds, 1), "losses": log.losses})


def _write_progress(path: Path, curve: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(curve))
    os.replace(tmp, path)


def progress_path(checkpoint: str | Path) -> Path:
    """The JSON file (steps_done, planned_steps, seconds, losses) that every save of
    `checkpoint` rewrites; a finished run deletes both."""
    return Path(checkpoint).with_suffix(".progress")


def train_on_task(model: nn.Module, sample: Callable[[np.random.Generator], TaskBatch], cfg: RunConfig,
                  time_budget_s: float | None = None, progress: ProgressFn | None = None, *,
                  checkpoint: str | Path | None = None, stop_at: float | None = None) -> TrainLog:
    """Train `model` (already on cfg.device) on batches from `sample(rng)` with `train_step`.

    With `time_budget_s`, steps 6..20 (and 6..200) are timed and the schedule is cut to the
    steps that fit (the first steps carry one-time costs such as kernel compilation; with
    `cfg.compile` the compilation and any fallback happen within the first three steps, so
    they count against the budget but not as step time).
    `checkpoint`: a file that the run continues from when it exists (model, optimizer, data and
    torch random states, step, schedule, losses: the continued run equals an uninterrupted one)
    and saves to every CHECKPOINT_EVERY_S seconds. `stop_at` (a time.time() value, needs
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
    if checkpoint is not None and checkpoint.exists():
        # on the CPU: the torch RNG state must stay a CPU ByteTensor, and load_state_dict puts
        # the model and optimizer tensors on their parameters' device anyway
        ck = torch.load(checkpoint, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        rng.bit_generator.state = ck["numpy_rng"]
        torch.set_rng_state(ck["torch_rng"])
        step, log.losses, seconds_before = ck["step"], ck["losses"], ck["seconds"]
        sched = dataclasses.replace(sched, steps=ck["steps"], warmup_steps=ck["warmup_steps"])
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
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        # spawn: CUDA cannot be used in forked children
        with ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = {pool.submit(_run_one, w, progress(*w[:3]) if progress is not None else None): i
                       for i, w in enumerate(work)}
            for f in as_completed(futures):
                done(futures[f], f.result())
    write_report(results, out_dir, command=command)
    return results


def load_results(runs_dir: str | Path) -> list[dict[str, Any]]:
    """Every results file under `runs_dir` (as written by run_formal / run_mqar)."""
    return [json.loads(p.read_text()) for p in sorted(Path(runs_dir).glob("*.json"))]


def write_report(results: Sequence[dict[str, Any]], out_dir: str | Path, *, command: str | None = None) -> dict[str, Path]:
    """Write `out_dir`/results.json (summaries), table.md (scaled accuracy, models x tasks, plus
    steps and seconds per run) and heatmap.png (Figure-4 style). Returns the paths. Without
    `command`, the sweep's command saved in `out_dir`/command.txt heads the table. Without
    matplotlib the heatmap is skipped: "plot" is then None."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if command is None and (out_dir / COMMAND_FILE).exists():
        command = (out_dir / COMMAND_FILE).read_text().strip()
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
