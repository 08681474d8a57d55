"""Synthetic tasks of the xLSTM paper: formal languages (Figure 4) and multi-query associative
recall, the baseline models they are compared with, and the experiment runner."""
from .formal import TASKS, FormalTask, TaskBatch, get_task, scaled_accuracy, sequence_accuracy
from .mqar import mqar_batch

__all__ = ["TASKS", "FormalTask", "TaskBatch", "get_task", "mqar_batch", "scaled_accuracy", "sequence_accuracy"]
