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
    r_resident: load the program's R_g tiles once before the time loop (the compiler keeps them
        in shared memory) instead of once per step.
    k_chunk: K chunk of the recurrent matmul; None: the whole head at once (h_{t-1} stays in
        registers) when one program holds the head, 64 (or the largest power of two dividing D)
        when the head is split. A chunk smaller than the head routes h_{t-1} through a scratch.
    prefetch: load the next step's inputs one step ahead.
    block_b: batch entries per program, the N side of the step's matmul (a power of two >= 16).
    block_u: units of the head per program; None: the whole head (padded to a power of two).
        Smaller than the head, the head's units are split over P = ceil(D / block_u) programs
        that exchange h (forward) or δg̃ (backward) through global memory each step, with a
        barrier among the P programs: the launcher refuses a grid that does not fit on the GPU
        at once (one program per SM), since a barrier with a program not yet running never ends.
    """
    num_warps: int
    r_resident: bool
    k_chunk: Optional[int] = None
    prefetch: bool = True
    block_b: int = 16
    block_u: Optional[int] = None
    # the forward's four gates as one stacked operand of M = 4·BU rows (see forward._matvec)
    stack_gates: bool = False
    # the backward exchanges partial sums of δh (M = D products) instead of δg̃ (see
    # backward._dh_by_partials)
    bwd_partials: bool = False

    def __post_init__(self):
        if not _pow2(self.num_warps):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps!r}")
        if not all(isinstance(v, bool) for v in (self.r_resident, self.prefetch, self.stack_gates,
                                                 self.bwd_partials)):
            raise ValueError("r_resident, prefetch, stack_gates and bwd_partials must be bool")
        if self.k_chunk is not None and not (_pow2(self.k_chunk) and self.k_chunk >= 16):
            raise ValueError(f"k_chunk must be None or a power of two >= 16, got {self.k_chunk!r}")
        if not (_pow2(self.block_b) and self.block_b >= 16):
            raise ValueError(f"block_b must be a power of two >= 16, got {self.block_b!r}")
        if self.block_u is not None and not (_pow2(self.block_u) and self.block_u >= 16):
            raise ValueError(f"block_u must be None or a power of two >= 16, got {self.block_u!r}")


def block_d(dim: int) -> int:
    """The head padded to a power of two (at least 16, the MMA minimum)."""
    return max(16, triton.next_power_of_2(dim))


@dataclasses.dataclass(frozen=True)
class Launch:
    """A configuration resolved for one head size: BU units per program, P programs per head
    (P > 1: the barrier), K chunks of KC (NKC of them), `scratch`: h_{t-1} / δg̃_t are read back
    from memory in chunks instead of kept in registers."""
    bu: int
    p: int
    kc: int
    nkc: int
    scratch: bool


def launch(config: SLSTMKernelConfig, dim: int) -> Launch:
    bd = block_d(dim)
    bu = bd if config.block_u is None else min(config.block_u, bd)
    p = triton.cdiv(dim, bu)
    if config.k_chunk is not None:
        kc = min(bd, config.k_chunk)
    elif p == 1:
        kc = bd
    else:
        # The largest power of two up to 64 that divides D: no padded K columns (D = 192: 64).
        kc = next((k for k in (64, 32, 16) if dim % k == 0 and k <= bd), min(bd, 64))
    return Launch(bu, p, kc, triton.cdiv(dim, kc), p > 1 or kc < bd)


def flags(batch: int, dim: int, bt: int, lc, varlen: bool = False) -> dict:
    """The EVEN flags of a launch (`config.Launch` lc): no mask on a state tile (batch and
    units), on R tiles (units and K), on h / δg̃ K chunks (batch and K). Packed sequences
    (varlen) mask every step's tiles by the columns still running: EVEN and EVEN_HK False."""
    even_b, even_u, even_k = batch % bt == 0 and not varlen, dim % lc.bu == 0, dim % lc.kc == 0
    return dict(EVEN=even_b and even_u, EVEN_D=even_u and even_k, EVEN_HK=even_b and even_k)


def grid_of(batch: int, heads: int, bt: int, lc, sms) -> tuple:
    grid = (lc.p, triton.cdiv(batch, bt), heads)
    if lc.p > 1 and (sms is None or grid[0] * grid[1] * grid[2] > sms):
        # A program spinning at the barrier for one that cannot start would never return.
        raise ValueError(f"sLSTM split head: grid {grid} needs {lc.p * grid[1] * heads} programs "
                         f"at once, the device has {sms} SMs; use block_u=None or a larger block_u")
    return grid


def fits(config: SLSTMKernelConfig, dim: int, batch: int, heads: int, sms: Optional[int]) -> bool:
    """Whether a split head's grid runs all at once: one program per SM."""
    p = launch(config, dim).p
    return p == 1 or (sms is not None and triton.cdiv(batch, config.block_b) * heads * p <= sms)


def _r_bytes(dim: int, bu: int, mm: int) -> int:
    """Shared memory of a program's resident R_g tiles (four gates, D inputs x BU outputs)."""
    return 4 * triton.cdiv(dim, 16) * 16 * bu * 2 * (2 if mm == 2 else 1)


@functools.lru_cache(maxsize=None)  # called per launch; the config is frozen
def default_config(dim: int, mm: int = 1, batch: Optional[int] = None, heads: Optional[int] = None,
                   sms: Optional[int] = None) -> SLSTMKernelConfig:
    """Launch choices by head size, matmul mode (see `common._mm`) and, when all three are
    given, the batch, head count and the GPU's SM count.

    Heads above 64 units are split over P programs of `block_u` units that keep their slice of
    R resident, when the whole grid fits on the GPU (one program per SM); otherwise, and for
    D <= 64, one program per head: R resident up to D = 128 in bf16 (64 for split float32
    weights, the 2026-11-30 H200 table), else K chunks streamed from L2.
    """
    bd = block_d(dim)
    if mm == 0:  # float64 (or the interpreter): no tensor cores, keep tiles small
        return SLSTMKernelConfig(num_warps=4, r_resident=bd <= 32, k_chunk=None if bd <= 32 else 32)
    if bd <= 32 or (bd <= 64 and mm == 1):
        return SLSTMKernelConfig(num_warps=4, r_resident=True)
    if bd <= 64:
        return SLSTMKernelConfig(num_warps=8, r_resident=True)
    whole = SLSTMKernelConfig(num_warps=8, r_resident=True, prefetch=False) if bd <= 128 and mm == 1 \
        else SLSTMKernelConfig(num_warps=8 if bd <= 128 else 16, r_resident=False, k_chunk=64)
    if batch is None or heads is None or sms is None:
        return whole
    # Split: the smallest unit block (most programs, least work each: fastest measured, D = 192
    # and 128 on the H200, docs/kernels.md, "sLSTM") whose grid fits on the GPU at once. The four
    # gates stacked into one operand (wgmma of M = 4·BU): forward 8.8 → 5.4 ms at (16, 2048, 4,
    # 192) on the H100 with bf16 R, 9.6 → 6.1 with float32 R (a model's weights under autocast).
    # The backward exchanges partial sums of δh: forward + backward 20.8 → 15.9 ms at (16, 2048,
    # 4, 192), 22.4 → 17.7 with float32 R, 8.9 → 7.0 at (16, 1024, 4, 128) (H100, 2026-12-07).
    for bu in (16, 32, 64):
        if bu >= bd:
            continue
        cfg = SLSTMKernelConfig(num_warps=4, r_resident=_r_bytes(dim, bu, mm) <= 160 * 1024,
                                block_u=bu, stack_gates=True, bwd_partials=True)
        if fits(cfg, dim, batch, heads, sms):
            return cfg
    return whole


def resolve(key: str, dim: int, mm: int, batch: Optional[int] = None, heads: Optional[int] = None,
            sms: Optional[int] = None) -> SLSTMKernelConfig:
    """The configuration a custom op received as `key` ("" means `default_config`)."""
    return default_config(dim, mm, batch, heads, sms) if not key else SLSTMKernelConfig.from_key(key)
