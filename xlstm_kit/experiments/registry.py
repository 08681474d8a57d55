"""The formal task sets by name: the small-vocabulary tasks of `formal` and the paper's of
`formal_paper`."""
from __future__ import annotations

from ..errors import XLSTMKitError
from .formal import TASKS, FormalTask
from .formal_paper import PAPER_TASKS

TASK_VARIANTS = ("small", "paper")
"""Task sets: "small" (TASKS: small vocabularies) and "paper" (formal_paper.PAPER_TASKS: the
paper's vocabularies and all twelve Figure 4 tasks)."""


def task_set(variant: str = "small") -> dict[str, FormalTask]:
    """The tasks of `variant` (TASK_VARIANTS) by name."""
    if variant == "small":
        return TASKS
    if variant == "paper":
        return PAPER_TASKS
    raise XLSTMKitError(f"unknown task variant {variant!r}; choose one of {', '.join(TASK_VARIANTS)}")


def get_task(name: str, variant: str = "small") -> FormalTask:
    """The task called `name` in `variant` (ValueError listing the known names otherwise)."""
    tasks = task_set(variant)
    key = str(name).strip().lower().replace("-", "_")
    if key not in tasks:
        raise XLSTMKitError(f"unknown formal task {name!r} ({variant} tasks); choose one of {', '.join(tasks)}")
    return tasks[key]
