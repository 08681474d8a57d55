"""The chunkwise op: forward and backward launch sequences, their `torch.library` custom ops
(`xlstm_kit::mlstm_chunkwise_fwd`, `xlstm_kit::mlstm_chunkwise_bwd`, opaque to torch.compile)
with the autograd formula that links them, and the public `mlstm_chunkwise_triton`."""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from . import backward, gates, output, scan, states
from ...backend import assume_constant_result
from ....errors import XLSTMKitError
from ..._checks import autocast_off, backward_autocast_off
from .config import CHUNK_SIZES, MLSTMKernelConfig, numerics
from .varlen import chunk_table, first_stabilizers, num_chunks


def supports(op: str, *, dtype: torch.dtype, head_dims: tuple[int, int] = (16, 16), **_) -> str | None:
    """backend.choose_backend's question: do these kernels take this call? head_dims: (K, V)."""
    if dtype == torch.float64:
        return "the Triton mLSTM kernels take float16, bfloat16 or float32 inputs, got float64; use backend='torch'"
    if min(head_dims) < 16:  # tl.dot's smallest tile; a tiny model's heads run on the PyTorch path
        return f"the Triton mLSTM kernels need head dims K, V >= 16, got K={head_dims[0]}, V={head_dims[1]}"
    return None


def _empty(x: Tensor, *shape, dtype=torch.float32) -> Tensor:
    return torch.empty(shape, device=x.device, dtype=dtype)


def _fwd_buffers(q, v, NC, L, saved_nc=None, NS=None):
    """The forward op's outputs up to the gate tensors, unfilled; the chunk states cs have
    saved_nc (default NC) chunks: 0 where the backward recomputes them. NS: the number of
    packed sequences (the final states' rows) or None (B rows, unpacked)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = B if NS is None else NS
    sd = numerics(q.dtype)[0]
    h = _empty(q, B, T, H, V, dtype=q.dtype)
    hlo = torch.empty_like(h) if q.dtype != torch.float32 else _empty(q, 0, dtype=q.dtype)
    final = (_empty(q, S, H, K, V), _empty(q, S, H, K), _empty(q, S, H))
    rows = (_empty(q, B, H, NC * L), _empty(q, B, H, NC * L))                       # n̄, m per row
    cs = _empty(q, B, H, NC if saved_nc is None else saved_nc, K, V, dtype=sd)
    # ms: each sequence's chunk-start stabilizers followed by its final one (see states._fwd_states)
    chunk_states = (cs, _empty(q, B, H, NC, K), _empty(q, B, H, NC + (1 if NS is None else NS)))
    return (h, hlo, *final, *rows, *chunk_states)


def _rows(x: Tensor) -> Tensor:
    """x [B,T,H,D] as the forward kernels read it: heads packed (strides D, 1) and rows evenly
    spaced (batch stride T times the row stride), as column slices of one projection GEMM's
    output are, so that the large block's q, k, v need no copies; anything else contiguous."""
    B, T, H, D = x.shape
    packed = x.stride(3) == 1 and (H == 1 or x.stride(2) == D) and x.stride(1) >= H * D
    if packed and (B == 1 or x.stride(0) == T * x.stride(1)):
        return x
    return x.contiguous()


def _table(cu_seqlens: Optional[Tensor], T: int, L: int):
    return None if cu_seqlens is None else chunk_table(cu_seqlens, T, L)


def _pass_states(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec, vl=None):
    """The forward state passing into out = (cs, ns, ms, Cf, nf, mf): the scan or the
    sequential kernel (scan.use_scan); always the sequential kernel for packed sequences
    (vl, a varlen.ChunkTable), whose one program per sequence and head fills the GPU."""
    B, T, H, K = k.shape
    NC = out[0].shape[2]
    if vl is None and scan.use_scan(cfg, B * H, K, v.shape[-1], NC, k.device):
        scan.fwd_states_scan(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec)
    else:
        states.fwd_states(k, v, beta, blo, ig, u, C0, n0, m0, out, cfg, upd, prec, vl)


# Outputs of the forward op, in order: h, hlo (h's rounding residual, empty for float32
# inputs), the final state C, n, m (float32), per row n̄ and m [B,H,NC·L], the chunk-start
# states cs, ns, ms and the gate tensors β, β_lo, ĩ, u, xm, all saved for the backward.
def _forward(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor,
    C0: Optional[Tensor], n0: Optional[Tensor], m0: Optional[Tensor], eps: float, config: str,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor, Tensor, Tensor, Tensor, Tensor]:
    """q, k [B,T,H,K], v [B,T,H,V] (one dtype; heads packed, rows evenly spaced: see _rows);
    i, f [B,T,H] contiguous; C0
    [S,H,K,V], n0 [S,H,K], m0 [S,H] float32 contiguous or None; config an
    MLSTMKernelConfig.key(); cu_seqlens [N+1] or None (B = 1 and S = N packed sequences, see
    varlen.py; else S = B)."""
    cfg = MLSTMKernelConfig.from_key(config)
    q, k, v = _rows(q), _rows(k), _rows(v)   # (a no-op for the callers here; torch.compile may relayout)
    B, T, H, K = q.shape
    V = v.shape[-1]
    L = cfg.chunk
    vl = _table(cu_seqlens, T, L)
    S = B if vl is None else vl.n
    _, upd, smode, prec = numerics(q.dtype)
    beta, blo, ig, u, xm = gate_tensors = gates.gates_padded(i, f, L, vl)
    NC = xm.shape[2]
    h, hlo, Cf, nf, mf, nbar, mrow, cs, ns, ms = out = _fwd_buffers(
        q, v, NC, L, 0 if cfg.recompute_states else NC, None if vl is None else vl.n)
    if m0 is None:
        m0 = torch.zeros(S, H, device=q.device, dtype=torch.float32)
    if cfg.recompute_states:  # used here only; the backward recomputes the same values
        cs = _empty(q, B, H, NC, K, V, dtype=cs.dtype)
    _pass_states(k, v, beta, blo, ig, u, C0, n0, m0, (cs, ns, ms, Cf, nf, mf), cfg, upd, prec, vl)
    output.fwd_out(q, k, v, beta, blo, ig, u, cs, ns, ms, h, hlo, nbar, mrow, eps, cfg, smode, prec, vl)
    return out + gate_tensors


mlstm_chunkwise_fwd = torch.library.custom_op("xlstm_kit::mlstm_chunkwise_fwd", _forward, mutates_args=())


@mlstm_chunkwise_fwd.register_fake
def _(q, k, v, i, f, C0, n0, m0, eps, config, cu_seqlens=None):
    cfg = MLSTMKernelConfig.from_key(config)
    L = cfg.chunk
    NS = None if cu_seqlens is None else cu_seqlens.shape[0] - 1
    NC = -(-q.shape[1] // L) if NS is None else num_chunks(q.shape[1], NS, L)
    return _fwd_buffers(q, v, NC, L, 0 if cfg.recompute_states else NC, NS) + gates.gate_buffers(i, NC, L)


def _backward_impl(
    q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor,
    C0: Optional[Tensor], n0: Optional[Tensor],
    h: Tensor, hlo: Tensor, Cf: Tensor, nf: Tensor, nbar: Tensor, mrow: Tensor,
    cs: Tensor, ns: Tensor, ms: Tensor, beta: Tensor, blo: Tensor, ig: Tensor, u: Tensor, xm: Tensor,
    dh: Tensor, dCf: Optional[Tensor], dnf: Optional[Tensor], dmf: Optional[Tensor], eps: float, config: str,
    cu_seqlens: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients (δq, δk, δv in the input dtype, δi, δf in i's and f's, δC0, δn0, δm0 float32)
    from δh [B,T,H,V] contiguous and the final state's gradients (float32 or None), given the
    forward op's inputs and outputs."""
    # the backward kernels read q, k, v contiguous (the forward's may be GEMM column slices)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = MLSTMKernelConfig.from_key(config)
    B, T, H, K = q.shape
    V = v.shape[-1]
    NC = ns.shape[2]
    vl = _table(cu_seqlens, T, cfg.chunk)
    S = B if vl is None else vl.n
    _, upd, smode, prec = numerics(q.dtype)
    if cfg.recompute_states:
        # the forward's chunk states again (same kernels and inputs: the same values); its
        # other outputs go to scratch, the saved ns, ms, Cf, nf stay as they are
        cs = _empty(q, B, H, NC, K, V, dtype=cs.dtype)
        m0 = ms[:, :, 0].contiguous() if vl is None else first_stabilizers(ms, vl)
        scratch = (torch.empty_like(ns), torch.empty_like(ms), torch.empty_like(Cf), torch.empty_like(nf),
                   _empty(q, S, H))
        _pass_states(k, v, beta, blo, ig, u, C0, n0, m0, (cs, *scratch), cfg, upd, prec, vl)
    r, rd, g = backward.bwd_rows(dh, h, hlo, nbar, mrow, eps, vl)
    if dCf is not None or dnf is not None:
        dCf = torch.zeros_like(Cf) if dCf is None else dCf
        dnf = torch.zeros_like(nf) if dnf is None else dnf
    # packed sequences keep δ-states in float32 where a final-state gradient comes in (see
    # backward.last_chunk_apart)
    dcs = torch.empty_like(cs, dtype=torch.float32 if vl is not None and dCf is not None else cs.dtype)
    dns = torch.empty_like(ns)
    dC0 = _empty(q, S, H, K, V)
    dn0 = _empty(q, S, H, K)
    out = (dcs, dns, dC0, dn0)
    if vl is None and scan.use_scan(cfg, B * H, K, V, NC, q.device):
        scan.bwd_dstates_scan(q, dh, beta, blo, u, rd, g, ms, dCf, dnf, out, cfg, upd, prec)
    else:
        states.bwd_dstates(q, dh, beta, u, rd, g, ms, dCf, dnf, out, cfg, upd, prec, vl)
    dq, dk, dv, dlf, di = backward.bwd_chunks(q, k, v, dh, beta, blo, ig, u, rd, g, ms, cs, ns, dcs, dns,
                                              dCf, cfg, smode, prec, vl)
    # δm_T from the final state (C_T = e^{-m_T} C*_T, n likewise) and from m_T itself
    elast = None
    if dmf is not None:
        elast = dmf.double()
    if dCf is not None:
        t = (dCf * Cf).sum((-2, -1)) + (dnf * nf).sum(-1)
        elast = -t if elast is None else elast - t
    dio, dfo, dm0 = gates.gate_tail(i, f, ms, xm, r, dlf, di, None if elast is None else elast.contiguous(),
                                    eps, cfg.chunk, cfg.tail_bt, vl)
    if C0 is not None:
        dm0 = dm0 + (dC0 * C0).sum((-2, -1)) + (dn0 * n0).sum(-1)
    return dq, dk, dv, dio, dfo, dC0, dn0, dm0


mlstm_chunkwise_bwd = torch.library.custom_op("xlstm_kit::mlstm_chunkwise_bwd", _backward_impl, mutates_args=())


@mlstm_chunkwise_bwd.register_fake
def _(q, k, v, i, f, C0, n0, h, hlo, Cf, nf, nbar, mrow, cs, ns, ms, beta, blo, ig, u, xm,
      dh, dCf, dnf, dmf, eps, config, cu_seqlens=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(i),
            torch.empty_like(f), torch.empty_like(Cf), torch.empty_like(nf), _empty(q, *Cf.shape[:2]))


def _save(ctx, inputs, output):
    q, k, v, i, f, C0, n0, m0, eps, config, *cu = inputs
    h, hlo, Cf, nf, mf, *saved = output
    # gradients of unused outputs stay None: no zero tensors, no work for them in backward
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(q, k, v, i, f, C0, n0, m0, h, hlo, Cf, nf, cu[0] if cu else None, *saved)
    ctx.eps, ctx.config, ctx.n_inputs = eps, config, len(inputs)


def _grads(bwd, ctx, dh, dCf, dnf, dmf):
    """The input gradients from the output gradients (None where unused), the backward
    computed by `bwd` (the custom op or its implementation)."""
    q, k, v, i, f, C0, n0, m0, h, hlo, Cf, nf, cu, *saved = ctx.saved_tensors
    dh = torch.zeros_like(h) if dh is None else dh.contiguous()
    dq, dk, dv, di, df, dC0, dn0, dm0 = bwd(
        q, k, v, i, f, C0, n0, h, hlo, Cf, nf, *saved, dh,
        None if dCf is None else dCf.float().contiguous(), None if dnf is None else dnf.float().contiguous(),
        dmf, ctx.eps, ctx.config, cu)
    grads = (dq, dk, dv, di, df,
             None if C0 is None else dC0, None if n0 is None else dn0, None if m0 is None else dm0)
    return grads + (None,) * (ctx.n_inputs - len(grads))


def _setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:2], *output[5:])
    _save(ctx, inputs, output)


@backward_autocast_off
def _backward(ctx, dh, dhlo, dCf, dnf, dmf, *_):
    return _grads(mlstm_chunkwise_bwd, ctx, dh, dCf, dnf, dmf)


mlstm_chunkwise_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerChunkwise(torch.autograd.Function):
    """The eager path: the custom ops' implementations and autograd formula without the
    dispatcher (which costs ~0.1-0.2 ms of host time per forward+backward, and the host's
    launch time is the bottleneck at the benchmark sizes). torch.compile sees the custom ops."""

    @staticmethod
    def forward(ctx, *inputs):
        out = _forward(*inputs)
        _save(ctx, inputs, out)
        return out[0], out[2], out[3], out[4]

    @staticmethod
    @backward_autocast_off
    def backward(ctx, dh, dCf, dnf, dmf):
        return _grads(_backward_impl, ctx, dh, dCf, dnf, dmf)


@assume_constant_result
def _config_key(K: int, V: int, dtype: torch.dtype, chunk_size: int | None, config: MLSTMKernelConfig | None,
                recompute_states: bool = False) -> str:
    """The custom ops' configuration string (a constant to torch.compile, which cannot trace
    json nor build a config; cached, since the host's time per call matters at the benchmark
    sizes)."""
    return _config_key_cached(K, V, dtype, chunk_size, config, recompute_states)


@functools.lru_cache(maxsize=256)
def _config_key_cached(K, V, dtype, chunk_size, config, recompute_states) -> str:
    if config is None:
        config = MLSTMKernelConfig.tuned(K, V, dtype, chunk_size or 64)
    elif chunk_size is not None and chunk_size != config.chunk:
        raise ValueError(f"chunk_size={chunk_size} disagrees with config.chunk={config.chunk}")
    if recompute_states:
        config = config.replace(recompute_states=True)
    return config.key()


def mlstm_chunkwise_triton(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    *,
    initial_state=None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    chunk_size: int | None = None,
    config: MLSTMKernelConfig | None = None,
    recompute_states: bool = False,
    cu_seqlens: Tensor | None = None,
):
    """Chunkwise mLSTM on the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] gate pre-activations; initial_state
    (C [B,H,K,V], n [B,H,K], m [B,H]) or None for zeros → (h [B,T,H,V] in q's dtype,
    (C, n, m) float32 or None). q, k, v are computed in q's dtype (float16, bfloat16 or
    float32).

    cu_seqlens: int32/int64 [N+1] (0 first, strictly increasing, T last) packs N sequences
    into batch 1: sequence n is rows [cu_n, cu_{n+1}), runs as if alone (nothing crosses a
    boundary, forward or backward) from its own initial state (C [N,H,K,V], n [N,H,K], m [N,H];
    zeros where None) and returns its own final state (N rows). Its values are the caller's
    to check (xlstm_kit.ops._checks: checking them here would synchronise with the host); the
    shapes are checked here. See varlen.py for how the kernels handle the boundaries. `config` defaults to MLSTMKernelConfig.tuned(K, V, dtype, chunk_size or 64);
    `chunk_size` (16, 32, 64 or 128) must agree with `config.chunk` when both are given. The
    result does not depend on the chunk length or any other configuration beyond rounding.
    Inputs are assumed validated by the caller (xlstm_kit.ops.mlstm).
    """
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"the Triton mLSTM kernels take float16, bfloat16 or float32 q, got {dt}")
    if chunk_size is not None and chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size for the Triton backend must be 16, 32, 64 or 128, got {chunk_size}")
    key = _config_key(q.shape[-1], v.shape[-1], dt, chunk_size, config, bool(recompute_states))
    if initial_state is None:
        C0 = n0 = m0 = None
    else:
        C0, n0, m0 = (s.float().contiguous() for s in initial_state)
    args = (_rows(q), _rows(k.to(dt)), _rows(v.to(dt)), i.contiguous(), f.contiguous(),
            C0, n0, m0, float(eps), key)
    if cu_seqlens is not None:
        _check_packed(q, cu_seqlens, C0)
        args = args + (cu_seqlens.contiguous(),)
    if torch.compiler.is_compiling():
        h, _, C, n, m, *_ = mlstm_chunkwise_fwd(*args)
    else:
        h, C, n, m = _EagerChunkwise.apply(*args)
    return h, ((C, n, m) if output_final_state else None)


def _check_packed(q: Tensor, cu_seqlens: Tensor, C0: Tensor | None) -> None:
    """Shape and dtype checks of packed inputs (no values: those need the host)."""
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise XLSTMKitError(f"cu_seqlens must be int32 or int64 of shape [N+1] with N >= 1, got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise XLSTMKitError(f"packed sequences (cu_seqlens) take batch 1, got batch {q.shape[0]}")
    if cu_seqlens.device != q.device:
        raise XLSTMKitError(f"cu_seqlens is on {cu_seqlens.device}, the inputs on {q.device}")
    if C0 is not None and C0.shape[0] != cu_seqlens.shape[0] - 1:
        raise XLSTMKitError(f"initial_state has {C0.shape[0]} rows, cu_seqlens {cu_seqlens.shape[0] - 1} sequences")


@autocast_off
def chunkwise_forward_for_cell(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float,
                               recompute_states: bool, cu_seqlens: Tensor | None = None):
    """The forward from the zero state without autograd, for a caller that keeps its own
    autograd node (the mLSTM layer's, which recomputes q, k, v in its backward instead of
    saving them) -> (h [B,T,H,V], saved): `saved` is what `chunkwise_backward_for_cell` needs
    besides q, k, v, i, f. Shapes and dtypes as `mlstm_chunkwise_triton`; no final state."""
    key = _config_key(q.shape[-1], v.shape[-1], q.dtype, None, None, bool(recompute_states))
    args = (_rows(q), _rows(k), _rows(v), i.contiguous(), f.contiguous(), None, None, None, float(eps), key)
    if cu_seqlens is not None:
        _check_packed(q, cu_seqlens, None)
        args = args + (cu_seqlens.contiguous(),)
    out = mlstm_chunkwise_fwd(*args) if torch.compiler.is_compiling() else _forward(*args)
    h, hlo, Cf, nf, _mf, *rest = out
    # The backward reads the final state only with its gradient, which the cell never has:
    # zero-stride stand-ins keep the shapes (B·H·K·V floats less per call: 38 MB at the
    # 125M model's 16 x 2048)
    Cf, nf = (t.new_zeros(()).expand(t.shape) for t in (Cf, nf))
    return h, (h, hlo, Cf, nf, *rest)


@autocast_off
def chunkwise_backward_for_cell(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, saved, dh: Tensor,
                                eps: float, recompute_states: bool, cu_seqlens: Tensor | None = None):
    """(δq, δk, δv, δi, δf) of `chunkwise_forward_for_cell` for δh, from q, k, v, i, f as the
    forward took them (recomputed by the caller) and its `saved`."""
    key = _config_key(q.shape[-1], v.shape[-1], q.dtype, None, None, bool(recompute_states))
    h, hlo, Cf, nf, *rest = saved
    bwd = mlstm_chunkwise_bwd if torch.compiler.is_compiling() else _backward_impl
    cu = None if cu_seqlens is None else cu_seqlens.contiguous()
    dq, dk, dv, di, df, *_ = bwd(q, k, v, i.contiguous(), f.contiguous(), None, None, h, hlo, Cf, nf, *rest,
                                 dh.contiguous(), None, None, None, float(eps), key, cu)
    return dq, dk, dv, di, df
