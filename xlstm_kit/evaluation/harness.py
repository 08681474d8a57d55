"""Run lm-evaluation-harness tasks on a model folder: what ``xlstm-kit eval DIR --tasks ...`` does."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .._extras import require
from ..errors import XLSTMKitError

__all__ = ["task_manager", "evaluate_tasks"]

FEATURE = "lm-evaluation-harness tasks"


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None):
    """lm-eval's TaskManager for `tasks`, or a one-line XLSTMKitError naming the tasks it does not
    know. When every task is found in `include_path`, lm-eval's own 14,000 task files are not
    indexed (25 s); otherwise they are, with `include_path` over them."""
    require("lm_eval", FEATURE)
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        if not Path(include_path).is_dir():
            raise XLSTMKitError(f"--include-path {include_path}: no such folder")
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(local.match_tasks([t]) for t in tasks):
            return local
    manager = TaskManager(include_path=None if include_path is None else str(include_path))
    unknown = [t for t in tasks if not manager.match_tasks([t])]
    if unknown:
        where = "lm-eval's tasks" + ("" if include_path is None else f" or {include_path}")
        raise XLSTMKitError(f"unknown task{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: not among {where} "
                            f"(list them with: lm-eval ls tasks)")
    return manager


def evaluate_tasks(model, tasks: Sequence[str], *, include_path: str | Path | None = None, limit: float | None = None,
                   num_fewshot: int | None = None, log_samples: bool = False, manager=None,
                   **model_args: Any) -> dict:
    """lm-eval's results (`lm_eval.simple_evaluate`) for `tasks` on `model`: a folder (run,
    checkpoint or HuggingFace xLSTM folder; `model_args` go to XLSTMKitLM: dtype, device,
    batch_size, ...) or an XLSTMKitLM. `manager`: a TaskManager from `task_manager` (made here
    when None)."""
    require("lm_eval", FEATURE)
    import lm_eval

    from .lm_eval_backend import XLSTMKitLM

    tasks = list(tasks)
    if not tasks:
        raise XLSTMKitError("no task given")
    manager = manager if manager is not None else task_manager(tasks, include_path)
    lm = model if isinstance(model, XLSTMKitLM) else XLSTMKitLM(pretrained=model, **model_args)
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                                   task_manager=manager, log_samples=log_samples)
