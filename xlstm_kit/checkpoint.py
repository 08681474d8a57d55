"""Checkpoints on disk: the model format, the training state, run folders and crash-safe writes.

A **model checkpoint** is a folder with ``config.json`` (the model config's fields) and
``model.safetensors`` (no pickle), plus ``tokenizer.json`` (``{"name": "byte"}``) when the
tokenizer is known. Saving into an existing folder replaces those files one by one (each
replacement atomic) and leaves other files there (e.g. training state) alone; a new folder is
written under a temporary name beside the target and renamed into place.

A **training run folder** (``train --out``)::

    latest                      one line: the relative path of the newest complete checkpoint
    checkpoints/step-00000030/  a model checkpoint + train_state.pt (optimizer, step, RNG)
                                + train_meta.json (format, step, train config, tokenizer, data)

A training checkpoint is written into a hidden staging folder, flushed to disk, renamed into
place, and only then does ``latest`` (replaced atomically) point at it: a crash or kill at any
moment leaves ``latest`` naming a complete checkpoint.

This module knows no model class: it writes any model with ``.config.to_dict()`` and reads
tensors + config dicts; ``XLSTMLanguageModel.save/load`` build on it (model.py imports this
module, never the reverse).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from .errors import XLSTMKitError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_FORMAT = 1
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
TRAIN_STATE_FILE = "train_state.pt"
TRAIN_META_FILE = "train_meta.json"


class CheckpointError(XLSTMKitError):
    """A missing, incomplete or incompatible training checkpoint."""


# --------------------------------------------------------------------------------------------
# Crash-safe writes
# --------------------------------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename inside it) to disk; a no-op where folders cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file under ``path`` and the folder itself."""
    for p in sorted(Path(path).rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(path)


def atomic_write(path: str | Path, data: bytes | str | Callable[[Any], None]) -> Path:
    """Replace ``path`` with ``data`` (bytes, text, or a function writing to a binary file).

    The data goes to a uniquely named file beside ``path``, is flushed, then renamed over it:
    readers see the old file or the complete new one, never a partial one, and processes racing
    to write the same file are safe (the last rename wins).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique name opened with "x" (not mkstemp): the file gets the usual umask permissions.
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        with open(tmp, "xb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------------------------------------
# Model checkpoints
# --------------------------------------------------------------------------------------------


def _write_model_files(model: nn.Module, folder: Path, tokenizer: str | None) -> list[str]:
    from safetensors.torch import save_file

    state = model.state_dict()
    if getattr(model.config, "tie_embeddings", False):
        state.pop("lm_head.weight")  # the same tensor as embedding.weight; re-tied on load
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "xlstm_kit"})
    (folder / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    names = [WEIGHTS_FILE, CONFIG_FILE]
    if tokenizer is not None:
        (folder / TOKENIZER_FILE).write_text(json.dumps({"name": tokenizer}) + "\n")
        names.append(TOKENIZER_FILE)
    return names


def save_model(model: nn.Module, directory: str | Path, tokenizer: str | None = None) -> Path:
    """Write ``directory``/config.json + model.safetensors (+ tokenizer.json when ``tokenizer``
    names one) for a model with a ``config``. Returns the folder."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise XLSTMKitError(f"cannot save a checkpoint to {str(directory)!r}: it exists and is not a folder")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        names = _write_model_files(model, tmp, tokenizer)
        fsync_tree(tmp)
        if directory.exists():
            for name in names:
                os.replace(tmp / name, directory / name)
        else:
            os.rename(tmp, directory)
        fsync_dir(directory)
        fsync_dir(directory.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def read_model_files(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config dict and the tensors (on the CPU) of a model checkpoint folder.

    FileNotFoundError when the folder or one of its two files is missing; ValueError when a
    file is corrupt.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {str(directory)!r}")
    cfg_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {str(directory)!r} has no {p.name}; is it an xlstm_kit model folder?")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise XLSTMKitError(f"{cfg_path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise XLSTMKitError(f"{weights_path} is not a readable safetensors file ({e}); the checkpoint is corrupt") from None
    return config, tensors


def load_state_checked(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> nn.Module:
    """Copy ``tensors`` into ``model``, refusing missing, unexpected or mis-shaped entries (a
    tied head is not stored). Takes the tensors' dtype when they all share one."""
    tied = getattr(model.config, "tie_embeddings", False)
    expected = model.state_dict()
    if tied:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise XLSTMKitError(f"{source} does not match its config.json: missing {missing[:5]}, unexpected {extra[:5]}")
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise XLSTMKitError(f"{source}: {name} has shape {list(t.shape)}, config.json implies {list(expected[name].shape)}")
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    model.load_state_dict(tensors, strict=not tied)
    return model


def read_tokenizer_name(checkpoint: str | Path) -> str | None:
    """The tokenizer a checkpoint was trained with: tokenizer.json, else (checkpoints written
    before tokenizer.json existed) train_meta.json's "tokenizer"; None when unknown."""
    checkpoint = Path(checkpoint)
    for name in (TOKENIZER_FILE, TRAIN_META_FILE):
        f = checkpoint / name
        if f.is_file():
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                d = json.loads(f.read_text())
                value = d.get("name" if name == TOKENIZER_FILE else "tokenizer")
                if isinstance(value, str):
                    return value
    return None


# --------------------------------------------------------------------------------------------
# Run folders and training checkpoints
# --------------------------------------------------------------------------------------------


def resolve_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder a path names: a checkpoint itself (has ``config.json`` or
    ``model.safetensors``) or a training output folder (through its ``latest`` file)."""
    path = Path(path)
    if (path / CONFIG_FILE).is_file() or (path / WEIGHTS_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        target = path / latest.read_text().strip()
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
    if not f.is_file():
        return {}
    try:
        meta = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from None
    fmt = meta.get("format")
    if fmt != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"checkpoint {checkpoint} has training-state format {fmt!r} (written by xlstm_kit "
            f"{meta.get('xlstm_kit_version', '?')}); this version reads format {CHECKPOINT_FORMAT}"
        )
    return meta


def load_training_state(checkpoint: str | Path) -> dict[str, Any]:
    """The ``train_state.pt`` of a checkpoint (tensors and plain containers only)."""
    f = Path(checkpoint) / TRAIN_STATE_FILE
    if not f.is_file():
        raise CheckpointError(f"{checkpoint} has no {TRAIN_STATE_FILE}: it is a model checkpoint, not resumable")
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or foreign file
        raise CheckpointError(f"cannot read {f}: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{f} has an unsupported format; this version reads format {CHECKPOINT_FORMAT}")
    return state


def _save_any_model(model: nn.Module, path: Path, tokenizer: str | None) -> None:
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):
        save_model(model, path, tokenizer=tokenizer)
    else:  # any other language model: weights only
        from safetensors.torch import save_model as save_weights

        path.mkdir(parents=True, exist_ok=True)
        save_weights(model, str(path / WEIGHTS_FILE))


def load_weights_into(model: nn.Module, checkpoint: Path) -> None:
    """Load a checkpoint's weights into ``model``, refusing one of another configuration."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        from safetensors.torch import load_model as load_weights

        load_weights(model, str(checkpoint / WEIGHTS_FILE))
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


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["rng"]["torch"])
    if device.type == "cuda" and state["rng"]["cuda"]:
        torch.cuda.set_rng_state_all(state["rng"]["cuda"])


def save_checkpoint(
    out_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    config,
    meta: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write a complete resumable checkpoint of ``step`` atomically and point ``latest`` at it.

    ``config`` is the TrainConfig (anything with ``to_dict()``). Returns the checkpoint folder.
    ``meta`` (JSON-serialisable; e.g. tokenizer and data spec) is stored in ``train_meta.json``;
    its "tokenizer" also goes to ``tokenizer.json``. Older checkpoints beyond ``keep`` are
    removed afterwards.
    """
    from . import __version__

    out_dir = Path(out_dir)
    root = out_dir / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:08d}"
    final, k = root / name, 1
    while final.exists():  # re-saving a step (resume then interrupt): never touch the old one
        final, k = root / f"{name}-{k}", k + 1
    staging = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        staging.rmdir()  # save_model creates its folder itself
        _save_any_model(model, staging, (meta or {}).get("tokenizer") or getattr(model, "tokenizer_name", None))
        state = {"format": CHECKPOINT_FORMAT, "step": step, "optimizer": optimizer.state_dict(),
                 "train_config": config.to_dict(), "rng": _rng_state()}
        torch.save(state, staging / TRAIN_STATE_FILE)
        info = {"format": CHECKPOINT_FORMAT, "xlstm_kit_version": __version__, "step": step,
                "train_config": config.to_dict(), **(meta or {})}
        (staging / TRAIN_META_FILE).write_text(json.dumps(info, indent=2) + "\n")
        fsync_tree(staging)
        os.rename(staging, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    atomic_write(out_dir / LATEST_FILE, f"{CHECKPOINTS_DIR}/{final.name}\n")
    fsync_dir(out_dir)
    _prune_checkpoints(root, keep, final)
    return final


def _checkpoint_step(p: Path) -> tuple[int, int]:
    parts = p.name.split("-")  # step-00000030 or step-00000030-1
    return int(parts[1]), int(parts[2]) if len(parts) > 2 else 0


def _prune_checkpoints(root: Path, keep: int, latest: Path) -> None:
    done = sorted((p for p in root.glob("step-*") if p.is_dir()), key=_checkpoint_step)
    for p in done[:-keep]:
        if p != latest:
            shutil.rmtree(p, ignore_errors=True)


def remove_stale_staging(out_dir: str | Path) -> None:
    """Delete staging folders left behind by a process killed mid-save (never named by ``latest``)."""
    for p in (Path(out_dir) / CHECKPOINTS_DIR).glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)
