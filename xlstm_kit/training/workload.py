"""What a training run trains on: the :class:`Workload` that :func:`xlstm_kit.training.train` runs
its one loop around, and the language-model workload (token data, next-token loss, validation
loss and bits per byte). The synthetic experiments supply their own
(xlstm_kit.experiments.task_loop: a task's batches, its masked loss, its accuracy)."""
from __future__ import annotations

import abc
import inspect
from typing import Any, Iterable

import torch
from torch import nn

from ..errors import XLSTMKitError
from .config import TrainConfig
from .data import BatchSampler, TokenData
from .distributed import DistInfo
from .evaluate import evaluate
from .packing import PackedSampler
from .step import StepOutput, lm_loss, train_step


class Workload(abc.ABC):
    """The batches, the step and the checks of a training run; the loop (schedule, stopping,
    checkpoints, resume, the metrics log) is :func:`xlstm_kit.training.train`'s.

    A subclass gives :meth:`batches`; it may override the rest. Its :meth:`state_dict` goes into
    every checkpoint and comes back through :meth:`load_state_dict` on resume, so that a resumed
    run reads the batches the uninterrupted run would have read.
    """

    compiles = False
    """Whether :meth:`step` compiles on its first calls (their extra time is then reported)."""
    stops_on_nonfinite = True
    """A NaN or infinite loss stops the run (TrainingDiverged) before it updates the weights."""

    @abc.abstractmethod
    def batches(self, step: int) -> Iterable[tuple[Any, Any]]:
        """This rank's (inputs, target) micro-batches of optimizer step ``step`` (0-based), on the device."""

    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: Iterable[tuple[Any, Any]],
             **kw: Any) -> StepOutput:
        """One optimizer step (``kw``: train_step's lr, n_micro, precision, grad_clip,
        before_update, check_finite)."""
        return train_step(model, optimizer, micro_batches, lm_loss, **kw)

    def validate(self) -> tuple[Any, dict[str, Any]] | None:
        """(metrics, the row they add to metrics.jsonl) of the model as it stands; None: the
        workload has no validation."""
        return None

    # `run`: the loop's RunState (xlstm_kit.training.loop), which imports this module
    def start(self, run: Any) -> None:
        """Called once the run is set up (restored on resume), before its first step."""

    def after_step(self, run: Any) -> str | None:
        """Called after every step, once its loss is logged if it is: None to go on, "end" when
        the run is complete at this step, "pause" to stop here saving a checkpoint that a resume
        continues. It may set ``run.config`` (the schedule from the next step on)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class LanguageModelling(Workload):
    """Next-token prediction on ``data``: windows of ``config.seq_len`` tokens in an order fixed
    by the seed and the step (no state to save), packed documents where the data have them and
    the model takes ``cu_seqlens``; validation loss, bits per byte and perplexity."""

    def __init__(self, model: nn.Module, data: TokenData, config: TrainConfig, dist: DistInfo,
                 device: torch.device) -> None:
        vocab = getattr(getattr(model, "config", None), "vocab_size", None)
        if vocab is not None and vocab < data.vocab_size:
            raise XLSTMKitError(f"model vocab_size {vocab} is smaller than the tokenizer's {data.vocab_size}")
        self.model, self.data, self.config, self.dist, self.device = model, data, config, dist, device
        self.token_bytes = data.tokenizer.token_byte_lengths()
        self.packed = config.pack if config.pack is not None else (
            data.train_docs is not None and "cu_seqlens" in inspect.signature(model.forward).parameters)
        if self.packed and data.train_docs is None:
            raise XLSTMKitError(f"pack=True needs data with documents (several files, or an EOS token in "
                                f"the text, loaded with documents=True); {data.source!r} has none")
        self.sampler = (PackedSampler(data.train, data.train_docs, config.seq_len, config.batch_size, seed=config.seed)
                        if self.packed else BatchSampler(data.train, config.seq_len, config.batch_size, seed=config.seed))

    def batches(self, step: int) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
        n = self.config.grad_accum
        for micro in range(n):
            x, y = self.sampler.batch(step, rank=self.dist.rank, world_size=self.dist.world_size,
                                      micro=micro, n_micro=n)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def validate(self) -> tuple[Any, dict[str, Any]]:
        c = self.config
        m = evaluate(self.model, self.data.val, seq_len=c.seq_len, batch_size=c.batch_size,
                     max_batches=c.eval_batches or None, token_bytes=self.token_bytes, device=self.device,
                     precision=c.precision, dist=self.dist, doc_starts=self.data.val_docs if self.packed else None)
        return m, {"val_loss": m.loss, "val_bpb": m.bits_per_byte, "val_ppl": m.perplexity,
                   "val_batches": m.batches, "val_tokens": m.tokens}
