"""Triton kernels of the paper mLSTM layer's front: the causal conv + SiLU of x_m, the head-wise
(block-diagonal) q/k/v maps and the gate pre-activations, in one pass over x_m each way (the
training cell of xlstm_kit/layers/mlstm_cell.py).

- `xlstm_kit::mlstm_front_fwd(x, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, config)
      -> (x_conv, q, k, v, g)`
  x [B, T, C] contiguous (the activations' dtype), conv_w [C, K], conv_b [C] (any float dtype),
  wq, wk, wv [C/d, d, d] and w_conv, w_m [2H, C], b [2H] in x's dtype; x_conv = SiLU(conv(x)),
  q = blockdiag(wq) x_conv, k likewise, v = blockdiag(wv) x, g = x_conv w_convᵀ + x w_mᵀ + b
  [B·T, 2H] (gates=False: g empty, for the backward's recomputation). pos: int32 [T] (packed
  documents, B = 1; see ops/blocks/triton.py) or None.

One program per tile of `bt` steps walks all C channels in `bc`-wide tiles: the gate
pre-activations are sums over every channel, kept in registers (no partial sums in memory, no
atomics: deterministic). Each map's d x d blocks are gathered into one dense bc x bc tile
(zeros off the diagonal blocks) and applied as a tensor-core product, on x_conv rounded to x's
dtype as the unfused path rounds it; products accumulate in float32.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._config import KernelConfig
from .triton import _conv_rows, _row_pos


@dataclasses.dataclass(frozen=True)
class FrontKernelConfig(KernelConfig):
    """Launch parameters of the front kernels: tiles of `bt` steps x `bc` channels (a multiple
    of the head-wise block size), `warps`. Defaults: the largest tiles without register spills
    for sm_90 (ptxas, Triton 3.7, bf16: 243 registers; 64 x 64 tiles spilled 800 bytes on 4
    warps, 250 on 8)."""
    bt: int = 32
    bc: int = 32
    warps: int = 4


@triton.jit
def _block_diag(w_ptr, c0, C, d: tl.constexpr, BC: tl.constexpr, TRANS: tl.constexpr):
    """The dense [BC, BC] tile W[i, o] of channels c0 + i -> c0 + o of the block-diagonal map
    w [C/d, d, d] (out, in per block): y = x @ W. TRANS: W[o, i] (the map's transpose)."""
    if TRANS:
        o = tl.arange(0, BC)[:, None]
        i = tl.arange(0, BC)[None, :]
    else:
        i = tl.arange(0, BC)[:, None]
        o = tl.arange(0, BC)[None, :]
    ci = c0 + i
    co = c0 + o
    m = (i // d == o // d) & (ci < C) & (co < C)
    return tl.load(w_ptr + (co // d) * (d * d) + (co % d) * d + (ci % d), mask=m, other=0.0)


@triton.jit
def _front_fwd(x_ptr, p_ptr, cw_ptr, cb_ptr, wq_ptr, wk_ptr, wv_ptr, wgc_ptr, wgm_ptr, gb_ptr,
               xc_ptr, q_ptr, k_ptr, v_ptr, g_ptr, T, C, G2,
               K: tl.constexpr, d: tl.constexpr, HAS_POS: tl.constexpr, GATES: tl.constexpr,
               BT: tl.constexpr, BC: tl.constexpr, BG: tl.constexpr, PREC: tl.constexpr):
    bi = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    rmask = rows < T
    xb = x_ptr + bi * T * C
    pos = _row_pos(p_ptr, rows, T, HAS_POS)
    gcols = tl.arange(0, BG)
    gacc = tl.zeros((BT, BG), dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    for c0 in range(0, C, BC):
        c = c0 + tl.arange(0, BC)
        cmask = c < C
        m = rmask[:, None] & cmask[None, :]
        off = bi * T * C + rows[:, None] * C + c[None, :]
        y = _conv_rows(xb, xb, cw_ptr, cb_ptr, rows, c, cmask, T, C, K, False, pos, HAS_POS)
        xc = (y * tl.sigmoid(y)).to(dt)
        xt = tl.load(x_ptr + off, mask=m, other=0.0)
        tl.store(xc_ptr + off, xc, mask=m)
        q = tl.dot(xc, _block_diag(wq_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(q_ptr + off, q.to(dt), mask=m)
        kk = tl.dot(xc, _block_diag(wk_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(k_ptr + off, kk.to(dt), mask=m)
        v = tl.dot(xt, _block_diag(wv_ptr, c0, C, d, BC, False), input_precision=PREC)
        tl.store(v_ptr + off, v.to(dt), mask=m)
        if GATES:
            gm = cmask[:, None] & (gcols < G2)[None, :]
            goff = gcols[None, :] * C + c[:, None]  # [BC, BG]: the gate weights transposed
            gacc += tl.dot(xc, tl.load(wgc_ptr + goff, mask=gm, other=0.0), input_precision=PREC)
            gacc += tl.dot(xt, tl.load(wgm_ptr + goff, mask=gm, other=0.0), input_precision=PREC)
    if GATES:
        gacc += tl.load(gb_ptr + gcols, mask=gcols < G2, other=0.0).to(tl.float32)[None, :]
        grow = bi * T + rows
        tl.store(g_ptr + grow[:, None] * G2 + gcols[None, :], gacc.to(dt),
                 mask=rmask[:, None] & (gcols < G2)[None, :])


def _prec(x: Tensor) -> str:
    # float32 activations: full-precision products (the default TF32 would round their inputs)
    return "ieee" if x.dtype == torch.float32 else "tf32"


@torch.library.custom_op("xlstm_kit::mlstm_front_fwd", mutates_args=())
def mlstm_front_fwd(x: Tensor, pos: Optional[Tensor], conv_w: Tensor, conv_b: Tensor, wq: Tensor, wk: Tensor,
                    wv: Tensor, w_conv: Tensor, w_m: Tensor, b: Tensor, gates: bool,
                    config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    cfg = FrontKernelConfig.from_key(config)
    B, T, C = x.shape
    G2 = w_conv.shape[0]
    xc, q, k, v = (torch.empty_like(x) for _ in range(4))
    g = x.new_empty(B * T, G2) if gates else x.new_empty(0)
    if x.numel():
        _front_fwd[(triton.cdiv(T, cfg.bt), B)](
            x, x if pos is None else pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, xc, q, k, v, g, T, C, G2,
            K=conv_w.shape[1], d=wq.shape[-1], HAS_POS=pos is not None, GATES=gates, BT=cfg.bt, BC=cfg.bc,
            BG=max(16, triton.next_power_of_2(G2)), PREC=_prec(x), num_warps=cfg.warps)
    return xc, q, k, v, g


@mlstm_front_fwd.register_fake
def _(x, pos, conv_w, conv_b, wq, wk, wv, w_conv, w_m, b, gates, config):
    B, T, C = x.shape
    g = x.new_empty(B * T, w_conv.shape[0]) if gates else x.new_empty(0)
    return (torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), torch.empty_like(x), g)


@torch.compiler.assume_constant_result
def front_config_key() -> str:
    """The default configuration's key (a constant to torch.compile)."""
    return _FRONT_KEY


_FRONT_KEY = FrontKernelConfig().key()
