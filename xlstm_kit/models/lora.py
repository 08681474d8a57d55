"""LoRA adapters on the blocks' linear maps, through PEFT (the `lora` extra).

`apply_lora(model, rank, alpha, targets)` injects PEFT's LoRA layers in place
(`peft.inject_adapter_in_model`: the model keeps its class, its `step`, `generate` and I/O) and
freezes every other parameter; `merge_lora(model)` folds the adapters into the weights and puts
the plain nn.Linear maps back. The blocks' fused paths read weights through
`xlstm_kit.layers.lora.lora_weight`, so a model with adapters computes what its merged model
computes on every path, the Triton training and decode kernels included.

Targets are the names of nn.Linear maps inside the blocks (`up_proj`, `q`, ...); the head-wise
q/k/v maps of the paper's mLSTM block and the sLSTM's gate and recurrent weights are not
nn.Linear and cannot carry adapters. Only plain LoRA (no dropout, DoRA or adapter bias): the
fused paths see the adapters as a weight, W + (alpha / rank) B A.
"""
from __future__ import annotations

import enum
import math

import torch
from torch import nn

from .._extras import require
from ..errors import XLSTMKitError
from ..layers.lora import has_adapters, is_lora_layer

ADAPTER = "default"  # PEFT's adapter name; one adapter per model
DEFAULT_TARGETS = ("up_proj", "down_proj", "qkv_proj", "gate_proj", "out_proj",
                   "q", "k", "v", "ogate_preact", "proj_up_gate", "proj_up", "proj_down")
"""The maps that get adapters when no targets are named: every linear map of the blocks but the
gate pre-activations of one value per head (mLSTM igate/fgate, large igate/fgate_preact) and the
DPLR block's β and decay maps, whose outputs a rank-r update would barely constrain."""


def block_linear_names(model: nn.Module) -> list[str]:
    """The names (last component) of the nn.Linear maps in `model.blocks`, LoRA-wrapped or not."""
    names = set()
    for name, module in model.blocks.named_modules():
        parts = name.split(".")
        inside_wrapper = "base_layer" in parts or any(p.startswith("lora_") for p in parts)
        if (isinstance(module, nn.Linear) or is_lora_layer(module)) and not inside_wrapper:
            names.add(parts[-1])
    return sorted(names)


def _targets(model: nn.Module, targets) -> list[str]:
    available = block_linear_names(model)
    if targets is None:
        chosen = [t for t in DEFAULT_TARGETS if t in available]
    else:
        chosen = [targets] if isinstance(targets, str) else list(targets)
        if not chosen or not all(isinstance(t, str) and t for t in chosen):
            raise XLSTMKitError(f"LoRA targets must be names of linear maps, got {targets!r}")
        missing = [t for t in chosen if t not in available]
        if missing:
            raise XLSTMKitError(f"LoRA target {', '.join(map(repr, missing))} is not a linear map of this model's "
                                f"blocks; they have {', '.join(available) or 'none'}")
    if not chosen:
        raise XLSTMKitError(f"this model's blocks have none of the default LoRA targets; name some of "
                            f"{', '.join(available) or 'none'}")
    return sorted(set(chosen))


def check_rank_alpha(rank, alpha) -> tuple[int, float]:
    """(rank, alpha) validated; alpha None means 2 * rank (scaling 2)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise XLSTMKitError(f"the LoRA rank must be a positive integer, got {rank!r}")
    if alpha is None:
        alpha = 2 * rank
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise XLSTMKitError(f"the LoRA alpha must be a positive number, got {alpha!r}")
    return rank, float(alpha)


def lora_settings(model: nn.Module) -> dict | None:
    """{"rank", "alpha", "targets"} of the adapters `apply_lora` gave `model`, None without."""
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    if config is None or not has_adapters(model):
        return None
    return {"rank": config.r, "alpha": float(config.lora_alpha), "targets": sorted(config.target_modules)}


def adapter_config(model: nn.Module) -> dict:
    """The JSON of PEFT's adapter_config.json for `model`'s adapters (a LoraConfig PEFT reads back)."""
    config = model.peft_config[ADAPTER].to_dict()
    return {k: sorted(v) if isinstance(v, set) else v.value if isinstance(v, enum.Enum) else v
            for k, v in config.items()}


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=None):
    """Give the linear maps `targets` of `model`'s blocks (names such as "up_proj" or "q"; None:
    DEFAULT_TARGETS) LoRA adapters of rank `rank` and scaling alpha / rank (alpha None: 2 * rank),
    in place, and freeze every other parameter. B starts at zero: the model computes as before.
    Returns `model`."""
    rank, alpha = check_rank_alpha(rank, alpha)
    if not hasattr(model, "blocks"):
        raise XLSTMKitError(f"apply_lora takes an xlstm_kit language model, got {type(model).__name__}")
    if has_adapters(model):
        raise XLSTMKitError("the model already has LoRA adapters; merge_lora(model) first, or start from the base model")
    chosen = _targets(model, targets)
    peft = require("peft", "LoRA")
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=chosen, lora_dropout=0.0, bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    return model


def use_lora(model: nn.Module, rank: int, alpha: float | None = None, targets=None, *,
             seed: int | None = None) -> None:
    """`apply_lora` for a training run: a model that already carries the same adapters (a resumed
    run) is left as it is; other adapters are refused. `seed`: A's initial values come from it
    (a run is reproducible from its seed), torch's global generators are left as they were."""
    settings = lora_settings(model)
    if settings is None:
        cuda = sorted({p.device for p in model.parameters() if p.is_cuda}, key=str)
        with torch.random.fork_rng(devices=cuda, enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            apply_lora(model, rank, alpha, targets)
        return
    rank, alpha = check_rank_alpha(rank, alpha)
    wanted = {"rank": rank, "alpha": alpha, "targets": _targets(model, targets)}
    if settings != wanted:
        raise XLSTMKitError(f"the model already carries LoRA adapters {settings}, not the {wanted} asked for")


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA adapter into its base weight (W += alpha/rank · B A) and put the plain
    nn.Linear back, in place; every parameter becomes trainable again (a plain model, as before
    `apply_lora`). A model without adapters is returned as it is. Returns `model`."""
    wrapped = [(name, module) for name, module in model.named_modules() if is_lora_layer(module)]
    with torch.no_grad():
        for name, module in wrapped:
            if not module.merged:
                module.merge()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
    if wrapped:
        model.__dict__.pop("peft_config", None)
        for p in model.parameters():
            p.requires_grad_(True)
    return model
