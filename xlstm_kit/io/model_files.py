"""Model checkpoints on disk: the folder format (``config.json``, ``model.safetensors``,
``checksums.json``, ``tokenizer.json``), its SHA-256 checksums, the save and the checked load of
the state (shapes before allocation, dtypes, finite values). Run folders and training
checkpoints build on it in xlstm_kit.io.checkpoint, which re-exports these names."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from ..errors import MissingFileError, XLSTMKitError
from ..layers.lora import has_adapters
from ..models.lora import adapter_config
from .files import _umask, save_folder
from .jsonfile import (MAX_CONFIG_BYTES, MAX_META_BYTES, MAX_TOKENIZER_BYTES, checked_path, open_regular,
                       read_json, regular_file_exists)
from .paths import check_writable

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_FORMAT = 1
LATEST_FILE = "latest"
CHECKPOINTS_DIR = "checkpoints"
TRAIN_STATE_FILE = "train_state.pt"
TRAIN_META_FILE = "train_meta.json"
CHECKSUMS_FILE = "checksums.json"
ADAPTER_CONFIG_FILE = "adapter_config.json"  # a model with LoRA adapters (xlstm_kit.io.lora)
MAX_CHECKSUMS_BYTES = 1 << 20  # a few file names and digests
STAGING_NAME_BYTES = len(".") + len(".tmp-") + 12  # what _make_hidden_dir adds to a folder's name


class CheckpointError(XLSTMKitError):
    """A missing, incomplete or incompatible training checkpoint."""


def _file_sha256(path: Path) -> str:
    # a FIFO would block the open, a device (a link to /dev/zero) never end: regular files only,
    # checked by the open descriptor (one put there after a check of the name would be opened)
    try:
        f = open_regular(path, CheckpointError)
    except MissingFileError as e:
        raise CheckpointError(str(e)) from None
    h = hashlib.sha256()
    with f:
        try:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        except OSError as e:
            raise CheckpointError(f"{path}: {e.strerror or e}") from None
    return h.hexdigest()


def _write_checksums(folder: Path, names: list[str], known: dict[str, str] | None = None) -> None:
    """checksums.json of ``names`` plus ``known`` (digests already taken: the shards that each
    rank of a sharded save hashed itself)."""
    digests = {**(known or {}), **{n: _file_sha256(folder / n) for n in names}}
    (folder / CHECKSUMS_FILE).write_text(json.dumps({"sha256": digests}, indent=2) + "\n")


def verify_checksum(folder: str | Path, name: str) -> None:
    """Compare ``folder/name`` with the SHA-256 that ``checksums.json`` records for it.

    CheckpointError on a mismatch or an unreadable checksums.json; nothing to check (checkpoints
    written before checksums existed, or a file it does not list) passes.
    """
    folder = Path(folder)
    f = folder / CHECKSUMS_FILE
    # a FIFO or a folder of that name is refused, not passed over: the weights would load unchecked
    if not regular_file_exists(f, CheckpointError):
        return
    if f.stat().st_size > MAX_CHECKSUMS_BYTES:
        raise CheckpointError(f"{f} is corrupt ({f.stat().st_size:,} bytes for a few digests)")
    try:
        recorded = read_json(f, MAX_CHECKSUMS_BYTES, error=CheckpointError)["sha256"]
        expected = recorded.get(name) if isinstance(recorded, dict) else None
        if not isinstance(recorded, dict) or not (expected is None or isinstance(expected, str)):
            raise TypeError("not a map of file names to hex digests")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{f} is corrupt ({type(e).__name__}: {e})") from None
    if expected is not None and _file_sha256(folder / name) != expected.lower():
        raise CheckpointError(f"{folder / name} does not match the SHA-256 recorded in {CHECKSUMS_FILE}; "
                              f"the file is corrupt or was changed after saving")


# --------------------------------------------------------------------------------------------
# Model checkpoints
# --------------------------------------------------------------------------------------------


def _write_model_files(model: nn.Module, folder: Path, tokenizer: str | None, weights: bool = True) -> list[str]:
    names = [CONFIG_FILE]
    if weights:  # a sharded training checkpoint keeps its weights in the shard files instead
        state = model.state_dict()
        if getattr(model.config, "tie_embeddings", False):
            state.pop("lm_head.weight")  # the same tensor as embedding.weight; re-tied on load
        tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
        safetensors.torch.save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "xlstm_kit"})
        os.chmod(folder / WEIGHTS_FILE, 0o666 & ~_umask())  # safetensors writes 0600 whatever the umask
        _write_checksums(folder, [WEIGHTS_FILE])
        names += [WEIGHTS_FILE, CHECKSUMS_FILE]
    (folder / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    if has_adapters(model):  # the weights hold them; loaders rebuild the same adapters from this first
        (folder / ADAPTER_CONFIG_FILE).write_text(json.dumps(adapter_config(model), indent=2, sort_keys=True) + "\n")
        names.append(ADAPTER_CONFIG_FILE)
    hf_tokenizer = getattr(model, "hf_tokenizer", None)  # a tokenizers-format tokenizer.json (xlstm_kit.io.hf)
    if hf_tokenizer is not None:
        names += hf_tokenizer.save(folder)
    elif tokenizer is not None:
        (folder / TOKENIZER_FILE).write_text(json.dumps({"name": tokenizer}) + "\n")
        names.append(TOKENIZER_FILE)
    return names


def save_model(model: nn.Module, directory: str | Path, tokenizer: str | None = None) -> Path:
    """Write ``directory``/config.json + model.safetensors (+ tokenizer.json when ``tokenizer``
    names one) for a model with a ``config``, atomically (xlstm_kit.io.files.save_folder: over
    an earlier save the old model or the new one, never a mix; the model files of an earlier
    save of ours that this one does not write, such as a HuggingFace index and shards, go;
    files xlstm_kit did not write stay, and one that loading would read makes it refuse).
    Returns the folder."""
    directory = check_writable(directory, "cannot save a checkpoint to", folder=True, extra_bytes=STAGING_NAME_BYTES)
    return save_folder(directory, lambda folder: _write_model_files(model, folder, tokenizer))


def read_model_files(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config dict and the tensors (on the CPU) of a model checkpoint folder.

    FileNotFoundError when the folder or one of its two files is missing; ValueError when a
    file is corrupt.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise MissingFileError(f"no checkpoint folder at {str(directory)!r}")
    cfg_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for p in (cfg_path, weights_path):
        if p.exists() and not p.is_file():  # a FIFO, a device, a folder: never opened
            raise CheckpointError(f"{p} is not a regular file; the checkpoint is unusable")
        if not p.is_file():
            raise MissingFileError(f"checkpoint {str(directory)!r} has no {p.name}; is it an xlstm_kit model folder?")
    config = read_json(cfg_path, MAX_CONFIG_BYTES)
    verify_checksum(directory, WEIGHTS_FILE)
    # the checks above were of the name, which may be a FIFO by now
    with checked_path(weights_path, CheckpointError) as opened:
        try:
            tensors = safetensors.torch.load_file(opened, device="cpu")
        except (SafetensorError, OSError, ValueError) as e:
            raise XLSTMKitError(f"{weights_path} is not a readable safetensors file ({e}); the checkpoint is corrupt") from None
    return config, tensors


def check_state(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Refuse ``tensors`` that do not fit ``model`` (which may live on the meta device, so that
    a config naming a huge model is refused before anything is allocated): missing, unexpected
    or mis-shaped entries (a tied head is not stored), integer or boolean tensors for floating
    parameters, NaN or infinite values."""
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
        # load_state_dict would cast integer or boolean tensors into float parameters silently
        if expected[name].dtype.is_floating_point and not t.dtype.is_floating_point:
            raise CheckpointError(f"{source}: {name} has dtype {t.dtype}, expected a floating-point tensor")
        if t.dtype.is_floating_point and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{source}: {name} holds NaN or infinite values; the checkpoint is unusable")


def load_state_checked(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path,
                       checked: bool = False) -> nn.Module:
    """Copy ``tensors`` into ``model`` after :func:`check_state` (skipped when ``checked``: the
    caller ran it). Takes the tensors' dtype when they all share one."""
    if not checked:
        check_state(model, tensors, source)
    tied = getattr(model.config, "tie_embeddings", False)
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) == 1:
        model = model.to(dtypes.pop())
    model.load_state_dict(tensors, strict=not tied)
    return model


def read_tokenizer_name(checkpoint: str | Path) -> str | None:
    """The tokenizer a checkpoint was trained with: tokenizer.json, else (checkpoints written
    before tokenizer.json existed) train_meta.json's "tokenizer"; None when unknown, or when
    tokenizer.json is a `tokenizers` file rather than a name (xlstm_kit.io.tokenizers.find_tokenizer)."""
    checkpoint = Path(checkpoint)
    # read, not checked by name first: a FIFO or a folder of either name is refused in one line
    # rather than passed over (the model would load without the tokenizer it was trained with)
    try:
        value = read_json(checkpoint / TOKENIZER_FILE, MAX_TOKENIZER_BYTES).get("name")
    except MissingFileError:
        try:
            value = read_json(checkpoint / TRAIN_META_FILE, MAX_META_BYTES, error=CheckpointError).get("tokenizer")
        except MissingFileError:
            value = None
    return value if isinstance(value, str) else None


SHARDED_INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's index of the shard files (xlstm_kit.io.sharded)


def is_sharded(checkpoint: str | Path) -> bool:
    """Whether a checkpoint keeps its weights in torch.distributed.checkpoint shards (written
    by an FSDP run; read by xlstm_kit.io.sharded) rather than one model.safetensors."""
    checkpoint = Path(checkpoint)
    # not is_file(): a FIFO or a folder as the index is refused, not taken for a checkpoint whose
    # model.safetensors is missing
    index = regular_file_exists(checkpoint / SHARDED_INDEX_FILE, CheckpointError)
    return index and not (checkpoint / WEIGHTS_FILE).exists()
