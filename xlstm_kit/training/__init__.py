"""Training: the configuration, the optimizer and schedule, the one training step, the one
training loop, evaluation, distributed set-up and compilation. `train` is the loop of the command
line, the Python API and the synthetic experiments (xlstm_kit.experiments.task_loop supplies its
tasks as a `Workload`); the training benchmark times `train_step` alone; checkpoints are
`xlstm_kit.io.checkpoint`'s."""
from ..io.checkpoint import (CHECKPOINTS_DIR, LATEST_FILE, TRAIN_META_FILE, TRAIN_STATE_FILE, CheckpointError,
                             load_training_state, read_train_meta, resolve_checkpoint)
from .compiling import CompileClock, CompiledLoss, compile_unavailable
from .config import METRICS_FILE, PLOT_FILE, PRECISIONS, RESUME_FROZEN, TrainConfig
from .distributed import DistInfo, init_distributed
from .evaluate import evaluate, val_batch_count
from .events import CheckpointEvent, CompileEvent, EvalEvent, EvalMetrics, StepEvent, TrainEvent, TrainResult
from .loop import RunState, TrainingDiverged, train
from .optim import continue_schedule, lr_at, make_optimizer, param_groups
from .step import NonFiniteStep, StepOutput, TimeBudget, autocast, lm_loss, train_step
from .workload import LanguageModelling, Workload

__all__ = [
    "CHECKPOINTS_DIR", "LATEST_FILE", "TRAIN_META_FILE", "TRAIN_STATE_FILE", "CheckpointError", "load_training_state",
    "read_train_meta", "resolve_checkpoint", "CompileClock", "CompiledLoss", "compile_unavailable", "METRICS_FILE",
    "PLOT_FILE", "PRECISIONS", "RESUME_FROZEN", "TrainConfig", "DistInfo", "init_distributed", "evaluate", "val_batch_count",
    "CheckpointEvent", "CompileEvent", "EvalEvent", "EvalMetrics", "StepEvent", "TrainEvent", "TrainResult", "TrainingDiverged", "train", "RunState",
    "continue_schedule", "lr_at", "make_optimizer", "param_groups", "NonFiniteStep", "StepOutput", "TimeBudget", "autocast", "lm_loss",
    "train_step", "LanguageModelling", "Workload",
]
