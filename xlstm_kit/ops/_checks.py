"""Input checks shared by every op: one vocabulary of error messages.

Every public op validates its arguments here before dispatching, so that a wrong shape or dtype
fails with a `ValueError` that names the tensor and the expected shape instead of a broadcast
error deep inside a kernel.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import torch

from ..errors import XLSTMKitError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(shape: Sequence) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def check_tensor(name: str, t, expected: Sequence, dims: str | None = None) -> None:
    """Check that `t` is a floating tensor of shape `expected` (ints, or None for "any").

    `dims` names the axes for the message, e.g. "B,T,H,K".
    """
    label = f"{name} [{dims}]" if dims else name
    if not isinstance(t, torch.Tensor):
        raise XLSTMKitError(f"{label} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise XLSTMKitError(
            f"{label} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}"
        )
    if t.dim() != len(expected) or any(e is not None and e != s for e, s in zip(expected, t.shape)):
        want = shape_str(["*" if e is None else e for e in expected])
        raise XLSTMKitError(f"{label} has shape {shape_str(t.shape)}, expected {want}")


def check_same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise XLSTMKitError(f"all tensors must be on one device, got {desc}")


def compute_dtype(*xs) -> torch.dtype:
    """Internal precision of an op over tensors or dtypes `xs` (None entries are skipped): float64
    when any is float64 (references, gradcheck), float32 otherwise. The one such rule of every op."""
    for x in xs:
        dt = x.dtype if isinstance(x, torch.Tensor) else x
        if dt == torch.float64:
            return torch.float64
    return torch.float32


def check_chunk_size(chunk_size: int, lo: int = 1, hi: int = 1024) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not lo <= chunk_size <= hi:
        raise XLSTMKitError(f"chunk_size must be an integer in [{lo}, {hi}], got {chunk_size!r}")


def autocast_off(fn):
    """Run an op with autocast disabled.

    Every op picks its own internal precision (float32, or float64 for float64 inputs) and
    returns the input dtype; inside a `torch.autocast` region the op's internal matmuls would
    otherwise be recast to bf16 and collide with its float32 accumulators and states.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            for device_type in ("cpu", "cuda"):
                if torch.is_autocast_enabled(device_type):
                    stack.enter_context(torch.autocast(device_type, enabled=False))
            return fn(*args, **kwargs)

    return wrapper
