"""Input checks shared by every op: one vocabulary of error messages.

Every public op validates its arguments here before dispatching, so that a wrong shape or dtype
fails with a `ValueError` that names the tensor and the expected shape instead of a broadcast
error deep inside a kernel.
"""
from __future__ import annotations

import contextlib
import contextvars
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
    if t.device.type == "meta":
        raise XLSTMKitError(f"{label} is on the meta device (no data); the ops need real tensors")
    if t.dtype not in FLOAT_DTYPES:
        raise XLSTMKitError(
            f"{label} must be a floating tensor (float16, bfloat16, float32 or float64), got {t.dtype}"
        )
    if t.dim() != len(expected) or any(e is not None and e != s for e, s in zip(expected, t.shape)):
        want = shape_str(["*" if e is None else e for e in expected])
        raise XLSTMKitError(f"{label} has shape {shape_str(t.shape)}, expected {want}")


def check_head_dim(label: str, size: int) -> None:
    """A head dimension of 0 has no meaning (the ops scale by 1/√K); refuse it by name."""
    if size < 1:
        raise XLSTMKitError(f"{label} must be at least 1, got {size}")


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


# A log-gate (log forget / log decay) this low closes the gate for every purpose: it weighs the
# past by e^-250 (0 in float32, 1e-109 in float64). -inf means the same closed gate, but the
# chunkwise forms subtract cumulative sums (-inf - -inf = NaN); one clamp gives them the
# recurrent reference's answer. Not lower: a float32 in-chunk cumulative sum after a closed gate
# keeps ~1e-5 absolute accuracy at this magnitude.
LOG_GATE_FLOOR = -250.0


def floor_log_gate(x: torch.Tensor, floor: float = LOG_GATE_FLOOR) -> torch.Tensor:
    """x with values below `floor` (-inf included) raised to it: one elementwise op, no host
    sync; NaN stays NaN; the gradient is 0 where the gate was clamped (a closed gate)."""
    return x.clamp_min(floor)


def check_chunk_size(chunk_size: int, lo: int = 1, hi: int = 1024) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or not lo <= chunk_size <= hi:
        raise XLSTMKitError(f"chunk_size must be an integer in [{lo}, {hi}], got {chunk_size!r}")


def autocast_off(fn):
    """Run an op with autocast disabled.

    Every op picks its own internal precision (float32, or float64 for float64 inputs) and
    returns the input dtype; inside a `torch.autocast` region the op's internal matmuls would
    otherwise be recast to bf16 and collide with its float32 accumulators and states.
    """

    # plain nested `with` blocks: torch.compile cannot trace an ExitStack holding autocast
    # contexts (a graph break in every compiled block under bf16 autocast)
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_autocast_enabled("cuda"):
            with torch.autocast("cuda", enabled=False):
                if torch.is_autocast_enabled("cpu"):
                    with torch.autocast("cpu", enabled=False):
                        return fn(*args, **kwargs)
                return fn(*args, **kwargs)
        if torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper



def backward_autocast_off(backward):
    """Run an op's hand-written `autograd.Function.backward` with autocast disabled.

    Eagerly a backward runs where `loss.backward()` is called, usually outside autocast. Under
    torch.compile it does not: AOT autograd traces the backward together with the forward, under
    the forward's ambient autocast, while Dynamo, tracing the backward inside the op's
    `autocast_off` region, sees autocast off and records no context of its own. So the region is
    entered here unconditionally, for the device of the incoming gradients.
    """

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        device = next((g.device.type for g in grads if isinstance(g, torch.Tensor)), None)
        if device is None:
            return backward(ctx, *grads)
        with torch.autocast(device, enabled=False):
            return backward(ctx, *grads)

    return wrapper

# ----------------------------------------------------------------------------- varlen (cu_seqlens)
# (cu_seqlens, its boundaries) read back by the innermost `cu_seqlens_read_once` in progress
_READ = contextvars.ContextVar("xlstm_kit_cu_seqlens_read", default=None)


def read_cu_seqlens(cu_seqlens: torch.Tensor) -> list[int]:
    """The values of cu_seqlens as Python ints: one host sync on an accelerator."""
    return cu_seqlens.tolist()


@contextlib.contextmanager
def cu_seqlens_read_once(cu_seqlens: torch.Tensor, bounds: list[int]):
    """Within: `check_cu_seqlens` takes `bounds` (already read from this very tensor and
    validated) instead of reading it again.

    A model passes one cu_seqlens to every layer's ops; each reading it back would be a device
    sync per layer. Nothing else is cached: a tensor carries no sign of a write through numpy or
    `.data` (its version counter stays), so outside such a call every check reads the values
    the tensor holds then (on CPU a read and check of a few boundaries costs microseconds)."""
    token = _READ.set((cu_seqlens, bounds))
    try:
        yield
    finally:
        _READ.reset(token)


def check_cu_seqlens(cu_seqlens, batch: int, total: int, device) -> list[int]:
    """Validate `cu_seqlens` (cumulative sequence lengths, as in FlashAttention's varlen API) for
    inputs of batch `batch` and length `total`; return the boundaries as Python ints [N+1].

    cu_seqlens: int32/int64 1-D tensor [N+1], 0 = cu[0] < cu[1] < ... < cu[N] = total; sequence n
    is steps cu[n]:cu[n+1] of the one packed batch row. Reading the values back is one host
    sync per call (per model call inside `cu_seqlens_read_once`).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise XLSTMKitError(f"cu_seqlens must be a 1-D int32/int64 torch.Tensor [N+1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise XLSTMKitError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise XLSTMKitError(f"cu_seqlens must be 1-D with at least 2 entries [N+1], got shape {shape_str(cu_seqlens.shape)}")
    if cu_seqlens.device.type == "meta":
        raise XLSTMKitError("cu_seqlens is on the meta device (no data); the boundaries must be real values")
    if torch.device(device).type != cu_seqlens.device.type:
        raise XLSTMKitError(f"cu_seqlens is on {cu_seqlens.device} but the inputs are on {device}")
    if batch != 1:
        raise XLSTMKitError(f"with cu_seqlens the inputs hold the sequences packed in one batch row (B = 1), got B = {batch}")
    read = _READ.get()
    if read is not None and read[0] is cu_seqlens and read[1][-1] == total:
        return read[1]
    bounds = read_cu_seqlens(cu_seqlens)
    if bounds[0] != 0:
        raise XLSTMKitError(f"cu_seqlens must start at 0, got {bounds[0]}")
    bad = next((n for n in range(len(bounds) - 1) if bounds[n + 1] <= bounds[n]), None)
    if bad is not None:
        raise XLSTMKitError(f"cu_seqlens must be strictly increasing (every sequence has length >= 1), "
                            f"got cu_seqlens[{bad}] = {bounds[bad]} and cu_seqlens[{bad + 1}] = {bounds[bad + 1]}")
    if bounds[-1] != total:
        raise XLSTMKitError(f"cu_seqlens must end at the total length T = {total}, got {bounds[-1]}")
    return bounds


def check_varlen_state(state, n_seq: int, name: str = "initial_state") -> None:
    """With cu_seqlens, every tensor of a state has one row per sequence: batch N, not 1."""
    for s in (state if isinstance(state, (tuple, list)) else (state,)):
        if isinstance(s, torch.Tensor) and (s.dim() == 0 or s.shape[0] != n_seq):
            raise XLSTMKitError(f"with cu_seqlens of {n_seq} sequences, {name} needs {n_seq} rows (one per "
                                f"sequence), got a tensor of shape {shape_str(s.shape)}")


def run_varlen(op, seqs, bounds: list[int], initial_state, output_final_state: bool):
    """Run `op(*seq_slices, initial_state=..., output_final_state=...)` on each packed sequence
    and join: outputs concatenated along T, final states stacked along the batch (N rows).

    seqs: tensors [1, T, ...]; initial_state: None, a tensor [N, ...] or a tuple of such. A
    Python loop over sequences, so nothing crosses a boundary and autograd gives the exact
    gradients; the torch path (and the Triton ops without native varlen kernels) use it.
    """
    outs, finals = [], []
    for n in range(len(bounds) - 1):
        a, b = bounds[n], bounds[n + 1]
        if initial_state is None:
            s0 = None
        elif isinstance(initial_state, torch.Tensor):
            s0 = initial_state[n:n + 1]
        else:
            s0 = tuple(s[n:n + 1] for s in initial_state)
        out, fin = op(*(x[:, a:b] for x in seqs), initial_state=s0, output_final_state=output_final_state)
        outs.append(out)
        finals.append(fin)
    out = torch.cat(outs, dim=1)
    if not output_final_state:
        return out, None
    if isinstance(finals[0], torch.Tensor):
        return out, torch.cat(finals, dim=0)
    return out, tuple(torch.cat(parts, dim=0) for parts in zip(*finals))
