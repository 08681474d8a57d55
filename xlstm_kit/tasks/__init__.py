"""Synthetic tasks of the xLSTM paper: formal languages (Figure 4) and multi-query associative
recall, the baseline models they are compared with, the experiment runner (`experiment`) and its
command line (`cli`: `xlstm-kit experiment ...`)."""
from .formal import TASKS, FormalTask, TaskBatch, get_task, scaled_accuracy, sequence_accuracy
from .mqar import mqar_batch

__all__ = ["TASKS", "FormalTask", "TaskBatch", "get_task", "mqar_batch", "scaled_accuracy", "sequence_accuracy"]
