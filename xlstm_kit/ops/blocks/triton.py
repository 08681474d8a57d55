"""Triton kernels of the mLSTM output tail u = (norm(h) · w + skip · x_conv) · SiLU(z) (the
down-projection stays a cuBLAS matmul), as `torch.library` custom ops opaque to torch.compile:

- `xlstm_kit::mlstm_tail_fwd(h, x_conv, z, w, skip, eps, config) -> (u, mean, rstd)`
- `xlstm_kit::mlstm_tail_bwd(h, x_conv, z, w, skip, mean, rstd, du, config)
      -> (u, dh, dx_conv, dz, dw, dskip)`  (u recomputed for the down-projection's weight gradient)

h [N, H, D], x_conv, z, du [N, H·D] in one dtype (float16, bfloat16 or float32), w, skip [H·D]
(any float dtype), mean, rstd [N, H] float32. One pass over the activations each way, float32
arithmetic; dw and dskip are summed per program, then over programs.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from torch import Tensor

from .._config import KernelConfig


@dataclasses.dataclass(frozen=True)
class TailKernelConfig(KernelConfig):
    """Launch parameters of the tail kernels: `rows` tokens per tile, `warps`, and at most
    `programs` programs along the tokens in the backward (each sums its tiles' dw, dskip)."""
    rows: int = 4
    warps: int = 4
    programs: int = 512


def supports(op: str, *, dtype: torch.dtype, head_dim: int, **_) -> str | None:
    """backend.choose_backend's question: do these kernels take this call?"""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the Triton tail kernels take float16, bfloat16 or float32 activations, got {dtype}"
    if head_dim > 4096:
        return f"the Triton tail kernels hold a head in one tile; head_dim {head_dim} > 4096"
    return None


@triton.jit
def _tail_fwd(h_ptr, xc_ptr, z_ptr, w_ptr, s_ptr, u_ptr, mean_ptr, rstd_ptr, N, H, D, eps,
              ROWS: tl.constexpr, BD: tl.constexpr):
    hh = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    rmask = rows < N
    cmask = cols < D
    m = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * (H * D) + hh * D + cols[None, :]
    x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / D
    xm = tl.where(m, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xm * xm, 1) / D + eps)
    w = tl.load(w_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    sk = tl.load(s_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    xc = tl.load(xc_ptr + offs, mask=m, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
    a = xm * rstd[:, None] * w[None, :] + sk[None, :] * xc
    u = a * (z * tl.sigmoid(z))
    tl.store(u_ptr + offs, u.to(u_ptr.dtype.element_ty), mask=m)
    tl.store(mean_ptr + rows * H + hh, mean, mask=rmask)
    tl.store(rstd_ptr + rows * H + hh, rstd, mask=rmask)


@triton.jit
def _tail_bwd(h_ptr, xc_ptr, z_ptr, w_ptr, s_ptr, mean_ptr, rstd_ptr, du_ptr,
              u_ptr, dh_ptr, dxc_ptr, dz_ptr, dw_part, ds_part, N, H, D,
              ROWS: tl.constexpr, BD: tl.constexpr):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    hh = tl.program_id(1)
    cols = tl.arange(0, BD)
    cmask = cols < D
    w = tl.load(w_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    sk = tl.load(s_ptr + hh * D + cols, mask=cmask, other=0.0).to(tl.float32)
    acc_w = tl.zeros((BD,), dtype=tl.float32)
    acc_s = tl.zeros((BD,), dtype=tl.float32)
    for start in range(pid * ROWS, N, P * ROWS):
        rows = start + tl.arange(0, ROWS)
        rmask = rows < N
        m = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * (H * D) + hh * D + cols[None, :]
        mean = tl.load(mean_ptr + rows * H + hh, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows * H + hh, mask=rmask, other=0.0)
        x = tl.load(h_ptr + offs, mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (x - mean[:, None]) * rstd[:, None], 0.0)
        xc = tl.load(xc_ptr + offs, mask=m, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + offs, mask=m, other=0.0).to(tl.float32)
        du = tl.load(du_ptr + offs, mask=m, other=0.0).to(tl.float32)
        a = xhat * w[None, :] + sk[None, :] * xc
        sz = tl.sigmoid(z)
        silz = z * sz
        tl.store(u_ptr + offs, (a * silz).to(u_ptr.dtype.element_ty), mask=m)
        da = du * silz
        tl.store(dz_ptr + offs, (du * a * sz * (1.0 + z * (1.0 - sz))).to(dz_ptr.dtype.element_ty), mask=m)
        tl.store(dxc_ptr + offs, (da * sk[None, :]).to(dxc_ptr.dtype.element_ty), mask=m)
        acc_w += tl.sum(da * xhat, 0)
        acc_s += tl.sum(da * xc, 0)
        dxhat = da * w[None, :]
        c1 = tl.sum(dxhat * xhat, 1) / D
        c2 = tl.sum(dxhat, 1) / D
        dh = rstd[:, None] * (dxhat - c2[:, None] - xhat * c1[:, None])
        tl.store(dh_ptr + offs, dh.to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(dw_part + pid * (H * D) + hh * D + cols, acc_w, mask=cmask)
    tl.store(ds_part + pid * (H * D) + hh * D + cols, acc_s, mask=cmask)


def _stats(h: Tensor) -> tuple[Tensor, Tensor]:
    N, H, _ = h.shape
    return (torch.empty(N, H, device=h.device, dtype=torch.float32),
            torch.empty(N, H, device=h.device, dtype=torch.float32))


@torch.library.custom_op("xlstm_kit::mlstm_tail_fwd", mutates_args=())
def mlstm_tail_fwd(h: Tensor, x_conv: Tensor, z: Tensor, w: Tensor, skip: Tensor, eps: float,
                   config: str) -> tuple[Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = h.shape
    u = torch.empty_like(x_conv)
    mean, rstd = _stats(h)
    if N:
        grid = (triton.cdiv(N, cfg.rows), H)
        _tail_fwd[grid](h, x_conv, z, w, skip, u, mean, rstd, N, H, D, eps,
                        ROWS=cfg.rows, BD=triton.next_power_of_2(D), num_warps=cfg.warps)
    return u, mean, rstd


@mlstm_tail_fwd.register_fake
def _(h, x_conv, z, w, skip, eps, config):
    return (torch.empty_like(x_conv), *_stats(h))


@torch.library.custom_op("xlstm_kit::mlstm_tail_bwd", mutates_args=())
def mlstm_tail_bwd(h: Tensor, x_conv: Tensor, z: Tensor, w: Tensor, skip: Tensor, mean: Tensor, rstd: Tensor,
                   du: Tensor, config: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cfg = TailKernelConfig.from_key(config)
    N, H, D = h.shape
    u, dxc, dz = torch.empty_like(x_conv), torch.empty_like(x_conv), torch.empty_like(z)
    dh = torch.empty_like(h)
    P = max(1, min(cfg.programs, triton.cdiv(N, cfg.rows)))
    dw_part = torch.zeros(P, H * D, device=h.device, dtype=torch.float32)
    ds_part = torch.zeros(P, H * D, device=h.device, dtype=torch.float32)
    if N:
        _tail_bwd[(P, H)](h, x_conv, z, w, skip, mean, rstd, du, u, dh, dxc, dz, dw_part, ds_part, N, H, D,
                          ROWS=cfg.rows, BD=triton.next_power_of_2(D), num_warps=cfg.warps)
    return u, dh, dxc, dz, dw_part.sum(0).to(w.dtype), ds_part.sum(0).to(skip.dtype)


@mlstm_tail_bwd.register_fake
def _(h, x_conv, z, w, skip, mean, rstd, du, config):
    return (torch.empty_like(x_conv), torch.empty_like(h), torch.empty_like(x_conv), torch.empty_like(z),
            torch.empty_like(w), torch.empty_like(skip))


@torch.compiler.assume_constant_result
def config_key() -> str:
    """The default configuration's key (a constant to torch.compile, which cannot trace json)."""
    return _DEFAULT_KEY


_DEFAULT_KEY = TailKernelConfig().key()
