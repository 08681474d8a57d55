"""Timing of one callable: CUDA events on the GPU, `time.perf_counter` on the CPU.

Both take a few warm-up calls first (compiles, autotuning, the allocator's first requests) and
report the median of the timed calls: the median resists the outliers that a shared machine
produces, where a mean does not.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class Timing:
    """Median and best milliseconds of `reps` timed calls."""

    median_ms: float
    min_ms: float
    reps: int


@dataclass(frozen=True)
class Budget:
    """How long to warm up and to time. A budget in seconds rather than a fixed count, so that a
    0.1 ms kernel and a 1 s training step both get a stable median in a bounded time."""

    warmup_calls: int = 3
    warmup_s: float = 0.025
    rep_s: float = 0.1
    min_reps: int = 5
    max_reps: int = 1000


QUICK = Budget(warmup_calls=1, warmup_s=0.0, rep_s=0.0, min_reps=2, max_reps=3)

# Bigger than the last-level cache of current GPUs (H100/H200: 50 MiB L2), so that a kernel timed
# after the flush reads its inputs from memory, as it would inside a model.
_FLUSH_BYTES = 256 * 2**20
_flush_buf: dict[torch.device, torch.Tensor] = {}


def _flush_l2(device: torch.device) -> None:
    buf = _flush_buf.get(device)
    if buf is None:
        buf = _flush_buf[device] = torch.empty(_FLUSH_BYTES // 4, dtype=torch.int32, device=device)
    buf.zero_()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reps_for(per_call_s: float, budget: Budget) -> int:
    if per_call_s <= 0:
        return budget.max_reps
    return max(budget.min_reps, min(budget.max_reps, math.ceil(budget.rep_s / per_call_s)))


def measure(fn: Callable[[], Any], device: torch.device | str, budget: Budget = Budget(),
            flush_cache: bool = False) -> Timing:
    """Time `fn()` on `device` (its work must be queued on the current CUDA stream)."""
    device = torch.device(device)
    # warm-up: at least `warmup_calls` calls and at least `warmup_s` seconds
    t0 = time.perf_counter()
    calls = 0
    while calls < budget.warmup_calls or time.perf_counter() - t0 < budget.warmup_s:
        fn()
        _sync(device)
        calls += 1
    per_call = (time.perf_counter() - t0) / calls
    reps = _reps_for(per_call, budget)
    if device.type == "cuda":
        return _measure_cuda(fn, device, reps, flush_cache)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return Timing(statistics.median(times), min(times), reps)


def _measure_cuda(fn, device: torch.device, reps: int, flush_cache: bool) -> Timing:
    with torch.cuda.device(device):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            if flush_cache:
                _flush_l2(device)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
    times = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(times), min(times), reps)


def timed_call(fn: Callable[[], Any], device: torch.device | str) -> tuple[Any, float]:
    """(fn(), milliseconds): CUDA events around the call on a GPU (synchronised after), the
    wall clock elsewhere. For whole training steps, one timing each; `measure` for kernels."""
    device = torch.device(device)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn()
        b.record()
        torch.cuda.synchronize(device)
        return out, a.elapsed_time(b)
    t = time.perf_counter()
    out = fn()
    return out, 1e3 * (time.perf_counter() - t)


def peak_memory_mib(fn: Callable[[], Any], device: torch.device | str) -> float | None:
    """Memory allocated by one call of `fn` beyond what was allocated before it, in MiB
    (CUDA only: None on the CPU, where PyTorch keeps no such counter)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def measure_case(fwd: Callable[[], Any], fwbw: Callable[[], Any] | None, device: torch.device | str,
                 budget: Budget = Budget(), flush_cache: bool = False) -> dict[str, float | int | None]:
    """Forward (and forward+backward) medians, best times and the peak memory of the main mode
    (fwd+bwd when given): the one measurement shared by our cases and the peers' child processes."""
    out: dict[str, float | int | None] = {}
    t = measure(fwd, device, budget, flush_cache)
    out.update(fwd_ms=t.median_ms, fwd_min_ms=t.min_ms, reps=t.reps)
    main = fwd
    if fwbw is not None:
        t = measure(fwbw, device, budget, flush_cache)
        out.update(fwbw_ms=t.median_ms, fwbw_min_ms=t.min_ms)
        main = fwbw
    out["peak_mib"] = peak_memory_mib(main, device)
    return out
