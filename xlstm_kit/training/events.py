"""What `train` reports as it goes (StepEvent, EvalEvent, CheckpointEvent, CompileEvent) and returns
(TrainResult), and the validation metrics."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from .compiling import CompileEvent

if TYPE_CHECKING:
    from .config import TrainConfig


@dataclass
class EvalMetrics:
    """Validation figures: mean loss in nats per token, bits per UTF-8 byte, perplexity."""

    loss: float
    bits_per_byte: float
    perplexity: float
    tokens: int
    batches: int = 0
    """Validation batches used (all ranks together)."""
    split_batches: int = 0
    """Batches the whole validation split holds (batches == split_batches: all of it)."""

    def describe(self) -> str:
        """"8 of 50 batches, 16,384 tokens" or "all 50 batches, 102,400 tokens"."""
        part = (f"all {self.split_batches}" if self.batches >= self.split_batches
                else f"{self.batches} of {self.split_batches}")
        return f"{part} validation batches, {self.tokens:,} tokens"


@dataclass
class StepEvent:
    step: int  # optimizer steps completed
    total_steps: int
    loss: float  # mean training loss of this step (all ranks)
    lr: float
    grad_norm: float
    tokens_per_s: float  # global tokens of this step / its wall time


@dataclass
class EvalEvent:
    step: int
    metrics: EvalMetrics | Any  # a language model's; another workload's are its own


@dataclass
class CheckpointEvent:
    step: int
    path: Path


TrainEvent = Union[StepEvent, EvalEvent, CheckpointEvent, CompileEvent]


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    interrupted: bool
    time_limited: bool = False  # stopped by `time_limit_s` before config.steps
    losses: list[tuple[int, float]] = field(default_factory=list)  # this process's run only
    evals: list[tuple[int, EvalMetrics | Any]] = field(default_factory=list)
    checkpoint: Path | None = None
    plot: Path | None = None
    plot_note: str | None = None  # why there is no plot (matplotlib missing)
    history: list[dict[str, Any]] = field(default_factory=list)
    """The metrics rows of the whole run (those of earlier sessions too): metrics.jsonl's."""
    seconds: float = 0.0  # wall time the run trained, earlier sessions included
    config: "TrainConfig | None" = None  # the one the run ended with (its continued schedule)
    skipped_steps: int = 0  # updates skipped for a non-finite loss (TrainConfig.on_nonfinite="skip"), this call
