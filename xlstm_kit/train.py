"""Old path of `xlstm_kit.training` (the README's `from xlstm_kit.train import TrainConfig, train`)."""
from .training import (TimeBudget, TrainConfig, continue_schedule, evaluate, lm_loss, lr_at, make_optimizer,  # noqa: F401
                       train, train_step)
