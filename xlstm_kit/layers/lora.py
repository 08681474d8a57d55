"""The weight a linear map computes with when it may carry LoRA adapters.

PEFT (xlstm_kit.models.lora) replaces a targeted nn.Linear by its `lora.Linear`, whose forward
adds scaling * B(A x) to the base map's output and whose `.weight` is the base layer's weight
alone. The blocks' fused paths (norm + up-projection, the mLSTM cell's folded gate weights, the
output tail with its down-projection, the gated feed-forward, the concatenated input maps of the
large block, the one-token block kernels) take weight tensors, not modules: read through
`lora_weight` they get W + scaling * B A, so every path computes what the merged model computes,
and autograd carries the weight's gradient on to A and B. Without adapters it is `.weight`.

Duck-typed on PEFT's layer attributes, so that nothing here imports PEFT (an optional extra).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import XLSTMKitError


def is_lora_layer(module: nn.Module) -> bool:
    """Whether `module` is a PEFT LoRA layer (a wrapped base layer with lora_A / lora_B maps)."""
    return isinstance(module, nn.Module) and "base_layer" in module._modules and "lora_A" in module._modules


def has_adapters(model: nn.Module) -> bool:
    """Whether any module of `model` is a PEFT LoRA layer (merged or not)."""
    return any(is_lora_layer(m) for m in model.modules())


def lora_weight(linear: nn.Module) -> torch.Tensor:
    """The weight [out, in] that `linear` applies: its own for an nn.Linear; for a LoRA layer with
    active adapters that are not merged into the base, base + Σ scaling · B A (the arithmetic of
    PEFT's merge, so a merged model computes with the same numbers)."""
    if isinstance(linear, nn.Linear):
        return linear.weight
    weight = linear.base_layer.weight
    if linear.disable_adapters or linear.merged:  # PEFT's forward then runs the base layer alone
        return weight
    for name in linear.active_adapters:
        if name not in linear.lora_A:
            continue
        # the fused paths see the weight, never the input: input dropout, DoRA's column norms and
        # adapter biases are not expressible as a weight, so they are refused rather than dropped
        if name in linear.lora_variant or linear.lora_bias[name] \
                or not isinstance(linear.lora_dropout[name], nn.Identity):
            raise XLSTMKitError("xlstm_kit's blocks take plain LoRA adapters only (no lora_dropout, DoRA or "
                                "lora_bias); apply them with xlstm_kit.lora.apply_lora")
        weight = weight + linear.get_delta_weight(name).to(weight.dtype)
    return weight
