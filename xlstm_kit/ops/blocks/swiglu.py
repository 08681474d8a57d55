"""Triton kernels of the SwiGLU activation y = SiLU(g) · u of the large block's feed-forward,
as `torch.library` custom ops opaque to torch.compile:

- `xlstm_kit::swiglu_fwd(gu, config) -> y`
- `xlstm_kit::swiglu_bwd(gu, dy, config) -> dgu`  (SiLU(g) recomputed from gu)

gu [N, 2F] holds g (columns :F) and u (columns F:) side by side, as the one up-projection GEMM
writes them; its rows may have any stride (a column slice of a wider output), its columns are
contiguous. y, dy [N, F] and dgu [N, 2F] = [dy · u · SiLU'(g), dy · SiLU(g)] in gu's dtype
(float16, bfloat16 or float32), float32 arithmetic. One read of gu and one write of y forward;
one read of gu and dy and one write of dgu backward. The layer reaches them through
xlstm_kit.layers.fused.swiglu, which holds their PyTorch twins.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._config import KernelConfig
from ..backend import assume_constant_result


@dataclasses.dataclass(frozen=True)
class SwiGLUKernelConfig(KernelConfig):
    """Launch parameters: `block` columns of one row per program (a 1-D grid over rows x column
    tiles: the 7B's 65536 rows would overflow a second grid axis, which stops at 65535), `warps`
    (forward), `bwd_warps`. 1024 columns on 4 warps: 8 elements per thread and tensor, 16-byte
    accesses in bf16, and at F = 10944 the last of 11 tiles is 69 % full (3 % idle lanes)."""
    block: int = 1024
    warps: int = 4
    bwd_warps: int = 4


def supports(op: str, *, dtype: torch.dtype, **_) -> str | None:
    """backend.choose_backend's question: do these kernels ("swiglu") take this call?"""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton {op} kernels take float16, bfloat16 or float32 activations, got {dtype}"
    return None


@triton.jit
def _tile(pid, F, NB, BLOCK: tl.constexpr):
    """(row as int64, columns, mask) of program `pid` of the rows x column-tiles grid."""
    row = (pid // NB).to(tl.int64)
    cols = (pid % NB) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < F


@triton.jit
def _swiglu_fwd(gu_ptr, y_ptr, F, NB, stride_gu, BLOCK: tl.constexpr):
    row, cols, m = _tile(tl.program_id(0), F, NB, BLOCK)
    src = gu_ptr + row * stride_gu + cols
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=m, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(y_ptr + row * F + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_bwd(gu_ptr, dy_ptr, dgu_ptr, F, NB, stride_gu, stride_dy, BLOCK: tl.constexpr):
    row, cols, m = _tile(tl.program_id(0), F, NB, BLOCK)
    src = gu_ptr + row * stride_gu + cols
    g = tl.load(src, mask=m, other=0.0).to(tl.float32)
    u = tl.load(src + F, mask=m, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    dst = dgu_ptr + row * (2 * F) + cols
    tl.store(dst, dg.to(dgu_ptr.dtype.element_ty), mask=m)
    tl.store(dst + F, du.to(dgu_ptr.dtype.element_ty), mask=m)


def _rows(t: Tensor) -> Tensor:
    """t [N, C] with contiguous columns (the kernels take a row stride, not a column stride)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def _launch(N: int, F: int, cfg: SwiGLUKernelConfig):
    """(grid, BLOCK): no wider than F needs (a small F would otherwise mask most lanes)."""
    block = min(cfg.block, triton.next_power_of_2(F))
    nb = triton.cdiv(F, block)
    return (N * nb,), nb, block


@torch.library.custom_op("xlstm_kit::swiglu_fwd", mutates_args=())
def swiglu_fwd(gu: Tensor, config: str) -> Tensor:
    cfg = SwiGLUKernelConfig.from_key(config)
    N, F = gu.shape[0], gu.shape[1] // 2
    y = gu.new_empty(N, F)
    if y.numel():
        gu = _rows(gu)
        grid, nb, block = _launch(N, F, cfg)
        _swiglu_fwd[grid](gu, y, F, nb, gu.stride(0), BLOCK=block, num_warps=cfg.warps)
    return y


@swiglu_fwd.register_fake
def _(gu, config):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


@torch.library.custom_op("xlstm_kit::swiglu_bwd", mutates_args=())
def swiglu_bwd(gu: Tensor, dy: Tensor, config: str) -> Tensor:
    cfg = SwiGLUKernelConfig.from_key(config)
    N, F = dy.shape
    dgu = gu.new_empty(N, 2 * F)
    if dgu.numel():
        gu, dy = _rows(gu), _rows(dy)
        grid, nb, block = _launch(N, F, cfg)
        _swiglu_bwd[grid](gu, dy, dgu, F, nb, gu.stride(0), dy.stride(0), BLOCK=block, num_warps=cfg.bwd_warps)
    return dgu


@swiglu_bwd.register_fake
def _(gu, dy, config):
    return gu.new_empty(gu.shape[0], gu.shape[1])


@assume_constant_result
def config_key() -> str:
    """The default configuration's key (a constant to torch.compile, which cannot trace json)."""
    return _DEFAULT_KEY


_DEFAULT_KEY = SwiGLUKernelConfig().key()
