"""The one place that decides which backend runs an op.

`backend=None` picks "triton" for CUDA tensors when Triton and a kernel for that op exist, and
"torch" otherwise. Forcing "triton" on CPU tensors is allowed under `TRITON_INTERPRET=1` (that is
how CI tests the kernels).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

BACKENDS = ("torch", "triton")

# Ops that have a Triton kernel. Each kernel module adds its op name here when it is written.
TRITON_OPS: set[str] = set()


class BackendUnavailableError(RuntimeError):
    """Raised when a backend is forced that cannot run the op here."""


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def choose_backend(op: str, backend: str | None, device: torch.device) -> str:
    """Return "torch" or "triton" for `op` on `device`, or raise a clear error."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    has_kernel = op in TRITON_OPS and triton_available()
    if backend is None:
        return "triton" if (device.type == "cuda" and has_kernel) else "torch"
    if backend == "triton":
        if op not in TRITON_OPS:
            raise BackendUnavailableError(
                f"{op} has no Triton kernel yet; use backend='torch' (or None to choose automatically)"
            )
        if not triton_available():
            raise BackendUnavailableError(f"backend='triton' for {op} needs the 'triton' package")
        if device.type != "cuda" and not interpreting():
            raise BackendUnavailableError(
                f"backend='triton' for {op} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {device}"
            )
    return backend


def on_device(t: torch.Tensor):
    """Context for launching a Triton kernel on `t`: Triton launches on the *current* CUDA device,
    which need not be the tensor's (a model on cuda:1 in a process whose current device is cuda:0
    fails with "Pointer argument cannot be accessed from Triton"). The autograd engine already
    switches devices for the backward, so only the forward entry points need this."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()

