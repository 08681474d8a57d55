"""``xlstm-kit eval DIR --tasks a,b``: lm-evaluation-harness tasks on a model, results written as
JSON beside it (atomically, and never over a file that this command did not write)."""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import sys
from pathlib import Path

from .._extras import require
from .._version import __version__
from ..errors import MissingFileError, XLSTMKitError
from ..io.checkpoint import atomic_write
from ..io.jsonfile import read_json
from .args import DTYPES, PROG, UsageError
from .common import pick_device, use_threads

# The key that marks a results file as this command's: only such a file is ever replaced.
MARK = "xlstm_kit_eval"
# A results file of ours holds every task's config besides its scores: a few MB for suites of
# dozens of tasks; the bound keeps a huge file from being read only to look for MARK.
MAX_RESULTS_BYTES = 64 << 20
_PERPLEXITY_ONLY = ("data", "seq_len", "eval_batches", "val_fraction")
_SLUG_CHARS = re.compile(r"[^A-Za-z0-9._+-]+")


def _task_names(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",")]
    if not all(names):
        raise UsageError(f"--tasks {spec!r}: give task names separated by commas, without empty ones")
    return list(dict.fromkeys(names))


def results_path(model_dir: str, tasks: list[str]) -> Path:
    """DIR/lm-eval-TASKS.json (TASKS: the names joined by "+"; a hash stands in for a long list)."""
    slug = _SLUG_CHARS.sub("_", "+".join(tasks))
    if len(slug) > 80:
        slug = slug[:60] + "-" + hashlib.sha256("+".join(tasks).encode()).hexdigest()[:12]
    return Path(model_dir) / f"lm-eval-{slug}.json"


def _check_output(path: Path, explicit: bool) -> None:
    """Refuse, before hours of evaluation, a results file that cannot be written or that this
    command did not write."""
    if path.is_dir():
        raise UsageError(f"{path} is a folder; --output names the results' JSON file")
    if not path.parent.is_dir():
        raise UsageError(f"{path}: the folder {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK):
        hint = "" if explicit else "; choose another file with --output"
        raise UsageError(f"cannot write {path}: {path.parent} is not writable{hint}")
    if path.exists() or path.is_symlink():
        try:
            ours, why = MARK in read_json(path, MAX_RESULTS_BYTES), ""
        except MissingFileError:
            ours, why = False, " (a link to nothing)"
        except XLSTMKitError as e:  # unreadable (a FIFO, a huge or deeply nested file): not ours
            ours, why = False, f" ({e})"
        if not ours:
            raise UsageError(f"{path} exists and was not written by '{PROG} eval --tasks'{why}; move it away or "
                             f"choose another file with --output")


def cmd_eval_tasks(args: argparse.Namespace) -> int:
    if args.tasks is None:
        given = [f"--{k.replace('_', '-')}" for k in ("include_path", "limit", "num_fewshot", "output")
                 if getattr(args, k) is not None]
        raise UsageError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with --tasks")
    clash = [f"--{k.replace('_', '-')}" for k in _PERPLEXITY_ONLY if getattr(args, k) is not None]
    if clash:
        raise UsageError(f"{', '.join(clash)} belong{'s' if len(clash) == 1 else ''} to the perplexity evaluation; "
                         f"leave {'it' if len(clash) == 1 else 'them'} out with --tasks")
    tasks = _task_names(args.tasks)
    require("lm_eval", "--tasks (lm-evaluation-harness)")
    from ..evaluation.harness import evaluate_tasks, task_manager

    if not Path(args.checkpoint).is_dir():
        raise UsageError(f"{args.checkpoint}: no such model folder")
    out = Path(args.output) if args.output is not None else results_path(args.checkpoint, tasks)
    _check_output(out, explicit=args.output is not None)
    manager = task_manager(tasks, args.include_path)  # unknown task names fail here, before the model loads
    device = pick_device(args.device)
    use_threads(args.threads, device)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    results = evaluate_tasks(args.checkpoint, tasks, limit=limit, num_fewshot=args.num_fewshot, manager=manager,
                             device=str(device), dtype=DTYPES.get(args.dtype), batch_size=args.batch_size or "auto")
    if results is None:  # lm-eval returns None on the ranks other than 0 of a distributed run
        return 0
    results[MARK] = {"version": __version__, "model": str(Path(args.checkpoint).resolve()), "tasks": tasks,
                     "limit": limit, "num_fewshot": args.num_fewshot, "include_path": args.include_path,
                     "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    _check_output(out, explicit=args.output is not None)  # again: a file may have appeared meanwhile
    from lm_eval.utils import handle_non_serializable, make_table

    atomic_write(out, json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    print(f"results: {out}", file=sys.stderr)
    return 0


__all__ = ["cmd_eval_tasks", "results_path", "MARK"]
