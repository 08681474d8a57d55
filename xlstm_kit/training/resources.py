"""CPU resources of a run: how many threads to use, and whether a model and its batches fit in
memory before anything large is allocated (a process that outgrows the machine's memory is
killed by the kernel with a bare "Killed" and no checkpoint).

The memory model is a rough upper estimate for the pure-PyTorch CPU path, measured on this
library's models (float32, 2026-12-01, ru_maxrss of one training step at several sizes):

- weights, gradients and the two AdamW moments: 16 bytes per parameter;
- training activations: about 225 * d_model bytes per token and block (the CPU path keeps
  several intermediate tensors of the up-projected width for the backward pass);
- the language-model head: about 12 * vocab_size bytes per token (logits, their softmax and
  its gradient, float32);
- evaluation under no_grad: 8 * vocab_size + 200 * d_model bytes per token in flight.
"""
from __future__ import annotations

import contextlib
import os

import torch

from ..errors import XLSTMKitError
from ..models.meta import GIB, available_memory, format_gib, shapes_only  # noqa: F401 - part of this module's API
from ..models.xlstm import XLSTMLanguageModel

# Interpreter, torch and allocator overhead that exists whatever the model (measured ~0.3 GiB).
_BASE_BYTES = int(0.4 * GIB)
_TRAIN_BYTES_PER_TOKEN_BLOCK_D = 225
_TRAIN_BYTES_PER_TOKEN_VOCAB = 12
_EVAL_BYTES_PER_TOKEN_VOCAB = 8
_EVAL_BYTES_PER_TOKEN_D = 200


# --------------------------------------------------------------------------------------------
# Threads
# --------------------------------------------------------------------------------------------


def auto_threads(cpus: int, load: float, torch_default: int) -> int:
    """Intra-op threads for a CPU run on a machine with ``cpus`` logical CPUs and a one-minute
    load average ``load``: the cores other processes leave free, at least 1, at most torch's
    own choice.

    A thread that shares its core with another busy process is descheduled for whole time
    slices, and every one of the model's many small operators waits at a barrier for it: on a
    2-core machine with one core busy, 20 training steps took 68 s with 2 threads, 7 s with 1.
    """
    free = int(cpus - load + 0.5)
    return max(1, min(torch_default, free))


def default_threads(torch_default: int) -> int | None:
    """:func:`auto_threads` for this machine now, or None to keep torch's choice: when the
    user set ``OMP_NUM_THREADS`` (torchrun sets it for several processes per node), or where
    the load average is unknown."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on Windows
        return None
    return auto_threads(os.cpu_count() or 1, load, torch_default)


def torch_default_threads() -> bool:
    """Whether torch's intra-op thread count is still the one it chose itself: no OMP_NUM_THREADS
    or MKL_NUM_THREADS, and equal to its inter-op count, which torch sets to the same default
    (the physical cores) and which cannot be changed once used. A torch.set_num_threads(n) to
    that very default cannot be told apart."""
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return False
    return torch.get_num_threads() == torch.get_num_interop_threads()


@contextlib.contextmanager
def cpu_threads(device: torch.device, threads: int | str | None = "auto"):
    """torch's CPU threads for a block (``train(threads=...)``), restored after it: an int,
    "auto" (:func:`default_threads` on the CPU while torch's setting is its own default, see
    :func:`torch_default_threads`) or None (no change)."""
    if not (threads is None or threads == "auto" or (isinstance(threads, int) and not isinstance(threads, bool)
                                                     and threads >= 1)):
        raise XLSTMKitError(f"threads must be 'auto', None or a positive integer, got {threads!r}")
    before = torch.get_num_threads()
    n = threads if isinstance(threads, int) else None
    if threads == "auto" and device.type == "cpu" and torch_default_threads():
        n = default_threads(before)
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------


def count_parameters(config) -> int:
    """Parameters of ``XLSTMLanguageModel(config)``, counted on the meta device (no memory)."""
    with shapes_only():
        return sum(p.numel() for p in XLSTMLanguageModel(config).parameters())


def training_bytes(config, n_params: int, micro_batch: int, seq_len: int) -> int:
    """Estimated peak memory of float32 training on the CPU: ``micro_batch`` sequences of
    ``seq_len`` tokens per forward/backward pass (batch / grad_accum)."""
    tokens = micro_batch * seq_len
    per_token = (_TRAIN_BYTES_PER_TOKEN_BLOCK_D * config.d_model * config.n_blocks
                 + _TRAIN_BYTES_PER_TOKEN_VOCAB * config.vocab_size)
    return _BASE_BYTES + 16 * n_params + tokens * per_token


def evaluation_bytes(config, n_params: int, batch: int, seq_len: int) -> int:
    """Estimated peak memory of evaluating ``batch`` windows of ``seq_len`` tokens (float32,
    no gradients; the weights twice while a checkpoint is read)."""
    per_token = _EVAL_BYTES_PER_TOKEN_VOCAB * config.vocab_size + _EVAL_BYTES_PER_TOKEN_D * config.d_model
    return _BASE_BYTES + 8 * n_params + batch * seq_len * per_token


def largest_batch(bytes_for_batch, limit: int, start: int) -> int:
    """Largest b in [0, start) with ``bytes_for_batch(b) <= limit`` (0: none fits); the estimate
    grows with b."""
    lo, hi = 0, start - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if bytes_for_batch(mid) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return lo
