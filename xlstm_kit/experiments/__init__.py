"""Synthetic tasks of the xLSTM paper: formal languages (Figure 4) and multi-query associative
recall, the baseline models they are compared with, the experiment runner (`experiment`) and its
command line (`cli`: `xlstm-kit experiment ...`)."""

__all__ = ["TASKS", "FormalTask", "TaskBatch", "get_task", "mqar_batch", "scaled_accuracy", "sequence_accuracy"]


def __getattr__(name: str):
    # Lazy, so that building the command line's parser (tasks.cli) does not import torch.
    if name == "mqar_batch":
        from .mqar import mqar_batch

        return mqar_batch
    if name in __all__:
        from . import formal

        return getattr(formal, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
