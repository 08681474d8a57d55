"""Sharded training checkpoints: the weights and optimizer state of an FSDP2 run, written by every
rank through ``torch.distributed.checkpoint`` (DCP) and read back at any number of processes.

Such a checkpoint is a training checkpoint folder (xlstm_kit.io.checkpoint) whose weights and
optimizer state are DCP files instead of ``model.safetensors`` and the optimizer entry of
``train_state.pt``::

    __0_0.distcp, __1_0.distcp, ...   each rank's shards (weights "model.*", AdamW state "optim.*")
    .metadata                         DCP's index: which slice of which tensor lies where
    config.json, tokenizer.json       as in every checkpoint
    train_state.pt                    step, RNG, train config, the workload's state; "sharded": True
    train_meta.json, checksums.json   SHA-256 of every shard file, the index and train_state.pt
    .xlstm-kit-files.json             the manifest: all of the above are ours

It is staged, committed and pruned as a single-file checkpoint is: every rank writes into rank
0's staging folder, rank 0 adds the rest and renames it into place, and only then does
``latest`` move, so a rank killed mid-save leaves the previous checkpoint as ``latest`` and a
staging folder that the next resume deletes.

DCP's own reader unpickles the index with ``pickle`` and loads non-tensor entries (the
optimizer's hyper-parameters) with ``torch.load(weights_only=False)``: either runs code from a
crafted file. Here the index is unpickled with only DCP's metadata classes allowed, its entries
are checked (shard files are plain names of regular files in the folder, slices lie inside them,
no storage transforms), and non-tensor entries load with ``weights_only=True``.
``torch.distributed.checkpoint`` takes two seconds to import: it is imported when used.
"""
from __future__ import annotations

import functools
import io
import os
import pickle
import re
import shutil
import stat
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import XLSTMKitError
from .checkpoint import _commit_checkpoint, _start_checkpoint, _write_train_files, resolve_checkpoint
from .jsonfile import MAX_CONFIG_BYTES, open_regular, read_json
from .model_files import (CHECKSUMS_FILE, CONFIG_FILE, MAX_CHECKSUMS_BYTES, SHARDED_INDEX_FILE, TRAIN_STATE_FILE,
                          CheckpointError, _file_sha256, _write_model_files, is_sharded, verify_checksum)

MAX_INDEX_BYTES = 256 << 20  # a 7B model's index over 64 ranks is a few MB
_SHARD_FILE = re.compile(r"__(\d+)_(\d+)\.distcp")
_INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}


def _one_line(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
    return msg[:300]


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _INDEX_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"the index names {module}.{name}, which a checkpoint index never holds")


def read_index(folder: Path):
    """DCP's index of the sharded checkpoint ``folder``, unpickled with DCP's metadata classes
    only and checked: every entry's shard file is a plain name of a regular file in the folder
    and its slice lies inside that file. CheckpointError otherwise."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, Metadata, MetadataIndex,
                                                       TensorStorageMetadata)

    path = folder / SHARDED_INDEX_FILE
    try:
        # checked by the open descriptor: a FIFO put there after a check of the name would block
        # an open of the name for ever
        with open_regular(path, CheckpointError) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_INDEX_BYTES:
                raise ValueError(f"{size:,} bytes, more than an index of shards holds")
            md = _IndexUnpickler(f).load()
    except XLSTMKitError as e:  # missing, or not a regular file: its message names the file
        raise CheckpointError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever a crafted or truncated pickle raises
        raise CheckpointError(f"{path} is not a readable checkpoint index: {_one_line(e)}") from None
    problem = None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) \
            or not isinstance(md.storage_data, dict):
        problem = "not a torch.distributed.checkpoint index"
    else:
        for key, entry in md.state_dict_metadata.items():
            if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
                problem = f"entry {str(key)[:80]!r} is malformed"
                break
        sizes: dict[str, int] = {}
        for key, info in md.storage_data.items() if problem is None else ():
            if not isinstance(key, MetadataIndex) or not isinstance(info, _StorageInfo):
                problem = "a storage entry is malformed"
            elif not isinstance(info.relative_path, str) or not _SHARD_FILE.fullmatch(info.relative_path):
                problem = f"it names the shard file {str(info.relative_path)[:80]!r}"
            elif info.transform_descriptors:
                problem = "it asks for storage transforms, which xlstm_kit never writes"
            elif not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (info.offset, info.length)):
                problem = f"entry {key.fqn!r} has the slice {info.offset!r}+{info.length!r}"
            else:
                if info.relative_path not in sizes:
                    try:
                        shard = os.stat(folder / info.relative_path)
                    except OSError as e:
                        problem = f"{info.relative_path}: {e.strerror or e}"
                        break
                    if not stat.S_ISREG(shard.st_mode):
                        problem = f"{info.relative_path} is not a regular file"
                        break
                    sizes[info.relative_path] = shard.st_size
                if info.offset + info.length > sizes[info.relative_path]:
                    problem = f"entry {key.fqn!r} lies past the end of {info.relative_path} (a truncated shard)"
            if problem is not None:
                break
    if problem is not None:
        raise CheckpointError(f"{path} is corrupt: {problem}")
    return md


@functools.cache
def _dcp_classes():
    """The reader and load planner that use :func:`read_index` and load non-tensor entries with
    ``weights_only=True`` (built on first use: DCP is imported then)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            if kwargs.get("rank") is not None:  # DCP's per-rank fallback: xlstm_kit writes one index
                raise CheckpointError("no per-rank index")
            md = read_index(Path(self.path))
            if md.storage_meta is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Reader, Planner


def _shard_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if _SHARD_FILE.fullmatch(p.name))


def _verify(folder: Path, names: list[str]) -> None:
    """The SHA-256 of each of ``names`` against checksums.json, which must list them all."""
    listed = read_json(folder / CHECKSUMS_FILE, MAX_CHECKSUMS_BYTES, error=CheckpointError).get("sha256")
    missing = [n for n in names if not isinstance(listed, dict) or n not in listed]
    if missing:
        raise CheckpointError(f"{folder / CHECKSUMS_FILE} records no SHA-256 of {missing[0]}; the checkpoint is corrupt")
    for name in names:
        verify_checksum(folder, name)


def read_sharded_weights(folder: str | Path, expected: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """The whole model tensors (on the CPU) of the sharded checkpoint ``folder``, assembled in this
    one process from the shards of every rank that wrote it (never joins a process group, so a
    rank of one may call it alone). ``expected``: name -> shape of the model's state (the tied head
    left out); the index must hold exactly these as floating tensors, and their bytes must be in
    the shard files, before anything is allocated."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    index = read_index(folder)
    shards = sorted({info.relative_path for info in index.storage_data.values()})
    _verify(folder, [SHARDED_INDEX_FILE, *shards])
    stored = {k[len("model."):]: m for k, m in index.state_dict_metadata.items() if k.startswith("model.")}
    missing = sorted(set(expected) - set(stored))
    if missing:
        raise CheckpointError(f"{folder} holds no weights for {missing[:5]}; it does not match its {CONFIG_FILE}")
    need = 0
    for name, shape in expected.items():
        m = stored[name]
        if not isinstance(m, TensorStorageMetadata) or not isinstance(m.properties.dtype, torch.dtype) \
                or not m.properties.dtype.is_floating_point:
            raise CheckpointError(f"{folder}: {name} is not stored as a floating-point tensor")
        if tuple(m.size) != tuple(shape):
            raise CheckpointError(f"{folder}: {name} has shape {list(m.size)}, {CONFIG_FILE} implies {list(shape)}")
        need += m.size.numel() * m.properties.dtype.itemsize
    on_disk = sum((folder / s).stat().st_size for s in shards)
    if need > on_disk:
        raise CheckpointError(f"{folder}'s index describes {need:,} bytes of weights, its shard files hold "
                              f"{on_disk:,}; the checkpoint is corrupt")
    # zeros, not empty: an index whose chunks leave part of a tensor out must not hand over stale memory
    tensors = {name: torch.zeros(tuple(stored[name].size), dtype=stored[name].properties.dtype) for name in expected}
    Reader, Planner = _dcp_classes()
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load({"model": tensors}, storage_reader=Reader(str(folder)), planner=Planner(), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP wraps a bad slice or shard in its own exceptions
        raise CheckpointError(f"cannot read the sharded weights of {folder}: {_one_line(e)}") from None
    return tensors


def save_sharded_checkpoint(out_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                            config, meta: dict[str, Any] | None = None, keep: int = 2,
                            extra: dict[str, Any] | None = None) -> Path:
    """:func:`xlstm_kit.io.checkpoint.save_checkpoint` for a model sharded by FSDP2, called by every
    rank of the process group: each rank writes its shards of the weights and optimizer state
    into rank 0's staging folder and hashes them; rank 0 adds the config and training state and
    commits the folder. Returns the checkpoint folder on every rank; an error on any rank
    raises on all of them (none is left waiting in a collective)."""
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    out_dir = Path(out_dir)
    rank = torch_dist.get_rank()
    # rank 0's outcomes go to the others as paths or one-line messages (an exception object
    # need not pickle), so that no rank is left waiting for a folder or a commit that never comes
    box: list[Any] = [None, None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            box[0] = _start_checkpoint(out_dir, step)
        except Exception as e:  # noqa: BLE001 - raised below, here and on every rank
            failure, box[1] = e, _one_line(e)
    torch_dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise failure if failure is not None else XLSTMKitError(f"rank 0 could not start the checkpoint: {box[1]}")
    root, final, staging = box[0]
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        save({"model": model_state, "optim": optim_state}, checkpoint_id=str(staging))
        own = {n: _file_sha256(staging / n) for n in _shard_files(staging) if _SHARD_FILE.fullmatch(n)[1] == str(rank)}
        digests: list[dict[str, str] | None] = [None] * torch_dist.get_world_size()
        torch_dist.all_gather_object(digests, own)
        outcome: list[Any] = [None, None]
        if rank == 0:
            try:
                known = {k: v for d in digests for k, v in d.items()}
                names = [*known, SHARDED_INDEX_FILE]
                names += _write_model_files(model, staging, (meta or {}).get("tokenizer")
                                            or getattr(model, "tokenizer_name", None), weights=False)
                names += _write_train_files(staging, step, config, meta, extra, {"sharded": True},
                                            [TRAIN_STATE_FILE, SHARDED_INDEX_FILE], known)
                outcome[0] = _commit_checkpoint(out_dir, root, staging, final, names, keep)
            except Exception as e:  # noqa: BLE001 - raised below, here and on every rank
                failure, outcome[1] = e, _one_line(e)
        torch_dist.broadcast_object_list(outcome, src=0)
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if outcome[1] is not None:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise failure
        raise XLSTMKitError(f"rank 0 could not commit the checkpoint: {outcome[1]}")
    return outcome[0]


def load_sharded_into(model: nn.Module, optimizer: torch.optim.Optimizer, checkpoint: Path) -> None:
    """Load a sharded checkpoint's weights and optimizer state into an FSDP2-sharded ``model`` and
    its optimizer, called by every rank; the checkpoint may have been written by another number
    of processes (DCP reshards). The ranks share out the checksum verification of the files."""
    import torch.distributed as torch_dist
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    checkpoint = Path(checkpoint)
    if not is_sharded(checkpoint):
        raise CheckpointError(f"checkpoint {checkpoint} holds no sharded weights: it was written by a run "
                              f"without parallel='fsdp'")
    saved = read_json(checkpoint / CONFIG_FILE, MAX_CONFIG_BYTES, error=CheckpointError)
    try:
        same = type(model.config).from_dict(saved) == model.config
    except (ValueError, TypeError, AttributeError):
        same = False
    if not same:
        raise CheckpointError(f"checkpoint {checkpoint} holds a model of another configuration than the one being trained")
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    problem = None
    try:
        index = read_index(checkpoint)
        files = [SHARDED_INDEX_FILE, *sorted({i.relative_path for i in index.storage_data.values()})]
        _verify(checkpoint, files[rank::world])
    except CheckpointError as e:
        problem = str(e)
    problems: list[str | None] = [None] * world
    torch_dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise CheckpointError(found)
    model_state, optim_state = get_state_dict(model, optimizer)
    Reader, Planner = _dcp_classes()
    try:
        load({"model": model_state, "optim": optim_state}, storage_reader=Reader(str(checkpoint)), planner=Planner())
    except Exception as e:  # noqa: BLE001 - DCP raises its own exception types, on every rank
        raise CheckpointError(f"cannot load the sharded checkpoint {checkpoint}: {_one_line(e)}") from None
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


def resumes_from_shards(out_dir: str | Path) -> bool:
    """Whether a resume of the run in ``out_dir`` reads its weights from a sharded checkpoint (so
    that no rank needs the model's weights before); False where there is no checkpoint to read,
    which the resume itself then reports."""
    try:
        return is_sharded(resolve_checkpoint(out_dir))
    except (XLSTMKitError, OSError):
        return False


def stored_weight_names(folder: str | Path) -> set[str]:
    """The model tensor names a sharded checkpoint's index holds (read before its config is
    trusted: see xlstm_kit.io.loading)."""
    return {k[len("model."):] for k in read_index(Path(folder)).state_dict_metadata if k.startswith("model.")}
