"""Model checkpoints: a folder with config.json (the XLSTMConfig fields) and model.safetensors.

No pickle anywhere: the weights are a safetensors file, the config plain JSON. A new folder is
written under a temporary name beside the target and renamed into place, so a crash leaves
either no checkpoint or a complete one. Saving into an existing folder replaces the two files
one by one (each replacement atomic) and leaves other files there (e.g. training state) alone.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_files(model, folder: Path) -> None:
    from safetensors.torch import save_file

    state = model.state_dict()
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # the same tensor as embedding.weight; re-tied on load
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "xlstm_kit"})
    (folder / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        _fsync(folder / name)


def save_model(model, directory: str | Path) -> Path:
    """Write `directory`/config.json and model.safetensors for an XLSTMLanguageModel. Returns the folder."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"cannot save a checkpoint to {str(directory)!r}: it exists and is not a folder")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        _write_files(model, tmp)
        if directory.exists():
            for name in (WEIGHTS_FILE, CONFIG_FILE):
                os.replace(tmp / name, directory / name)
        else:
            os.rename(tmp, directory)
        _fsync(directory)
        _fsync(directory.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory


def load_model(directory: str | Path, device: str | torch.device | None = None):
    """Read a checkpoint folder written by `save_model` into a new XLSTMLanguageModel.

    FileNotFoundError when the folder or one of its two files is missing; ValueError when a
    file is corrupt or does not match the config.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .model import XLSTMConfig, XLSTMLanguageModel

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no checkpoint folder at {str(directory)!r}")
    cfg_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if not p.is_file():
            raise FileNotFoundError(f"checkpoint {str(directory)!r} has no {p.name}; is it an xlstm_kit model folder?")
    try:
        config = XLSTMConfig.from_dict(json.loads(cfg_path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON ({e}); the checkpoint is corrupt") from None
    except (ValueError, TypeError) as e:
        raise ValueError(f"{cfg_path} does not describe a valid XLSTMConfig: {e}") from None
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{weights_path} is not a readable safetensors file ({e}); the checkpoint is corrupt") from None

    model = XLSTMLanguageModel(config)
    expected = model.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(
            f"{weights_path} does not match its config.json: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for name, t in tensors.items():
        if t.shape != expected[name].shape:
            raise ValueError(
                f"{weights_path}: {name} has shape {list(t.shape)}, config.json implies {list(expected[name].shape)}"
            )
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    model.load_state_dict(tensors, strict=not config.tie_embeddings)
    return model if device is None else model.to(device)
