"""Checkpoints on disk: the model format (xlstm_kit.io.model_files, re-exported here), the
training state, run folders and crash-safe writes.

A **model checkpoint** is a folder with ``config.json`` (the model config's fields),
``model.safetensors`` (no pickle) and ``checksums.json`` (the SHA-256 of the weights, and in a
training checkpoint of ``train_state.pt``, verified on load; older checkpoints without it still
load), plus ``tokenizer.json`` (``{"name": "byte"}``) when the tokenizer is known. Loading
refuses (CheckpointError, one line) a checksum mismatch, integer or boolean tensors for float
parameters, NaN/Inf weights, and a config whose shapes do not fit the file (checked before
anything is allocated). Saves are atomic, also over an existing model (the old model or the new
one, never a mix), and touch no file xlstm_kit did not write: see xlstm_kit.io.files, whose
manifest ``.xlstm-kit-files.json`` every model folder, training checkpoint and run folder holds.

A **training run folder** (``train --out``)::

    latest                      one line: checkpoints/<name> of the newest complete checkpoint
                                (nothing else is followed)
    checkpoints/step-00000030/  a model checkpoint + train_state.pt (optimizer, step, RNG)
                                + train_meta.json (format, step, train config, tokenizer, data)
    .xlstm-kit-files.json       the run's files xlstm_kit writes (latest, metrics log, loss plot)

A training checkpoint is written into a hidden staging folder, flushed to disk, renamed into
place, and only then does ``latest`` (replaced atomically) point at it: a crash or kill at any
moment leaves ``latest`` naming a complete checkpoint. An FSDP run's checkpoints hold its weights
and optimizer state as shards written by every rank (xlstm_kit.io.sharded), committed the same way. Pruning and clearing a run remove only
checkpoint folders that hold nothing but files of ours (:func:`is_our_checkpoint`); a run
refuses to start over a ``latest``, metrics log or plot that xlstm_kit did not write
(:func:`claim_run_files`).

This module knows no model class: it writes any model with ``.config.to_dict()`` and reads
tensors + config dicts; ``XLSTMLanguageModel.save/load`` build on it (model.py imports this
module, never the reverse).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from .._version import __version__
from ..errors import MissingFileError, XLSTMKitError
# the crash-safe writes and the manifest (xlstm_kit.io.files) are part of this module's API too
from .files import (MANIFEST_FILE, _make_hidden_dir, _umask, atomic_write, claim, fsync_dir,  # noqa: F401
                    fsync_tree, manifest_bytes, not_ours, owned_files, save_folder, write_manifest)
from .locking import RUN_LOCK_FILE, RunLocked, run_lock  # noqa: F401 - part of this module's API
from .jsonfile import (MAX_CONFIG_BYTES, MAX_META_BYTES, MAX_TOKENIZER_BYTES, checked_path, describe, open_regular,
                       read_bytes, read_json, regular_file_exists)
from .paths import check_writable

# the model checkpoint format (xlstm_kit.io.model_files) is part of this module's API too
from .model_files import (  # noqa: F401
    ADAPTER_CONFIG_FILE, CHECKPOINTS_DIR, CHECKPOINT_FORMAT, CHECKSUMS_FILE, CONFIG_FILE, CheckpointError, LATEST_FILE, MAX_CHECKSUMS_BYTES, STAGING_NAME_BYTES, TOKENIZER_FILE, TRAIN_META_FILE, TRAIN_STATE_FILE, WEIGHTS_FILE, _file_sha256, _write_checksums, _write_model_files, check_state, load_state_checked, read_model_files, read_tokenizer_name, save_model, verify_checksum)
from .model_files import SHARDED_INDEX_FILE, is_sharded  # noqa: F401


# --------------------------------------------------------------------------------------------
# Run folders and training checkpoints
# --------------------------------------------------------------------------------------------


_LATEST_TARGET = re.compile(re.escape(CHECKPOINTS_DIR) + r"/step-\d+(-\d+)?")
_MAX_LATEST_BYTES = 4096  # "checkpoints/step-NNNNNNNN" and a newline


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder a path names: a checkpoint itself (has ``config.json`` or
    ``model.safetensors``) or a training output folder (through its ``latest`` file)."""
    path = Path(path)
    # not is_file(): a FIFO or a folder at one of these names is refused, not passed over for the
    # next way to find a checkpoint (and then "holds no checkpoint")
    if any(regular_file_exists(path / name, CheckpointError) for name in (CONFIG_FILE, WEIGHTS_FILE)):
        return path
    latest = path / LATEST_FILE
    if regular_file_exists(latest, CheckpointError):
        try:  # a file of one short line: bounded, and refused when swapped for a FIFO
            rel = read_bytes(latest, _MAX_LATEST_BYTES, CheckpointError).decode().strip()
        except UnicodeDecodeError as e:
            raise CheckpointError(f"cannot read {latest}: {e}") from None
        # `latest` only ever names checkpoints/<step folder>; anything else (an absolute path,
        # "..") would make load or resume read a folder outside the run.
        if not _LATEST_TARGET.fullmatch(rel):
            raise CheckpointError(f"{latest} names {rel[:100]!r}, not a checkpoint folder of this run "
                                  f"({CHECKPOINTS_DIR}/step-NNNNNNNN)")
        target = path / rel
        if not target.is_dir():
            raise CheckpointError(f"{latest} points to a missing checkpoint {target}")
        return target
    if not path.exists():
        raise CheckpointError(f"checkpoint path {str(path)!r} does not exist")
    raise CheckpointError(f"{str(path)!r} holds no checkpoint (no config.json and no '{LATEST_FILE}' file)")


def read_train_meta(checkpoint: str | Path) -> dict[str, Any]:
    """The ``train_meta.json`` of a checkpoint ({} for a bare model checkpoint); refuses a
    checkpoint written by an incompatible version of the training code."""
    f = Path(checkpoint) / TRAIN_META_FILE
    try:  # a FIFO or a folder of that name is refused, not taken for a bare model checkpoint
        meta = read_json(f, MAX_META_BYTES, error=CheckpointError)
    except MissingFileError:
        return {}
    fmt = meta.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {checkpoint} has training-state format {fmt!r} (written by xlstm_kit "
            f"{meta.get('xlstm_kit_version', '?')}); this version reads format {CHECKPOINT_FORMAT}"
        )
    step = meta.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise CheckpointError(f"{f} is corrupt: step is {step!r}, not a non-negative integer")
    for key, types in _META_TYPES.items():
        if key in meta and not isinstance(meta[key], types) or isinstance(meta.get(key), bool) and bool not in types:
            raise CheckpointError(f"{f} is corrupt: {key} is {describe(meta[key])}")
    return meta


# What the command line and resume read from train_meta.json besides format and step (absent or
# null: unknown).
_META_TYPES: dict[str, tuple[type, ...]] = {
    "train_config": (dict,), "preset": (str, type(None)), "data": (str,), "tokenizer": (str, type(None)),
    "val_fraction": (int, float), "init_from": (str, type(None)), "demo": (bool,),
}


def load_training_state(checkpoint: str | Path) -> dict[str, Any]:
    """The ``train_state.pt`` of a checkpoint (tensors and plain containers only)."""
    f = Path(checkpoint) / TRAIN_STATE_FILE
    # read from the descriptor that was checked: a FIFO or a folder of that name is refused as
    # such (is_file took it for a model checkpoint's missing file), and one put there later
    # cannot block torch.load's open of the name
    try:
        handle = open_regular(f, CheckpointError)
    except MissingFileError:
        raise CheckpointError(f"{checkpoint} has no {TRAIN_STATE_FILE}: it is a model checkpoint, not resumable") from None
    with handle:
        verify_checksum(checkpoint, TRAIN_STATE_FILE)
        try:
            state = torch.load(handle, map_location="cpu", weights_only=True)
        except Exception as e:  # corrupt or foreign file
            raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{f} has an unsupported format; this version reads format {CHECKPOINT_FORMAT}")
    problem = _train_state_problem(state)
    if problem:
        raise CheckpointError(f"{f} is corrupt: {problem}")
    return state


# Fields of the saved TrainConfig that resume and the command line read before building one.
_TRAIN_CONFIG_INTS = ("steps", "batch_size", "seq_len", "grad_accum", "seed")


def _train_state_problem(state: dict[str, Any]) -> str | None:
    """What is wrong with a loaded train_state.pt's structure, or None (the optimizer's tensors
    are checked against the model by :func:`load_optimizer_state`)."""
    step = state.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step is {step!r}, not a non-negative integer"
    opt = state.get("optimizer")
    if state.get("sharded") is True:
        pass  # the optimizer state is in the checkpoint's shards
    elif not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        return "the optimizer state is missing or malformed"
    cfg = state.get("train_config")
    if not isinstance(cfg, dict):
        return "train_config is missing"
    for key in _TRAIN_CONFIG_INTS:
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, int) or (key != "seed" and v < 1):
            return f"train_config.{key} is {v!r}"
    if step > cfg["steps"]:  # a run saves at most at its last step
        return f"step {step} is past the run's {cfg['steps']} steps"
    rng = state.get("rng")
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) \
            or rng["torch"].dtype != torch.uint8 or not isinstance(rng.get("cuda"), (list, tuple)) \
            or not all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in rng["cuda"]):
        return "the RNG state is missing or malformed"
    return None


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], source: str | Path) -> None:
    """``optimizer.load_state_dict(saved)``, refusing (CheckpointError) state whose groups or
    per-parameter tensors do not fit the optimizer's parameters: torch would accept moment
    tensors of the wrong shape and fail inside the next step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise CheckpointError(f"{source}: the optimizer state has {len(groups)} parameter groups, "
                              f"the model's optimizer {len(optimizer.param_groups)}")
    for mine, theirs in zip(optimizer.param_groups, groups):
        for key, value in mine.items():  # numeric hyperparameters the next step reads
            v = theirs.get(key, value)
            if isinstance(value, bool) or value is None or key == "params":
                continue  # flags (fused, foreach, ...) may differ between devices; torch reconciles them
            numbers = v if isinstance(value, tuple) and isinstance(v, (tuple, list)) else (v,)
            if (type(v) is not type(value) and not (isinstance(value, (int, float)) and isinstance(v, (int, float)))) \
                    or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in numbers) \
                    or (isinstance(value, tuple) and len(v) != len(value)):
                raise CheckpointError(f"{source}: optimizer hyperparameter {key} is {v!r}")
            if (key in ("lr", "weight_decay") and v < 0) or (key == "eps" and not v > 0) \
                    or (key == "betas" and not all(0 <= b < 1 for b in v)):
                raise CheckpointError(f"{source}: optimizer hyperparameter {key} is {v!r}, out of range")
    # torch numbers the parameters 0, 1, ... through the groups in order
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups] \
            or [i for g in groups for i in g["params"]] != list(range(len(params))):
        raise CheckpointError(f"{source}: the optimizer state does not list the model's parameters")
    for key, per_param in saved["state"].items():
        if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < len(params) \
                or not isinstance(per_param, dict):
            raise CheckpointError(f"{source}: optimizer state entry {key!r} names no parameter")
        p = params[key]
        for name, t in per_param.items():
            if not isinstance(t, torch.Tensor):
                continue
            if t.ndim and t.shape != p.shape:
                raise CheckpointError(f"{source}: optimizer {name} of parameter {key} has shape "
                                      f"{list(t.shape)}, the parameter {list(p.shape)}")
            if not t.dtype.is_floating_point or not bool(torch.isfinite(t).all()):
                raise CheckpointError(f"{source}: optimizer {name} of parameter {key} is not finite floating point")
    try:
        optimizer.load_state_dict(saved)
    except (ValueError, KeyError, TypeError, RuntimeError) as e:
        raise CheckpointError(f"{source}: the optimizer state does not fit: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def _save_any_model(model: nn.Module, path: Path, tokenizer: str | None) -> list[str]:
    """Model files into the (new, empty) staging folder ``path``: written in place, without
    save_model's own temporary folder, which a kill would leave beside the staging one. Returns
    their names."""
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):
        return _write_model_files(model, path, tokenizer)
    # any other language model: weights only
    safetensors.torch.save_model(model, str(path / WEIGHTS_FILE))
    os.chmod(path / WEIGHTS_FILE, 0o666 & ~_umask())
    return [WEIGHTS_FILE]


def load_weights_into(model: nn.Module, checkpoint: Path) -> None:
    """Load a checkpoint's weights into ``model``, refusing one of another configuration."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        weights = checkpoint / WEIGHTS_FILE
        # a folder or a device there would be a bare OSError from safetensors, a FIFO a hang
        # (its open holds the GIL), and an absent file is this message rather than checked_path's
        if not regular_file_exists(weights, CheckpointError):
            raise MissingFileError(f"checkpoint {checkpoint} has no {WEIGHTS_FILE}")
        verify_checksum(checkpoint, WEIGHTS_FILE)
        with checked_path(weights, CheckpointError) as opened:  # the name may be a FIFO by now
            try:
                safetensors.torch.load_model(model, opened)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{weights} is not a readable safetensors file ({e})") from None
            except RuntimeError as e:  # missing or unexpected keys, other shapes: torch's many lines
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"{weights} holds weights of another model ({first})") from None
        return
    saved, tensors = read_model_files(checkpoint)
    try:
        same = type(config).from_dict(saved) == config
    except (ValueError, TypeError):
        same = False
    if not same:
        raise CheckpointError(f"checkpoint {checkpoint} holds a model of another configuration than the one being trained")
    load_state_checked(model, tensors, checkpoint / WEIGHTS_FILE)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def restore_rng(state: dict[str, Any], device: torch.device, source: str | Path = "the checkpoint") -> None:
    """Set torch's generators from a training state; CheckpointError (generators unchanged)
    when torch refuses the saved values."""
    before = _rng_state()
    try:
        torch.set_rng_state(state["rng"]["torch"])
        if device.type == "cuda" and state["rng"]["cuda"]:
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
    except (RuntimeError, ValueError, TypeError, KeyError) as e:
        torch.set_rng_state(before["torch"])
        if before["cuda"]:
            torch.cuda.set_rng_state_all(before["cuda"])
        raise CheckpointError(f"{source}: the RNG state is invalid: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def save_checkpoint(
    out_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write a complete resumable checkpoint of ``step`` atomically and point ``latest`` at it.

    ``config`` is the TrainConfig (anything with ``to_dict()``). Returns the checkpoint folder.
    ``meta`` (JSON-serialisable; e.g. tokenizer and data spec) is stored in ``train_meta.json``;
    its "tokenizer" also goes to ``tokenizer.json``. ``extra`` (tensors and plain containers)
    goes into ``train_state.pt`` beside the optimizer, for the training loop's own state (its
    training time, its workload's sampler state). Older checkpoints beyond ``keep`` are removed
    afterwards (only folders that are checkpoints of ours, as their manifest shows). A ``latest``
    that xlstm_kit did not write is refused, before anything is written.
    """
    root, final, staging = _start_checkpoint(Path(out_dir), step)
    try:
        names = _save_any_model(model, staging, (meta or {}).get("tokenizer") or getattr(model, "tokenizer_name", None))
        names += _write_train_files(staging, step, config, meta, extra, {"optimizer": optimizer.state_dict()},
                                    [WEIGHTS_FILE, TRAIN_STATE_FILE])
        return _commit_checkpoint(Path(out_dir), root, staging, final, names, keep)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _start_checkpoint(out_dir: Path, step: int) -> tuple[Path, Path, Path]:
    """(checkpoints folder, the new checkpoint's final path, its new staging folder)."""
    claim_run_files(out_dir, ())
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final, k = root / name, 1
    while final.exists():  # re-saving a step (resume then interrupt): never touch the old one
        final, k = root / f"{name}-{k}", k + 1
    return root, final, _make_hidden_dir(root, f".tmp-{name}-")


def _write_train_files(staging: Path, step: int, config, meta, extra, state: dict[str, Any],
                       checksummed: list[str], known: dict[str, str] | None = None) -> list[str]:
    state = {"format": CHECKPOINT_FORMAT, "step": step, **state, "train_config": config.to_dict(),
             "rng": _rng_state(), **({"extra": extra} if extra else {})}
    torch.save(state, staging / TRAIN_STATE_FILE)
    _write_checksums(staging, checksummed, known)
    info = {"format": CHECKPOINT_FORMAT, "xlstm_kit_version": __version__, "step": step,
            "train_config": config.to_dict(), **(meta or {})}
    (staging / TRAIN_META_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return [CHECKSUMS_FILE, TRAIN_STATE_FILE, TRAIN_META_FILE]


def _commit_checkpoint(out_dir: Path, root: Path, staging: Path, final: Path, names: list[str], keep: int) -> Path:
    """Flush the complete staging folder, rename it into place, then point ``latest`` at it:
    until that rename a kill leaves ``latest`` on the previous checkpoint."""
    (staging / MANIFEST_FILE).write_bytes(manifest_bytes(sorted(set(names))))
    fsync_tree(staging)
    os.rename(staging, final)
    fsync_dir(root)
    atomic_write(out_dir / LATEST_FILE, f"{CHECKPOINTS_DIR}/{final.name}\n")
    fsync_dir(out_dir)
    _prune_checkpoints(root, keep, final)
    return final


_CHECKPOINT_NAME = re.compile(r"step-(\d+)(?:-(\d+))?")  # step-00000030, or step-00000030-1 for a re-save
# The files of a training checkpoint written before manifests existed.
_LEGACY_CHECKPOINT_FILES = {CONFIG_FILE, WEIGHTS_FILE, CHECKSUMS_FILE, TOKENIZER_FILE, "tokenizer_config.json",
                            TRAIN_STATE_FILE, TRAIN_META_FILE}


def is_our_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a training checkpoint of ours and nothing else, so that removing
    it (pruning, clearing a run) deletes nothing xlstm_kit did not write: every file in it is
    listed by its manifest, or (checkpoints written before manifests existed) has a checkpoint
    file's name beside a train_meta.json that xlstm_kit wrote."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    entries = set(os.listdir(folder))
    if not all((folder / n).is_file() and not (folder / n).is_symlink() for n in entries):
        return False
    if MANIFEST_FILE in entries:
        return entries <= owned_files(folder) | {MANIFEST_FILE}
    if not entries <= _LEGACY_CHECKPOINT_FILES or TRAIN_META_FILE not in entries:
        return False
    try:
        meta = read_json(folder / TRAIN_META_FILE, MAX_META_BYTES)
    except XLSTMKitError:
        return False
    return isinstance(meta, dict) and "xlstm_kit_version" in meta and meta.get("format") == CHECKPOINT_FORMAT


def _our_checkpoints(root: Path) -> list[Path]:
    """The training checkpoints of ours in ``root``, oldest first."""
    found = []
    for p in root.iterdir() if root.is_dir() and not root.is_symlink() else ():
        m = _CHECKPOINT_NAME.fullmatch(p.name)
        if m and is_our_checkpoint(p):
            found.append(((int(m[1]), int(m[2] or 0)), p))
    return [p for _, p in sorted(found)]


def _remove_checkpoint(folder: Path) -> None:
    # renamed to a staging name first, so that it vanishes whole; a kill before the removal
    # ends leaves a temporary that remove_stale_staging deletes
    step = _CHECKPOINT_NAME.fullmatch(folder.name)[1]
    trash = folder.parent / f".tmp-step-{step}-{secrets.token_hex(6)}"
    try:
        os.rename(folder, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _prune_checkpoints(root: Path, keep: int, latest: Path) -> None:
    for p in _our_checkpoints(root)[:-keep]:
        if p != latest:
            _remove_checkpoint(p)


def _legacy_run(out_dir: Path) -> bool:
    """A run folder written before manifests existed: no manifest, and its ``latest`` names a
    checkpoint of it."""
    f = out_dir / LATEST_FILE
    if os.path.lexists(out_dir / MANIFEST_FILE):
        return False
    try:
        rel = read_bytes(f, _MAX_LATEST_BYTES).decode().strip() if f.is_file() and not f.is_symlink() else ""
    except (XLSTMKitError, UnicodeDecodeError):
        return False
    return bool(_LATEST_TARGET.fullmatch(rel)) and (out_dir / rel / TRAIN_META_FILE).is_file()


def claim_run_files(out_dir: str | Path, names) -> None:
    """Before a run writes ``latest`` and ``names`` (e.g. its metrics log and loss plot) into the
    run folder ``out_dir``: refuse (one line, nothing written) when one exists that xlstm_kit did
    not write; else record them in the folder's manifest."""
    out_dir = Path(out_dir)
    names = {LATEST_FILE, *names}
    owned = owned_files(out_dir)
    if not names <= owned:
        legacy = _legacy_run(out_dir)
        for n in sorted(names - owned):
            if not legacy and os.path.lexists(out_dir / n):
                raise not_ours(out_dir / n, "a training run into that folder would overwrite it")
        out_dir.mkdir(parents=True, exist_ok=True)
        claim(out_dir, names)


def clear_run(out_dir: str | Path, names) -> None:
    """Delete the training run in ``out_dir`` (to start afresh there): its checkpoints, ``latest``
    and ``names`` (e.g. its metrics log and loss plot), as far as xlstm_kit wrote them. Refuses
    (one line, before deleting anything) a file of those names that xlstm_kit did not write;
    every other file or folder stays, also inside ``checkpoints/``."""
    out_dir = Path(out_dir)
    names = [LATEST_FILE, *names]
    owned = owned_files(out_dir)
    legacy = _legacy_run(out_dir)
    for n in names:
        if n not in owned and not legacy and os.path.lexists(out_dir / n):
            raise not_ours(out_dir / n, "replacing the training run there would delete it")
    if os.path.lexists(out_dir / LATEST_FILE) and not (out_dir / LATEST_FILE).is_dir():
        (out_dir / LATEST_FILE).unlink()  # first: it must never name a removed checkpoint
    remove_stale_staging(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    for p in _our_checkpoints(root):
        _remove_checkpoint(p)
    with contextlib.suppress(OSError):
        root.rmdir()  # only when empty: a file of someone else's keeps it
    for n in names:
        if os.path.lexists(out_dir / n) and not (out_dir / n).is_dir():
            (out_dir / n).unlink()
    if out_dir.is_dir():
        write_manifest(out_dir, owned_files(out_dir) - set(names))


# Names of the temporaries a killed save leaves: staging folders (and, from versions that saved
# the model through save_model, its temporary folder beside them) in checkpoints/, and
# atomic_write's files for `latest`, metrics.jsonl and the manifest in the run folder. Exact
# patterns, so that nothing else a user keeps there is touched.
_STALE_IN_CHECKPOINTS = re.compile(r"\.\.?tmp-step-\d+-[A-Za-z0-9_]+(\.tmp-[A-Za-z0-9_]+)?")
_STALE_IN_RUN = re.compile(r"\.(latest|metrics\.jsonl|\.xlstm-kit-files\.json)\.\d+\.[0-9a-f]{12}\.tmp")


def remove_stale_staging(out_dir: str | Path) -> None:
    """Delete the temporaries left behind by a process killed mid-save (never named by ``latest``)."""
    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    if root.is_dir():
        for p in root.iterdir():
            if _STALE_IN_CHECKPOINTS.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
    if out_dir.is_dir():
        for p in out_dir.iterdir():
            if _STALE_IN_RUN.fullmatch(p.name) and p.is_file() and not p.is_symlink():
                p.unlink(missing_ok=True)
