"""A model's shapes without its values, and the memory check that uses them before anything is
allocated.

`shapes_only()` builds modules on the meta device without running their random initialisation:
on meta tensors it computes nothing, and ``normal_`` there goes through torch's Python reference
implementation, whose first call imports torch._dynamo (2.8 s of the 5 s that loading a model
spent importing, on every `xlstm-kit generate`).

`check_fits` refuses, in one line, a config whose fields are each within bounds but whose
parameters together exceed the memory of the device they would be allocated on (a process that
outgrows the machine's memory is killed by the kernel with a bare "Killed").
"""
from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from ..errors import XLSTMKitError

GIB = 2**30

# what the layers' initialisation calls; each fills its first argument in place
_INITIALISERS = frozenset({
    torch.nn.init.normal_, torch.nn.init.trunc_normal_, torch.nn.init.uniform_, torch.nn.init.constant_,
    torch.nn.init.zeros_, torch.nn.init.ones_, torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_,
    torch.nn.init.kaiming_uniform_, torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_,
    torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_,
})


# factories of the small vectors some layers initialise from (gate biases); on meta tensors the
# arithmetic that follows them imports torch._dynamo and sympy, so they are made on the CPU
_VALUE_FACTORIES = frozenset({torch.linspace, torch.arange, torch.logspace})


class _SkipMetaInit(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_FACTORIES and kwargs.get("device") is None:
            return func(*args, **{**kwargs, "device": "cpu"})
        if func in _INITIALISERS:
            # torch.nn.init passes the tensor by keyword, Tensor methods by position
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def shapes_only():
    """``torch.device("meta")`` with the initialisation of parameters skipped: for models built
    to read their shapes, parameter counts or state_dict keys."""
    with torch.device("meta"), _SkipMetaInit():
        yield


def available_memory() -> int | None:
    """Bytes this process can still allocate on the CPU: MemAvailable of /proc/meminfo, lowered
    by a cgroup (container) limit; None where neither is known (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    cgroup = Path("/sys/fs/cgroup")
    for limit_file, usage_file in (("memory.max", "memory.current"),  # cgroup v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:  # "max" or a huge number: no limit
            found.append(max(0, int(limit) - usage))
        break
    return min(found) if found else None


def device_memory(device: torch.device) -> int | None:
    """Free bytes on ``device`` (None: unknown, or a device that holds no data)."""
    if device.type == "cpu":
        return available_memory()
    if device.type == "cuda" and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError, AssertionError):
            return torch.cuda.mem_get_info(device)[0]
    return None


def format_gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n < 100 * GIB else f"{math.ceil(n / GIB):,} GiB"


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n < GIB else format_gib(n)


def check_fits(n_params: int, dtype: torch.dtype, device: torch.device, what: str) -> None:
    """XLSTMKitError when ``n_params`` parameters of ``dtype`` exceed the free memory of
    ``device``; nothing where that is unknown."""
    free = device_memory(device)
    need = n_params * torch.empty((), dtype=dtype, device="meta").element_size()
    if free is not None and need > free:
        raise XLSTMKitError(
            f"{what} has {n_params:,} parameters: {_size(need)} in {str(dtype).removeprefix('torch.')}, more "
            f"than the {_size(free)} of memory free on {device}; choose a smaller config (d_model, "
            f"n_blocks, vocab_size), or build it under torch.device('meta') to inspect its shapes")
