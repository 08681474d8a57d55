"""LoRA adapters on disk, in PEFT's file layout.

An **adapter folder** (`save_adapters` / `load_adapters`) holds ``adapter_model.safetensors``
(the A and B matrices, PEFT's key names relative to our model: ``blocks.0.layer.up_proj.lora_A.weight``)
and ``adapter_config.json`` (PEFT's LoraConfig: r, lora_alpha, target_modules, ...). Kilobytes to
megabytes, next to a base model of gigabytes. Each file is replaced atomically, the config last:
a folder whose config is missing is no adapter folder yet, and a config that does not fit its
weights is refused on load.

A **model checkpoint of a model with adapters** (``model.save``, a `train --lora` run's
checkpoints) stores the state_dict as it is (base weights under ``…up_proj.base_layer.weight``
beside the adapters) plus ``adapter_config.json``; `adapters_from_folder` gives a freshly built
model the same adapters before the tensors are loaded into it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from .._extras import require
from ..errors import MissingFileError, XLSTMKitError
from ..models.lora import ADAPTER, adapter_config, apply_lora, lora_settings, merge_lora
from .checkpoint import ADAPTER_CONFIG_FILE, _umask, atomic_write
from .jsonfile import MAX_CONFIG_BYTES, open_regular, read_json

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# a PEFT LoraConfig with these values is what the blocks' fused paths can compute (plain LoRA)
_PLAIN = {"lora_dropout": 0.0, "use_dora": False, "bias": "none", "lora_bias": False, "use_rslora": False,
          "fan_in_fan_out": False, "rank_pattern": {}, "alpha_pattern": {}}


def _settings_or_refuse(model: nn.Module) -> dict:
    settings = lora_settings(model)
    if settings is None:
        raise XLSTMKitError("the model has no LoRA adapters (xlstm_kit.lora.apply_lora gives it some)")
    return settings


def read_adapter_config(folder: str | Path) -> dict | None:
    """(rank, alpha, targets) from `folder`/adapter_config.json, None without one; one-line
    errors for a corrupt file or adapters other than plain LoRA."""
    f = Path(folder) / ADAPTER_CONFIG_FILE
    # exists(), not is_file(): a FIFO or a folder of that name is refused in one line rather than
    # passed over (a model loaded without the adapters its folder says it has)
    if not f.exists():
        return None
    raw = read_json(f, MAX_CONFIG_BYTES)  # PEFT's config is a few hundred bytes
    try:
        settings = {"rank": raw["r"], "alpha": raw["lora_alpha"], "targets": raw["target_modules"]}
    except KeyError as e:
        raise XLSTMKitError(f"{f} is not a LoRA adapter config (KeyError: {e})") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise XLSTMKitError(f"{f} describes {raw.get('peft_type')} adapters; xlstm_kit loads LoRA adapters only")
    odd = sorted(k for k, v in _PLAIN.items() if raw.get(k, v) not in (v, None))
    if odd:
        raise XLSTMKitError(f"{f} sets {', '.join(odd)}: xlstm_kit's blocks take plain LoRA adapters only")
    return settings


def adapters_from_folder(model: nn.Module, folder: str | Path) -> nn.Module:
    """Give `model` (freshly built, no adapters) the adapters that `folder`/adapter_config.json
    describes, if any, so that the folder's tensors load into it. Returns `model`."""
    settings = read_adapter_config(folder)
    if settings is not None:
        apply_lora(model, settings["rank"], settings["alpha"], settings["targets"])
    return model


def save_adapters(model: nn.Module, directory: str | Path) -> Path:
    """Write `model`'s LoRA adapters alone to `directory` (adapter_model.safetensors and
    adapter_config.json, PEFT's layout), each file replaced atomically. Returns the folder."""
    peft = require("peft", "LoRA")
    _settings_or_refuse(model)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise XLSTMKitError(f"cannot save adapters to {str(directory)!r}: it exists and is not a folder")
    state = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    tensors = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    data = safetensors.torch.save(tensors, metadata={"format": "pt"})
    atomic_write(directory / ADAPTER_WEIGHTS_FILE, data)
    os.chmod(directory / ADAPTER_WEIGHTS_FILE, 0o666 & ~_umask())
    atomic_write(directory / ADAPTER_CONFIG_FILE, json.dumps(adapter_config(model), indent=2, sort_keys=True) + "\n")
    return directory


def load_adapters(model: nn.Module, directory: str | Path) -> nn.Module:
    """Give `model` (the base model the adapters were trained on, without adapters) the LoRA
    adapters saved by `save_adapters` in `directory`, in place; its other parameters are frozen.
    One-line errors for a missing or corrupt folder and for adapters that do not fit the model.
    Returns `model`."""
    directory = Path(directory)
    weights = directory / ADAPTER_WEIGHTS_FILE
    not_adapters = XLSTMKitError(f"{directory} is not an adapter folder (no {ADAPTER_CONFIG_FILE} and "
                                 f"{ADAPTER_WEIGHTS_FILE} side by side)")
    if read_adapter_config(directory) is None:
        raise not_adapters
    # Read whole from the descriptor that was checked (adapters are a small fraction of a model):
    # a FIFO, a device or a folder there is refused as such rather than reported missing, and
    # safetensors' own open of the name would block on a FIFO put there after any check of it.
    try:
        with open_regular(weights, XLSTMKitError) as f:
            data = f.read()
    except MissingFileError:
        raise not_adapters from None
    except OSError as e:
        raise XLSTMKitError(f"{weights}: {e.strerror or e}") from None
    try:
        tensors = safetensors.torch.load(data)
    except (SafetensorError, ValueError) as e:
        raise XLSTMKitError(f"{weights} is not a readable safetensors file ({e})") from None
    peft = require("peft", "LoRA")
    adapters_from_folder(model, directory)
    expected = peft.get_peft_model_state_dict(model, adapter_name=ADAPTER)
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    problem = f"missing {missing[:3]}, unexpected {extra[:3]}" if missing or extra else None
    for key, t in tensors.items():
        if problem is None and (t.shape != expected[key].shape or not t.dtype.is_floating_point
                                or not bool(torch.isfinite(t).all())):
            problem = f"{key} is {t.dtype} {list(t.shape)}, finite floats {list(expected[key].shape)} expected"
    if problem is not None:
        merge_lora(model)  # B is still zero: this only takes the fresh adapters off again
        raise XLSTMKitError(f"{weights} does not fit the model: {problem}")
    peft.set_peft_model_state_dict(model, tensors, adapter_name=ADAPTER)
    return model
