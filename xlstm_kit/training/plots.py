"""The metrics log (metrics.jsonl) and the loss curve (loss.png, when matplotlib is installed)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .._extras import install_hint
from ..errors import MissingFileError, XLSTMKitError
from ..io.jsonfile import describe, read_json_lines


def read_metrics(path: Path, up_to_step: int | None) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl up to step ``up_to_step`` (all: None). A last row cut short
    by a kill is dropped; any other damage (a row that is not an object with an integer step and
    numeric values, bytes that are not UTF-8 or JSON) is refused in one line rather than dropped,
    since resuming rewrites the file with the rows it read."""
    try:  # not is_file(): a FIFO or a folder of that name is refused, not taken for a run without a log
        lines = read_json_lines(path)
    except MissingFileError:
        return []
    rows = []
    for n, row in lines:
        why = _row_problem(row)
        if why:
            raise XLSTMKitError(f"{path} line {n} is not a metrics row ({why}); repair or remove the file, "
                                f"then resume")
        if up_to_step is None or row["step"] <= up_to_step:
            rows.append(row)
    return rows


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"{describe(row)}, not an object"
    step = row.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step is {describe(step) if not isinstance(step, int) else step}"
    for key, value in row.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"{key} is {describe(value)}, not a number"
    return None


PLOT_MISSING_NOTE = f"loss plot skipped: matplotlib is not installed ({install_hint('matplotlib')})"


def plot_loss_curve(rows: Iterable[dict[str, Any]], path: Path) -> Path:
    """Write the training (raw and smoothed) and validation loss against step as a PNG.

    ImportError when matplotlib is not installed (``train`` then records PLOT_MISSING_NOTE)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(rows)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        s, l = map(np.asarray, zip(*train))
        ax.plot(s, l, color="tab:blue", alpha=0.25, lw=0.8)
        # Exponential moving average over about 2% of the run, so short and long runs both
        # get a curve that follows the loss without lagging far behind it.
        beta = min(0.98, 1.0 - 1.0 / max(1.0, len(l) / 50))
        smooth, acc = np.empty_like(l), l[0]
        for j, v in enumerate(l):
            acc = beta * acc + (1 - beta) * v if j else v
            smooth[j] = acc
        ax.plot(s, smooth, color="tab:blue", lw=1.5, label="train (smoothed)")
    if val:
        s, l = map(np.asarray, zip(*val))
        ax.plot(s, l, "o-", color="tab:orange", lw=1.5, ms=4, label="validation")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)
    return path
