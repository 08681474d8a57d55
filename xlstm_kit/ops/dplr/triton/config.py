"""`DPLRKernelConfig`: the launch choices of the chunkwise DPLR kernels, one frozen value.

The defaults are the timed ones (docs/kernels.md, "DPLR and KDA"; the last sweep: H200, 2026-12-02):
single-pass TF32 for the products that reach only bf16 outputs, 32-column V-tiles on 4 warps for
the two sequential state kernels, 4 warps for `_fwd_wy` and both gradient kernels, and the tiles
below. `None` in a field means "by chunk size".
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ..._config import KernelConfig

# "tf32": single-pass TF32; "bf16": bfloat16 operands (a speed reference: the gate gradient fails
# the 2x rule); "fp16": float16 operands, for float16 inputs — the interpreter's stand-in for the
# GPU modes (it has neither TF32 nor bfloat16); "off": 3-pass TF32 like everything else.
LOWP_MODES = {"off": 0, "tf32": 1, "bf16": 2, "fp16": 3}

# The groups of low-precision products, named by the outputs they reach (package docstring,
# "Precision modes"): "o" the output's products in `_fwd_state`; "dv" the δv products of
# `_bwd_dv`; "dk" the products of δq, δk, δa, δb and the gate gradient δgk (the key gradient's
# kernels, and the pair-matrix gradients of `_bwd_dv` they are built from). A product shared by two groups (A_qk:
# o and δv; GC = Eᵀ δV2: δv and dk) is low only when both are.
LOWP_GROUPS = ("o", "dv", "dk")


@dataclasses.dataclass(frozen=True)
class DPLRKernelConfig(KernelConfig):
    """Launch configuration of `dplr_chunkwise_triton` / `kda_chunkwise_triton`.

    lowp: precision of the products whose results reach only 16-bit outputs (o and the input
        gradients; never the state path), one of LOWP_MODES. It applies to a group of products
        (LOWP_GROUPS) only when every output that group reaches is bfloat16 ("fp16": float16):
        `for_dtypes` narrows `lowp_outputs` to those groups; the others run at float32 accuracy.
    lowp_outputs: the groups of LOWP_GROUPS that take `lowp`, comma-separated (default all; set
        by `for_dtypes`: e.g. bf16 q, k, v, a, b with a float32 gk leave "o,dv", so the gate
        gradient δgk keeps float32 accuracy while the output and δv take the fast products).
    state_block_v, state_warps: V-tile and warps of `_fwd_state` / `_bwd_state` (the tile is
        capped at V, and at 32 for K > 128 or 64 otherwise: shared memory of one block; tiles
        under 32 columns run on 4 warps: 8 faulted on the H200).
    pairs_block_k, pairs_warps: K-step and warps of `_fwd_pairs` (warps None: 8 at chunk ≤ 32,
        else 4).
    wy_block_k, wy_block_v, wy_warps: K-step, V-step and warps of `_fwd_wy`.
    bwd_block_v: V-step of `_bwd_dv` and `_bwd_dk_state`, at least 32 (16 faulted on the H200: an
        illegal memory access, DPLR and KDA at K = V = 128, Triton 3.6); dv_block_k, dv_warps: K-step and warps of
        `_bwd_dv`; dk_block_k, dk_warps: the key gradient's two kernels (dplr_dk.py, kda_dk.py):
        the K-tile of both (dk_block_k None: 64 at chunk ≤ 32, else 32) and the warps of the
        second, `_bwd_dk_state` / `_bwd_dk_state_kda`.
    Every block is a power of two ≥ 16 (capped at K or V); warps are 4 or 8.
    """
    lowp: str = "tf32"
    lowp_outputs: str = "o,dv,dk"
    state_block_v: int = 32
    state_warps: int = 4
    pairs_block_k: int = 32
    pairs_warps: int | None = None
    wy_block_k: int = 32
    wy_block_v: int = 32
    wy_warps: int = 4
    bwd_block_v: int = 32
    dv_block_k: int = 64
    dv_warps: int = 4
    dk_block_k: int | None = None
    dk_warps: int = 4

    def __post_init__(self):
        if self.lowp not in LOWP_MODES:
            raise ValueError(f"DPLRKernelConfig.lowp must be one of {sorted(LOWP_MODES)}, got {self.lowp!r}")
        parts = (self.lowp_outputs.split(",") if self.lowp_outputs else []) \
            if isinstance(self.lowp_outputs, str) else [None]
        if any(p not in LOWP_GROUPS for p in parts) or parts != [g for g in LOWP_GROUPS if g in parts]:
            raise ValueError("DPLRKernelConfig.lowp_outputs must list groups of "
                             f"{','.join(LOWP_GROUPS)} in that order, comma-separated, got {self.lowp_outputs!r}")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_warps") and value is not None and value not in (4, 8):
                raise ValueError(f"DPLRKernelConfig.{f.name} must be 4 or 8, got {value!r}")
            if "_block_" in f.name and value is not None and (
                    not isinstance(value, int) or value < 16 or value & (value - 1)):
                raise ValueError(f"DPLRKernelConfig.{f.name} must be a power of two >= 16, got {value!r}")
        if self.bwd_block_v < 32:
            raise ValueError(f"DPLRKernelConfig.bwd_block_v must be >= 32 (16 faulted on the H200), "
                             f"got {self.bwd_block_v!r}")

    def for_dtypes(self, *, o, dv, dk) -> "DPLRKernelConfig":
        """This configuration for outputs of the given dtypes: o, dv, dk are the dtypes of the
        outputs each group of LOWP_GROUPS reaches (dplr: o (q,), dv (v,), dk (q, k, a, b, gk);
        KDA: the gradients of its own inputs). A group keeps `lowp` only when all of them are
        bfloat16 (float16 for "fp16"): bf16 rounding (2^-8) dwarfs single-pass TF32's operand
        rounding (2^-11), float16's and float32's do not, so the 2x rule would not hold for
        them (package docstring, "Precision modes"). No group left: `lowp` "off"."""
        want = torch.float16 if self.lowp == "fp16" else torch.bfloat16
        have = set(self.lowp_outputs.split(",")) if self.lowp_outputs else set()
        keep = [g for g, dts in zip(LOWP_GROUPS, (o, dv, dk)) if g in have and all(dt == want for dt in dts)]
        if self.lowp == "off" or not keep:
            return self if self.lowp == "off" else self.replace(lowp="off", lowp_outputs="")
        return self if keep == sorted(have, key=LOWP_GROUPS.index) else self.replace(lowp_outputs=",".join(keep))


class Launch(NamedTuple):
    """A configuration resolved for one shape: everything the launchers pass to the kernels."""
    prec: str              # input_precision of the float32-accurate products
    lo_o: int              # LO constexpr of `_mm` for the output products of `_fwd_state`,
    lo_qk: int             # A_qk (reaches o and δv),
    lo_dv: int             # the δv products of `_bwd_dv`,
    lo_gc: int             # GC = Eᵀ δV2 (reaches δv and the dk group),
    lo_dk: int             # the pair-matrix gradients of `_bwd_dv` and the key gradient's kernels
    state_bv: int
    state_warps: int
    pairs_bk: int
    pairs_warps: int
    wy_bk: int
    wy_bv: int
    wy_warps: int
    bwd_bv: int
    dv_bk: int
    dv_warps: int
    dk_bk: int
    dk_warps: int
    dkp_warps: int         # warps of `_bwd_dk_pairs_kda` (KDA) and `_bwd_dk_pairs`


@functools.lru_cache(maxsize=256)
def resolve(config: DPLRKernelConfig, K: int, V: int, L: int, interpreting: bool) -> Launch:
    """`config` (already through `for_dtypes`) for head dims K, V and chunk length L."""
    # float32 operands at ~float32 accuracy (3-pass TF32); the interpreter only knows "ieee" and
    # runs single-pass TF32 as "ieee" too
    prec = "ieee" if interpreting else "tf32x3"
    lo = LOWP_MODES[config.lowp]
    if interpreting and lo == 1:
        lo = 0
    on = set(config.lowp_outputs.split(",")) if config.lowp_outputs else set()
    at = lambda *groups: lo if on.issuperset(groups) else 0  # noqa: E731
    return Launch(
        prec=prec, lo_o=at("o"), lo_qk=at("o", "dv"), lo_dv=at("dv"), lo_gc=at("dv", "dk"),
        lo_dk=at("dk"),
        # larger V-tiles at K = 256 would not fit the shared memory of one block (docs/kernels.md, "DPLR and KDA")
        state_bv=(bv := min(config.state_block_v, V, 32 if K > 128 else 64)),
        # 8 warps on 16-column state tiles faulted on the H200 (illegal memory access in the
        # state kernels, Triton 3.6, KDA at K = V = 128: docs/kernels.md, "DPLR and KDA"); such tiles
        # take 4 warps until the cause is found
        state_warps=config.state_warps if bv >= 32 else 4,
        pairs_bk=min(K, config.pairs_block_k),
        pairs_warps=config.pairs_warps or (8 if L <= 32 else 4),
        wy_bk=min(K, config.wy_block_k), wy_bv=min(V, config.wy_block_v), wy_warps=config.wy_warps,
        bwd_bv=min(V, config.bwd_block_v),
        dv_bk=min(K, config.dv_block_k), dv_warps=config.dv_warps,
        dk_bk=min(K, config.dk_block_k or (64 if L <= 32 else 32)), dk_warps=config.dk_warps,
        # one [16, BK] tile per program: ptxas (sm_90a, K = 128, L = 64) gives 126 registers at
        # BK 32 on 4 warps (128 with the helpers shared with dplr_dk.py; the general op's
        # `_bwd_dk_pairs` 163, no spills), 240 on 2, and spills on 1; 4 warps at every tile
        dkp_warps=4)
