"""KDA over its own kernels (kda.py; a = k, b = β k, v ← β v read as k, v, β): launchers, the
custom ops `xlstm_kit::kda_chunkwise_fwd` / `xlstm_kit::kda_chunkwise_bwd`, and
`kda_chunkwise_triton`. Packed sequences and the configuration as op.py; the phases are
those of the general op with the KDA kernels (or the KDA flag) where a = k lets a product be
computed once, and `_bwd_state` with Kd for Ad and A_qk for A_qa. As in the general op, no
layout copies: the kernels read q, k, v, g, β, δO and write o, δq, δk, δv, δg in the caller's
[B, T, H, ·] layout (`_x_ld`, common.py); only the scratch is in the chunk layout."""
from __future__ import annotations

import torch

from ...backend import interpreting
from ..kda import check_kda_inputs
from ..naive import check_scale
from .op import (_STAGES, _bwd_prologue, _check, _check_packed, _config_key, _prologue, _seq_args,
                        _tensors)
from .op import supports
from .common import SUB
from .config import DPLRKernelConfig, resolve
from .kda import _bwd_dv_kda, _fwd_pairs_kda
from .kda_dk import _bwd_dk_pairs_kda, _bwd_dk_state_kda
from .state import _bwd_state, _fwd_state
from .wy import _fwd_wy

# forward scratch the backward reads: G, the two distinct pair matrices, E, W, U = β v + V2, the
# chunk states, Q⊙e^G, K⊙e^{G_L−G}, e^{G_L} and the varlen chunk table. q, k, v, β themselves are
# saved by autograd as the caller passed them (the kernels read them in place; a custom op may
# not return an alias of an input) and handed to the backward op as inputs.
_SAVED = ("G", "Aqk", "Abk", "E", "W", "U", "Hs", "Qg", "Kd", "eGl", "tab", "sinfo")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _forward(q, k, v, g, beta, h0, scale: float, L: int, config: str, cu_seqlens=None,
             launch: bool = True):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; h0: [S, H, K, V] or None;
    config: a `DPLRKernelConfig.key()` (through `for_dtypes`); cu_seqlens as chunkwise._forward.
    The kernels read q, k, v, β in this layout (kda.py); a non-contiguous one is copied first.
    Returns (o [B, T, H, V] in q's dtype, hT [S, H, K, V] float32, *the _SAVED scratch)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH = B * H
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    tab, sinfo, Tp, NC, S, G, h0c, vl = _prologue(g, h0, V, L, cu_seqlens, launch)
    new = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.float32)  # noqa: E731
    Aqk, Abk, E = (new(BH, NC, L, L) for _ in range(3))
    W, Qg, Kd = (new(BH, Tp, K) for _ in range(3))
    eGl = new(BH, NC, K)
    Cm, U = new(BH, Tp, V), new(BH, Tp, V)
    O = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    Hs = new(BH, NC, K, V)
    hT = new(S, K, V)
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        sa = _seq_args(vl, sinfo)
        grid = (NC * (L // SUB), BH)
        pa = (q, k, beta, G, Aqk, Abk, scale, Tp, NC, T, H)
        _fwd_pairs_kda[grid](*pa, K=K, L=L, S=SUB, BK=c.pairs_bk, PREC=c.prec, num_warps=c.pairs_warps,
                             num_stages=_STAGES, **vl)
        # A_ba = A_bk; the unused Ad argument is Kd (never written under KDA)
        _fwd_wy[(NC, BH)](q, k, k, k, v, G, Abk, Abk, E, W, Cm, Qg, Kd, Kd, eGl, scale, Tp, NC, T, H,
                          K=K, V=V, L=L, S=SUB, BK=c.wy_bk, BV=c.wy_bv, PREC=c.prec,
                          num_warps=c.wy_warps, num_stages=_STAGES, beta=beta, KDA=True, **vl)
        h_in = h0c if h0c is not None else hT
        _fwd_state[(V // c.state_bv, S)](Qg, Kd, Kd, eGl, v, Aqk, Aqk, W, Cm, h_in, Hs, U, O, hT, Tp,
                                         NC, T, H, K=K, V=V, L=L, BV=c.state_bv, HAS_H0=h0c is not None,
                                         PREC=c.prec, LO=c.lo_o, num_warps=c.state_warps,
                                         num_stages=_STAGES, KDA=True, **sa)
    return (O, hT.view(S // H, H, K, V), G, Aqk, Abk, E, W, U, Hs, Qg, Kd, eGl, tab, sinfo)


def _backward(q, k, v, beta, G, Aqk, Abk, E, W, U, Hs, Qg, Kd, eGl, tab, sinfo, do, dhT,
              B: int, T: int, scale: float, L: int, g_dtype, beta_dtype, h0_dtype, config: str,
              launch: bool = True):
    """The forward's inputs q, k, v, beta and its _SAVED scratch; do: [B, T, H, V] or None;
    dhT: [S, H, K, V] or None. Returns dq, dk, dv, dg ([B, T, H, ·] in the dtypes of q, k, v, g,
    written by the kernels), dbeta ([B, T, H] in beta_dtype) and dh0 ([S, H, K, V] in h0_dtype;
    empty when h0_dtype is None)."""
    BH, Tp, K, V, H, NC, S, varlen, new, dhTc, dH, dV2, dh0, GC = _bwd_prologue(G, Hs, tab, sinfo, dhT, B)
    dev = G.device
    q, k, v, beta = (x.contiguous() for x in (q, k, v, beta))
    # δO read in place in its own dtype (widened by the kernels on load)
    dO = torch.zeros(B, T, H, V, device=dev, dtype=torch.float32) if do is None else do.contiguous()
    dAq, dAb = new(BH, NC, L, L), new(BH, NC, L, L)
    dqd, dbv = new(BH, Tp), new(BH, Tp)
    dv = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    dq, dk, dg = (torch.empty(B, T, H, K, device=dev, dtype=dt) for dt in (q.dtype, k.dtype, g_dtype))
    c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting()) if launch else None
    # δ(βk)·k summed over all of K by `_bwd_dk_state_kda` itself
    dbk = new(BH, Tp)
    if launch:
        vl = dict(tab=tab, VARLEN=True) if varlen else {}
        if varlen:      # rows of spare chunks are never written: δβ must read 0 there
            dbv.zero_()
            dbk.zero_()
        _bwd_state[(V // c.state_bv, S)](Qg, Kd, eGl, Aqk, W, dO, dhTc if dhTc is not None else dh0,
                                         dH, dV2, dh0, Tp, NC, T, H, K=K, V=V, L=L, BV=c.state_bv,
                                         HAS_DHT=dhTc is not None, PREC=c.prec,
                                         num_warps=c.state_warps, num_stages=_STAGES,
                                         **_seq_args(vl, sinfo))
        _bwd_dv_kda[(NC, BH)](Kd, v, beta, Aqk, Abk, E, U, dO, dH, dV2, GC, dAq, dAb, dv, dbv, dqd, Tp, NC,
                              T, H, K=K, V=V, L=L, BK=c.dv_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo_dk,
                              LV=c.lo_dv, LG=c.lo_gc, num_warps=c.dv_warps, num_stages=_STAGES, **vl)
        dXq, dXb, dY = (new(BH, Tp, K) for _ in range(3))
        _bwd_dk_pairs_kda[(NC * (L // SUB), K // c.dk_bk, BH)](
            q, k, beta, G, dAq, dAb, dXq, dXb, dY, scale, Tp, NC, T, H, K=K, L=L, S=SUB, BK=c.dk_bk,
            PREC=c.prec, LO=c.lo_dk, num_warps=c.dkp_warps, num_stages=_STAGES, **vl)
        _bwd_dk_state_kda[(NC, BH)](q, k, beta, G, U, Hs, dO, dH, GC, dXq, dXb, dY, dqd, dq, dk, dbk, dg,
                                    scale, Tp, NC, T, H, K=K, V=V, L=L, BK=c.dk_bk, BV=c.bwd_bv,
                                    PREC=c.prec, LO=c.lo_dk, num_warps=c.dk_warps,
                                    num_stages=_STAGES, **vl)
    dbeta = (dbv + dbk).view(B, H, Tp)[:, :, :T].transpose(1, 2).to(beta_dtype)
    dh0 = dh0.new_empty(0) if h0_dtype is None else dh0.view(S // H, H, K, V).to(h0_dtype)
    return dq, dk, dv, dg, dbeta, dh0


_fwd_op = torch.library.custom_op(
    "xlstm_kit::kda_chunkwise_fwd", lambda *a: _forward(*a), mutates_args=(),
    schema=f"({_tensors('qkv')}, Tensor g, Tensor beta, Tensor? h0, float scale, int chunk_size, "
           f"str config, Tensor? cu_seqlens=None) -> ({_tensors(('o', 'hT') + _SAVED)})")
_fwd_op.register_fake(lambda *a: _forward(*a, launch=False))

_bwd_op = torch.library.custom_op(
    "xlstm_kit::kda_chunkwise_bwd", lambda *a: _backward(*a), mutates_args=(),
    schema=f"({_tensors(('q', 'k', 'v', 'beta') + _SAVED)}, Tensor? do, Tensor? dhT, int B, int T, "
           f"float scale, int chunk_size, ScalarType g_dtype, ScalarType beta_dtype, ScalarType? h0_dtype, "
           f"str config) -> ({_tensors(_GRADS)})")
_bwd_op.register_fake(lambda *a: _backward(*a, launch=False))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, L, config, _ = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, beta, *output[2:])
    ctx.meta = (q.shape[0], q.shape[1], scale, L, g.dtype, beta.dtype,
                None if h0 is None else h0.dtype, config)
    ctx.set_materialize_grads(False)


def _grad(ctx, do, dhT, *_):
    B, T, scale, L, g_dtype, beta_dtype, h0_dtype, config = ctx.meta
    *grads, dh0 = _bwd_op(*ctx.saved_tensors, do, dhT, B, T, scale, L, g_dtype, beta_dtype, h0_dtype, config)
    return (*grads, None if h0_dtype is None else dh0, None, None, None, None)


_fwd_op.register_autograd(_grad, setup_context=_setup_context)


def kda_chunkwise_triton(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         chunk_size=64, config=None, cu_seqlens=None):
    """KDA (a = k, b = β k, v ← β v; Kimi Linear, arXiv 2510.26692) with the KDA kernels (kda.py): k, v, β
    are read as given, β k and β v formed in registers, and every gradient, β's included,
    comes from the kernels. The low-precision groups of `config` follow the KDA outputs: o
    follows q; δv follows v and β; the K side (δq, δk, δg, the β gradient's k part) q, k, g, β.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None;
    cu_seqlens: as for `dplr_chunkwise_triton` (initial and final state then [N, H, K, V]).
    Returns (o [B, T, H, V] in q's dtype, final state [B or N, H, K, V] float32 or None).
    """
    packed = cu_seqlens is not None
    check_kda_inputs(q, k, v, g, beta, None if packed else initial_state)
    if packed:
        _check_packed(q, v, cu_seqlens, initial_state)
        cu_seqlens = cu_seqlens.contiguous()
    _check(q, v, chunk_size, *zip("qkvg", (q, k, v, g)), ("beta", beta))
    # δβ = Σ δ(βv)·v + Σ δ(βk)·k: β's dtype joins both gradient groups
    key = _config_key(config, (q.dtype,), (v.dtype, beta.dtype), (q.dtype, k.dtype, g.dtype, beta.dtype))
    # the kernels need the caller's layout contiguous: a strided input is copied once here (and
    # autograd maps its gradient back), not once in each op
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, hT, *_ = _fwd_op(q, k, v, g, beta, initial_state, float(check_scale(scale, q.shape[-1])),
                        chunk_size, key, cu_seqlens)
    return o, (hT if output_final_state else None)


# backend.py asks this module (KERNEL_MODULES["kda_chunkwise"]) for `supports` too
__all__ = ["kda_chunkwise_triton", "supports"]
