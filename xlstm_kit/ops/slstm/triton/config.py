"""Launch configuration of the sLSTM kernels (forward and backward take the same one)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import triton

from ..._config import KernelConfig


def _pow2(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class SLSTMKernelConfig(KernelConfig):
    """Launch choices of the fused sLSTM kernels.

    num_warps: warps per program.
    r_resident: load the four R_g tiles once before the time loop (the compiler keeps them in
        shared memory or registers) instead of once per step.
    k_chunk: K chunk of the recurrent matmul; None runs the whole head at once (h_{t-1} stays in
        registers), a chunk smaller than the head routes h_{t-1} through an L1-resident scratch.
    prefetch: load the next step's inputs one step ahead.
    block_b: batch entries per program, the N side of the step's matmul (a power of two >= 16).
    """
    num_warps: int
    r_resident: bool
    k_chunk: Optional[int] = None
    prefetch: bool = True
    block_b: int = 16

    def __post_init__(self):
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not isinstance(self.r_resident, bool) or not isinstance(self.prefetch, bool):
            raise ValueError("r_resident and prefetch must be bool")
        if self.k_chunk is not None and not (_pow2(self.k_chunk) and self.k_chunk >= 16):
            raise ValueError(f"k_chunk must be None or a power of two >= 16, got {self.k_chunk!r}")
        if not (_pow2(self.block_b) and self.block_b >= 16):
            raise ValueError(f"block_b must be a power of two >= 16, got {self.block_b!r}")


def block_d(dim: int) -> int:
    """The tile height: the head dim padded to a power of two (at least 16, the MMA minimum)."""
    return max(16, triton.next_power_of_2(dim))


def k_chunk(config: SLSTMKernelConfig, bd: int) -> int:
    return bd if config.k_chunk is None else min(bd, config.k_chunk)


@functools.lru_cache(maxsize=None)  # called per launch; the config is frozen
def default_config(dim: int, mm: int = 1) -> SLSTMKernelConfig:
    """Launch choices by head size and matmul mode (see `common._mm`).

    All four R_g stay in shared memory up to D = 128 for bf16 weights (128 KiB), up to D = 64
    when they are split in two (float32/float16 weights); larger heads take the K-chunked path.
    bf16 D = 64 and D = 128 are the fastest variants measured on the H200 (2026-11-30,
    benchmarks/results/2026-11-30-h200-slstm.md); the rest follow the sm_90 register reports.
    """
    bd = block_d(dim)
    if mm == 0:  # float64 (or the interpreter): no tensor cores, keep tiles small
        return SLSTMKernelConfig(num_warps=4, r_resident=bd <= 32, k_chunk=None if bd <= 32 else 32)
    if bd <= 32 or (bd <= 64 and mm == 1):
        return SLSTMKernelConfig(num_warps=4, r_resident=True)
    if bd <= 64:
        return SLSTMKernelConfig(num_warps=8, r_resident=True)
    if bd <= 128 and mm == 1:
        return SLSTMKernelConfig(num_warps=8, r_resident=True, prefetch=False)
    if bd <= 128:
        return SLSTMKernelConfig(num_warps=8, r_resident=False, k_chunk=64)
    return SLSTMKernelConfig(num_warps=16, r_resident=False, k_chunk=64)


def resolve(key: str, dim: int, mm: int) -> SLSTMKernelConfig:
    """The configuration a custom op received as `key` ("" means `default_config`)."""
    return default_config(dim, mm) if not key else SLSTMKernelConfig.from_key(key)
