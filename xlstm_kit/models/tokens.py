"""The token-id check every entry point shares (forward, step, generate)."""
from __future__ import annotations

import torch

from ..errors import XLSTMKitError

# torch has no min/max (nor embedding lookup) for these; their ids would need a lossy cast
_UNSUPPORTED_ID_DTYPES = (torch.uint16, torch.uint32, torch.uint64)


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being recorded on the current stream of t's device."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_token_ids(tokens: torch.Tensor, vocab: int | None, what: str = "tokens") -> None:
    """Integer ids in [0, vocab), compared as Python ints: a uint8 or int8 comparison with the
    vocabulary size would wrap it (256 -> 0)."""
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise XLSTMKitError(f"{what} must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.dtype in _UNSUPPORTED_ID_DTYPES:
        raise XLSTMKitError(f"{what} of dtype {tokens.dtype} are not supported; use int64, int32, int16, "
                            f"int8 or uint8")
    if tokens.numel() == 0:
        return
    if torch.compiler.is_compiling() or capturing(tokens):
        # int() of a device tensor waits for the device, splits the compiled graph and cannot be
        # recorded in a CUDA graph: an asynchronous device-side assertion checks the range instead
        ok = tokens.min().long() >= 0  # as int64: a uint8 comparison with 256 would wrap
        if vocab is not None:
            ok = ok & (tokens.max().long() < vocab)
        torch._assert_async(ok, f"{what} contain negative ids" if vocab is None else
                            f"{what} contain ids outside [0, {vocab - 1}]")
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or (vocab is not None and hi >= vocab):
        bound = f"[0, {vocab - 1}]" if vocab is not None else "[0, vocab_size)"
        known = f" but vocab_size is {vocab}" if vocab is not None else ""
        raise XLSTMKitError(f"{what} contain ids in [{lo}, {hi}]{known}; ids must lie in {bound}")
