"""The one place that decides which backend runs an op.

Every op with a Triton kernel is listed in `KERNEL_MODULES`; its module answers one question,
`supports(op, **facts) -> str | None`: None when its kernel takes the call, otherwise a one-line
reason. The public ops pass the facts that matter to their kernels (dtype, head dims, chunk
size, whether a gradient is needed) to `choose_backend`:

- `backend=None` picks "triton" for CUDA tensors when the kernel module imports (Triton is
  installed) and supports the call, and "torch" otherwise;
- `backend="triton"` returns "triton" or raises `BackendUnavailableError` with the reason; on CPU
  tensors it is allowed under `TRITON_INTERPRET=1` (that is how CI tests the kernels);
- `backend="torch"` always runs the PyTorch path.

Kernel modules are imported on first use, so `import xlstm_kit` never needs Triton.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

from ..errors import XLSTMKitError

BACKENDS = ("torch", "triton")

# op name -> the module holding its Triton kernel and its `supports` answer.
KERNEL_MODULES: dict[str, str] = {
    "mlstm_chunkwise": "xlstm_kit.ops.mlstm.triton.op",
    "mlstm_step": "xlstm_kit.ops.mlstm.triton.step",
    "slstm_recurrent": "xlstm_kit.ops.slstm.triton.op",
    "slstm_step": "xlstm_kit.ops.slstm.triton.step",
    "dplr_chunkwise": "xlstm_kit.ops.dplr.triton.op",
    "kda_chunkwise": "xlstm_kit.ops.dplr.triton.kda_op",
    "dplr_step": "xlstm_kit.ops.dplr.triton.step",
    "mlstm_output": "xlstm_kit.ops.blocks.triton",
    "conv_silu": "xlstm_kit.ops.blocks.triton",
    "mlstm_front": "xlstm_kit.ops.blocks.mlstm_front",
    "head_norm": "xlstm_kit.ops.blocks.triton",
    "gated_head_norm": "xlstm_kit.ops.blocks.triton",
    "swiglu": "xlstm_kit.ops.blocks.swiglu",
    "mlstm_block_step": "xlstm_kit.ops.blocks.decode",
    "slstm_block_step": "xlstm_kit.ops.blocks.slstm_decode",
    "large_block_step": "xlstm_kit.ops.blocks.large_decode",
}


class BackendUnavailableError(XLSTMKitError):
    """Raised when a backend is forced that cannot run the op here (a bad argument for this
    machine or these inputs, hence a ValueError)."""


def triton_available() -> bool:
    # sys.modules first: torch.compile traces it, not importlib
    return "triton" in sys.modules or importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_module(op: str) -> ModuleType | None:
    """The imported kernel module of `op`, or None (no kernel, or Triton is not installed)."""
    name = KERNEL_MODULES.get(op)
    if name is None or not triton_available():
        return None
    # an imported module is looked up, not imported again: torch.compile traces the lookup but
    # not importlib (a graph break)
    module = sys.modules.get(name)
    return module if module is not None else importlib.import_module(name)


def choose_backend(op: str, backend: str | None, device: torch.device, inputs=(), **facts) -> str:
    """Return "torch" or "triton" for `op` on `device`, or raise a clear error (see module doc).

    `inputs`: the op's tensors (None entries skipped); under TRITON_INTERPRET=1 on CPU a bfloat16
    one is refused, since the interpreter computes bfloat16 wrongly (silently)."""
    if backend is not None and backend not in BACKENDS:
        raise XLSTMKitError(f"backend must be None, 'torch' or 'triton', got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend is None and device.type != "cuda":
        return "torch"
    if op not in KERNEL_MODULES:
        if backend is None:
            return "torch"
        raise BackendUnavailableError(
            f"{op} has no Triton kernel; use backend='torch' (or None to choose automatically)")
    has_module, reason = _kernel_answer(op, **facts)
    if not has_module:
        if backend is None:
            return "torch"
        raise BackendUnavailableError(f"backend='triton' for {op} needs the 'triton' package")
    if backend is None:
        return "torch" if reason else "triton"
    if device.type != "cuda" and not interpreting():
        raise BackendUnavailableError(
            f"backend='triton' for {op} needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {device}")
    if reason:
        raise BackendUnavailableError(f"backend='triton' for {op}: {reason}")
    if device.type != "cuda" and any(x is not None and x.dtype == torch.bfloat16 for x in inputs):
        raise BackendUnavailableError(
            f"backend='triton' for {op}: the Triton interpreter (TRITON_INTERPRET=1) computes "
            "bfloat16 wrongly; pass float16/float32 inputs or use backend='torch'")
    return "triton"


def assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without importing torch._dynamo, which took 2.8 s
    of the 5 s that `xlstm-kit generate` spent importing: Dynamo's decorator only marks the
    function (tests/test_import_graph.py checks that it still does), and Dynamo is imported
    anyway by the time anything compiles."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _kernel_answer(op: str, **facts) -> tuple[bool, str | None]:
    """(whether `op`'s kernel module imports, its `supports` answer); a constant to
    torch.compile, which cannot trace the import."""
    module = kernel_module(op)
    return (False, None) if module is None else (True, module.supports(op, **facts))


def on_device(t: torch.Tensor):
    """Context for launching a Triton kernel on `t`: Triton launches on the *current* CUDA device,
    which need not be the tensor's (a model on cuda:1 in a process whose current device is cuda:0
    fails with "Pointer argument cannot be accessed from Triton"). The autograd engine already
    switches devices for the backward, so only the forward entry points need this."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
