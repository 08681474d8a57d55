"""KDA over its own kernels (kda.py; a = k, b = β k, v ← β v read as k, v, β): launchers, the
custom ops `xlstm_kit::kda_chunkwise_fwd` / `xlstm_kit::kda_chunkwise_bwd`, and
`kda_chunkwise_triton`. Layout, packed sequences and the configuration as chunkwise.py; the
phases are those of the general op with the KDA kernels (or the KDA flag) where a = k lets a
product be computed once, and `_bwd_state` unchanged with Kd for Ad and A_qk for A_qa."""
from __future__ import annotations

import torch

from ...backend import interpreting
from ..kda import check_kda_inputs
from ..naive import check_scale
from .chunkwise import (_STAGES, _bwd_prologue, _check, _check_packed, _chunk_layout, _config_key,
                        _launch_fwd_o, _prologue, _seq_args, _seq_layout, _tensors)
from .chunkwise import supports
from .common import SUB
from .config import DPLRKernelConfig, resolve
from .kda import _bwd_dk_kda, _bwd_dv_kda, _fwd_pairs_kda
from .state import _bwd_state, _fwd_state, _fwd_walk
from .wy import _fwd_wy

# forward scratch the backward reads: the inputs in the chunk layout (β as [BH, Tp]), G, the two
# distinct pair matrices, E, W, U = β v + V2, the chunk states, Q⊙e^G, K⊙e^{G_L−G}, e^{G_L}
# and the varlen chunk table
_SAVED = ("qc", "kc", "vc", "bc", "G", "Aqk", "Abk", "E", "W", "U", "Hs", "Qg", "Kd", "eGl",
          "tab", "sinfo")
_GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _beta_layout(beta: torch.Tensor, Tp: int) -> torch.Tensor:
    """[B, T, H] → contiguous [B·H, Tp] (zero-padded), in beta's dtype."""
    return _chunk_layout(beta.unsqueeze(-1), Tp).squeeze(-1)


def _forward(q, k, v, g, beta, h0, scale: float, L: int, config: str, cu_seqlens=None,
             launch: bool = True):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; h0: [S, H, K, V] or None;
    config: a `DPLRKernelConfig.key()` (through `for_dtypes`); cu_seqlens as chunkwise._forward.
    Returns (o [B, T, H, V] in q's dtype, hT [S, H, K, V] float32, *the _SAVED scratch)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH = B * H
    tab, sinfo, Tp, NC, S, G, h0c, vl = _prologue(g, h0, V, L, cu_seqlens, launch)
    qc, kc, vc = (_chunk_layout(x, Tp) for x in (q, k, v))
    bc = _beta_layout(beta, Tp)
    new = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.float32)  # noqa: E731
    Aqk, Abk, E = (new(BH, NC, L, L) for _ in range(3))
    W, Qg, Kd = (new(BH, Tp, K) for _ in range(3))
    eGl = new(BH, NC, K)
    Cm, U = new(BH, Tp, V), new(BH, Tp, V)
    O = torch.empty(BH, Tp, V, device=q.device, dtype=q.dtype)
    Hs = new(BH, NC, K, V)
    hT = new(S, K, V)
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        _fwd_pairs_kda[(NC * (L // SUB), BH)](qc, kc, bc, G, Aqk, Abk, scale, Tp, NC, K=K, L=L, S=SUB,
                                              BK=c.pairs_bk, PREC=c.prec, num_warps=c.pairs_warps,
                                              num_stages=_STAGES, **vl)
        # A_ba = A_bk; the unused Ad argument is Kd (never written under KDA)
        _fwd_wy[(NC, BH)](qc, kc, kc, kc, vc, G, Abk, Abk, E, W, Cm, Qg, Kd, Kd, eGl, scale, Tp, NC,
                          K=K, V=V, L=L, S=SUB, BK=c.wy_bk, BV=c.wy_bv, PREC=c.prec,
                          num_warps=c.wy_warps, num_stages=_STAGES, beta=bc, KDA=True, **vl)
        h_in = h0c if h0c is not None else hT
        if c.split_o:   # the walk without the output products, then `_fwd_o` over the chunks
            _fwd_walk[(V // c.walk_bv, S)](Kd, Kd, eGl, vc, W, Cm, h_in, Hs, U, hT, Tp, NC, K=K, V=V, L=L,
                                            BV=c.walk_bv, HAS_H0=h0c is not None, PREC=c.prec,
                                            num_warps=c.walk_warps, num_stages=_STAGES, KDA=True,
                                            **_seq_args(vl, sinfo, H))
            _launch_fwd_o(c, Qg, Hs, Aqk, Aqk, vc, U, O, Tp, NC, BH, K, V, L, vl, kda=True)
        else:
            _fwd_state[(V // c.state_bv, S)](Qg, Kd, Kd, eGl, vc, Aqk, Aqk, W, Cm, h_in, Hs, U, O, hT, Tp,
                                             NC, K=K, V=V, L=L, BV=c.state_bv, HAS_H0=h0c is not None,
                                             PREC=c.prec, LO=c.lo_o, num_warps=c.state_warps,
                                             num_stages=_STAGES, KDA=True, **_seq_args(vl, sinfo, H))
    return (_seq_layout(O, B, H, T), hT.view(S // H, H, K, V),
            qc, kc, vc, bc, G, Aqk, Abk, E, W, U, Hs, Qg, Kd, eGl, tab, sinfo)


def _backward(qc, kc, vc, bc, G, Aqk, Abk, E, W, U, Hs, Qg, Kd, eGl, tab, sinfo, do, dhT,
              B: int, T: int, scale: float, L: int, g_dtype, beta_dtype, h0_dtype, config: str,
              launch: bool = True):
    """The _SAVED scratch of `_forward`; do: [B, T, H, V] or None; dhT: [S, H, K, V] or None.
    Returns dq, dk, dv, dg ([B, T, H, ·] in the dtypes of q, k, v, g), dbeta ([B, T, H] in
    beta_dtype) and dh0 ([S, H, K, V] in h0_dtype; empty when h0_dtype is None)."""
    BH, Tp, K, V, H, NC, S, varlen, new, dO, dhTc, dH, dV2, dh0, GC = _bwd_prologue(qc, vc, Hs, tab, sinfo, do,
                                                                                   dhT, B)
    dev = qc.device
    dAq, dAb = new(BH, NC, L, L), new(BH, NC, L, L)
    dqd, dbv = new(BH, Tp), new(BH, Tp)
    dv = torch.empty(BH, Tp, V, device=dev, dtype=vc.dtype)
    dq, dk, dg = (torch.empty(BH, Tp, K, device=dev, dtype=dt) for dt in (qc.dtype, kc.dtype, g_dtype))
    c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting()) if launch else None
    NKT = K // c.dk_bk if launch else 1
    dbk = new(BH, NKT, Tp)
    if launch:
        vl = dict(tab=tab, VARLEN=True) if varlen else {}
        if varlen:      # rows of spare chunks are never written: δβ must read 0 there
            dbv.zero_()
            dbk.zero_()
        _bwd_state[(V // c.state_bv, S)](Qg, Kd, eGl, Aqk, W, dO, dhTc if dhTc is not None else dh0,
                                         dH, dV2, dh0, Tp, NC, K=K, V=V, L=L, BV=c.state_bv,
                                         HAS_DHT=dhTc is not None, PREC=c.prec,
                                         num_warps=c.state_warps, num_stages=_STAGES,
                                         **_seq_args(vl, sinfo, H))
        _bwd_dv_kda[(NC, BH)](Kd, vc, bc, Aqk, Abk, E, U, dO, dH, dV2, GC, dAq, dAb, dv, dbv, dqd, Tp, NC,
                              K=K, V=V, L=L, BK=c.dv_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo_dk,
                              LV=c.lo_dv, LG=c.lo_gc, num_warps=c.dv_warps, num_stages=_STAGES, **vl)
        _bwd_dk_kda[(NC, NKT, BH)](qc, kc, bc, G, U, Hs, dO, dH, GC, dAq, dAb, dqd, dq, dk, dbk, dg,
                                   scale, Tp, NC, K=K, V=V, L=L, S=SUB, BK=c.dk_bk, BV=c.bwd_bv,
                                   PREC=c.prec, LO=c.lo_dk, num_warps=c.dk_warps,
                                   num_stages=_STAGES, **vl)
    grads = tuple(_seq_layout(x, B, H, T) for x in (dq, dk, dv, dg))
    dbeta = (dbv + dbk.sum(1)).view(B, H, Tp)[:, :, :T].transpose(1, 2).to(beta_dtype)
    dh0 = dh0.new_empty(0) if h0_dtype is None else dh0.view(S // H, H, K, V).to(h0_dtype)
    return (*grads, dbeta, dh0)


_fwd_op = torch.library.custom_op(
    "xlstm_kit::kda_chunkwise_fwd", lambda *a: _forward(*a), mutates_args=(),
    schema=f"({_tensors('qkv')}, Tensor g, Tensor beta, Tensor? h0, float scale, int chunk_size, "
           f"str config, Tensor? cu_seqlens=None) -> ({_tensors(('o', 'hT') + _SAVED)})")
_fwd_op.register_fake(lambda *a: _forward(*a, launch=False))

_bwd_op = torch.library.custom_op(
    "xlstm_kit::kda_chunkwise_bwd", lambda *a: _backward(*a), mutates_args=(),
    schema=f"({_tensors(_SAVED)}, Tensor? do, Tensor? dhT, int B, int T, float scale, "
           f"int chunk_size, ScalarType g_dtype, ScalarType beta_dtype, ScalarType? h0_dtype, "
           f"str config) -> ({_tensors(_GRADS)})")
_bwd_op.register_fake(lambda *a: _backward(*a, launch=False))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, h0, scale, L, config, _ = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(*output[2:])
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
    """KDA (a = k, b = β k, v ← β v; seed "与KDA的关系") with the KDA kernels (kda.py): k, v, β
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
    o, hT, *_ = _fwd_op(q, k, v, g, beta, initial_state, float(check_scale(scale, q.shape[-1])),
                        chunk_size, key, cu_seqlens)
    return o, (hT if output_final_state else None)


# backend.py asks this module (KERNEL_MODULES["kda_chunkwise"]) for `supports` too
__all__ = ["kda_chunkwise_triton", "supports"]
