"""Tile sizes, warps and pipeline depths of the chunkwise mLSTM kernels, and their numerics."""
from __future__ import annotations

import dataclasses
import functools

import torch

from ..._config import KernelConfig
from ._common import pow2

CHUNK_SIZES = (16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class MLSTMKernelConfig(KernelConfig):
    """Launch parameters of the chunkwise mLSTM kernels; `tuned(K, V, dtype, chunk)` gives the
    H200 defaults (docs/kernels.md, "mLSTM chunkwise"). The field defaults are those of K = V = 128,
    bfloat16, chunk 64. Results do not depend on any field beyond rounding.

    Per kernel (prefix): `*_bk`, `*_bv` tile sizes along K and V, `*_warps`, `*_stages`.
    """
    chunk: int = 64                 # chunk length L of forward and backward (16, 32, 64, 128)
    states_bk: int = 64             # _fwd_states (sequential forward state passing)
    states_bv: int = 64
    states_warps: int = 4
    states_stages: int = 3
    out_bk: int = 128               # _fwd_out
    out_bv: int = 128
    out_warps: int = 4
    out_stages: int = 2
    dstates_bk: int = 64            # _bwd_dstates (sequential backward state passing)
    dstates_bv: int = 64
    dstates_warps: int = 4
    dstates_stages: int = 3
    fused_max_k: int = 128          # _bwd_fused when pow2(K) <= this, else _bwd_dqk + _bwd_dv
    fused_bv: int = 64
    fused_warps: int = 8
    fused_stages: int = 3
    dqk_bk: int = 64                # _bwd_dqk
    dqk_bv: int = 32
    dqk_warps: int = 4
    dqk_stages: int = 1
    dv_bk: int = 64                 # _bwd_dv
    dv_bv: int = 128
    dv_warps: int = 8
    dv_stages: int = 2
    # State passing: True = parallel local terms + scan over chunks, False = the sequential
    # kernels, "auto" = the scan where the sequential kernels would be latency-bound (see
    # scan.use_scan).
    seq_scan: bool | str = "auto"
    local_bk: int = 64              # _fwd_local, _bwd_local
    local_bv: int = 64
    local_warps: int = 4
    # _state_scan: scan_be state elements per program (4 per lane of scan_warps warps keeps
    # a thread's scan_g chunks in its own registers: no shuffles), scan_g chunks per step
    scan_be: int = 128
    scan_g: int = 16
    scan_warps: int = 1
    # steps per block of _gate_tail; 0 = by shape (see gates.gate_tail)
    tail_bt: int = 0
    # True: the forward keeps no chunk states [B,H,NC,K,V] for the backward, which runs the
    # forward state passing again (one more _fwd_states launch; same values)
    recompute_states: bool = False

    def __post_init__(self):
        if self.chunk not in CHUNK_SIZES:
            raise ValueError(f"chunk must be one of {CHUNK_SIZES}, got {self.chunk!r}")
        if self.seq_scan not in (True, False, "auto"):
            raise ValueError(f"seq_scan must be True, False or 'auto', got {self.seq_scan!r}")
        for fld in dataclasses.fields(self):
            val = getattr(self, fld.name)
            if fld.name.endswith(("_bk", "_bv", "_be", "_g")) and not (
                    isinstance(val, int) and val >= 1 and val & (val - 1) == 0):
                raise ValueError(f"{fld.name} must be a power of two, got {val!r}")
            if fld.name.endswith(("_warps", "_stages")) and not (isinstance(val, int) and val >= 1):
                raise ValueError(f"{fld.name} must be a positive integer, got {val!r}")
        if not isinstance(self.recompute_states, bool):
            raise ValueError(f"recompute_states must be True or False, got {self.recompute_states!r}")
        if self.tail_bt and self.tail_bt & (self.tail_bt - 1):
            raise ValueError(f"tail_bt must be 0 or a power of two, got {self.tail_bt!r}")

    @classmethod
    def tuned(cls, K: int, V: int, dtype: torch.dtype, chunk: int = 64) -> "MLSTMKernelConfig":
        """The defaults for head dims K, V, input dtype and chunk length, chosen on the H200
        (spill-free for sm_90 at the benchmark shapes). The deeper pipelines and wide tiles of
        bfloat16 at chunk ≤ 64 need more shared memory than the H200 has with float32 tiles
        (float32 inputs, or the float32 states of float16 inputs) or longer chunks."""
        return _tuned(cls, K, V, dtype, chunk)


@functools.lru_cache(maxsize=64)
def _tuned(cls, K: int, V: int, dtype: torch.dtype, chunk: int):
    Kp, Vp = pow2(K), pow2(V)
    bf16 = dtype == torch.bfloat16 and chunk <= 64
    # float32 at chunk 128: the fused backward's L x K float32 tiles need 256 KiB of shared memory
    # at K = 128 and the δv kernel as much at 128-wide V-tiles (the H200 has 227 KiB; ptxas for
    # sm_90): K > 64 takes the K-tiled backward (192 KiB) and δv 64-wide tiles (192 KiB).
    f32_long = dtype == torch.float32 and chunk >= 128
    # bfloat16 heads above 128 (the paper models' 384, 512: K-tiled backward), measured on the
    # H200 (benchmarks/results/2026-12-01-h200-mlstm-large-heads.md): 128-wide V-tiles in the
    # state passing (half the programs re-reading each k/v row), 128-deep K-tiles in _fwd_out
    # and _bwd_dqk (half the q kᵀ and δh vᵀ recomputation per K-tile), 8 warps with a 3-stage
    # pipeline in _bwd_dqk (3 stages up to V = 384: 4.08 → 3.73 ms forward + backward at (16,
    # 2048, 4, 384, 384), H100, 2026-12-07; V = 512 untimed, kept at 2); all spill-free for sm_90 (ptxas, Triton 3.6). The tiles before
    # (_fwd_out 64-deep K-tiles on 4 warps, 64×64 state tiles) gave 6-13x the error in h at
    # K = V = 384 and 512 on the H200 (not at 128 or 256×512; cause not isolated, see the notes).
    big = bf16 and K > 128
    # 16-wide heads on 8 warps go wrong on the H200 with float32 inputs (Triton 3.6): _bwd_fused
    # made an illegal memory access at K = V = 16 and gave gradients off by 40-80 % at 16 x 32
    # and 32 x 16; _fwd_out lost precision at K = V = 16 (h error 1e-4 instead of 4e-7). On 4 or
    # 2 warps all are right (docs/kernels.md, "mLSTM chunkwise"); the cause inside the compiler is not isolated.
    narrow = min(Kp, Vp) <= 16
    return cls(
        chunk=chunk,
        states_bk=min(64, Kp), states_bv=min(128 if big else 64, Vp), states_warps=4,
        states_stages=3 if bf16 else 2,
        out_bk=min(128 if K <= 128 or big else 64, Kp), out_bv=min(64 if big else 128 if bf16 else 64, Vp),
        out_warps=4 if bf16 or narrow else 8, out_stages=2,
        dstates_bk=min(64, Kp), dstates_bv=min(128 if big else 64, Vp), dstates_warps=4,
        dstates_stages=3 if bf16 else 2,
        fused_max_k=64 if f32_long else 128, fused_bv=(64 if bf16 else 32) if Kp <= 128 else 16,
        fused_warps=4 if narrow else 8,
        fused_stages=3 if bf16 else 2,
        dqk_bk=min(128 if big else 64, Kp), dqk_bv=min(32, Vp), dqk_warps=8 if big else 4,
        dqk_stages=(3 if V <= 384 else 2) if big else 1,
        dv_bk=min(64, Kp), dv_bv=min(64 if f32_long or (big and V <= 384) else 128, Vp),
        dv_warps=4 if big and V <= 384 else 8, dv_stages=2,
        seq_scan="auto", local_bk=min(64, Kp), local_bv=min(64, Vp), local_warps=4,
        scan_be=128, scan_g=16, scan_warps=1, tail_bt=0,
    )


def numerics(dtype: torch.dtype):
    """(state storage dtype, UPD_MODE, STATE_MODE, PREC) of the kernels' _dot_l/_dot_r for
    input dtype `dtype`.

    float32 inputs: float32 products in 3-pass TF32 (close to full float32). float16: float32
    states and float32 operands in TF32 for every product that meets a state (float16 parts
    could overflow there). bfloat16: states stored in bfloat16 (they are bfloat16 operands of
    the output products anyway), the float32 operand of the state updates split in two
    bfloat16 parts."""
    if dtype == torch.float32:
        return torch.float32, 2, 2, "tf32x3"
    if dtype == torch.float16:
        return torch.float32, 2, 2, "tf32"
    return torch.bfloat16, 1, 0, "tf32"
