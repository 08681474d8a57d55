"""The chunkwise DPLR/KDA op over the kernels of this package: layout glue, the launchers of the
forward and backward phases, the `torch.library` custom ops `xlstm_kit::dplr_chunkwise_fwd` /
`xlstm_kit::dplr_chunkwise_bwd` (so `torch.compile` traces through them), and the entry points
`dplr_chunkwise_triton`, `kda_chunkwise_triton` and `supports` (backend.py's question)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as nnf

from ...backend import interpreting
from ..kda import check_kda_inputs
from ..naive import check_chunk, check_dplr_inputs, check_scale
from .backward import _bwd_dk, _bwd_dv
from .common import SUB
from .config import DPLRKernelConfig, resolve
from .pairs import _fwd_pairs
from .state import _bwd_state, _fwd_state
from .wy import _fwd_wy

# num_stages = 1 everywhere: the default software pipelining double-buffers every [L, K] operand
# of the chunk loops in shared memory (378 KB for _fwd_state at K = V = 128, far over the 227 KB
# an H200 block may use); unpipelined, the largest kernel needs 196 KB at 256.
_STAGES = 1

# forward scratch the backward reads (it re-runs none of the forward kernels): the inputs in the
# chunk layout, G, the pair matrices, E, W, V2, the chunk states and the decayed operands
_SAVED = ("qc", "kc", "vc", "ac", "bc", "G", "Aqk", "Aqa", "Abk", "E", "W", "V2", "Hs", "Qg",
          "Kd", "Ad", "eGl")
_GRADS = ("dq", "dk", "dv", "da", "db", "dgk", "dh0")


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------


def _chunk_layout(x: torch.Tensor, Tp: int) -> torch.Tensor:
    """[B, T, H, D] → contiguous [B·H, Tp, D], zero-padded at the end of time; never `x`'s memory
    (the custom op returns it)."""
    B, T, H, D = x.shape
    y = x.transpose(1, 2)
    if Tp != T:
        y = nnf.pad(y, (0, 0, 0, Tp - T))
    y = y.reshape(B * H, Tp, D).contiguous()
    # H = 1, or a [B, H, T, D] buffer seen as [B, T, H, D]: the reshape was a view of x
    return y.clone() if torch._C._is_alias_of(y, x) else y


def _seq_layout(x: torch.Tensor, B: int, H: int, T: int) -> torch.Tensor:
    """[B·H, Tp, D] → [B, T, H, D] view (inverse of _chunk_layout)."""
    _, Tp, D = x.shape
    return x.view(B, H, Tp, D)[:, :, :T].transpose(1, 2)


def _log_gamma(gk: torch.Tensor, Tp: int, L: int) -> torch.Tensor:
    """In-chunk inclusive cumsum of gk in float64: [B, T, H, K] → [B·H, Tp, K]; padded steps have
    gk = 0 (identity transitions)."""
    g = _chunk_layout(gk, Tp)          # moved in gk's own dtype, widened only by the cumsum
    BH, _, K = g.shape
    return g.view(BH, Tp // L, L, K).cumsum(2, dtype=torch.float64).view(BH, Tp, K)


# ----------------------------------------------------------------------------------------------
# launchers (launch=False: the same buffers, no kernels — the custom ops' fake implementations)
# ----------------------------------------------------------------------------------------------


def _forward(q, k, v, a, b, gk, h0, scale: float, L: int, config: str, launch: bool = True):
    """q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]; h0: [B, H, K, V] or None; config: a
    `DPLRKernelConfig.key()` (already through `for_dtypes`).
    Returns (o [B, T, H, V] in q's dtype, hT [B, H, K, V] float32, *the _SAVED scratch)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    Tp = (T + L - 1) // L * L
    NC = Tp // L
    BH = B * H
    qc, kc, vc, ac, bc = (_chunk_layout(x, Tp) for x in (q, k, v, a, b))
    G = _log_gamma(gk, Tp, L)
    h0c = None if h0 is None else h0.to(torch.float32).reshape(BH, K, V).contiguous()
    new = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.float32)  # noqa: E731
    Aqk, Aqa, Abk, Aba, E = (new(BH, NC, L, L) for _ in range(5))
    W, Qg, Kd, Ad = (new(BH, Tp, K) for _ in range(4))
    eGl = new(BH, NC, K)
    Cm, V2 = new(BH, Tp, V), new(BH, Tp, V)
    O = torch.empty(BH, Tp, V, device=q.device, dtype=q.dtype)
    Hs = new(BH, NC, K, V)
    hT = new(BH, K, V)
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        _fwd_pairs[(NC * (L // SUB), BH)](qc, kc, ac, bc, G, Aqk, Aqa, Abk, Aba, scale, Tp, NC,
                                          K=K, L=L, S=SUB, BK=c.pairs_bk, PREC=c.prec, LO=c.lo,
                                          num_warps=c.pairs_warps, num_stages=_STAGES)
        _fwd_wy[(NC, BH)](qc, kc, ac, bc, vc, G, Abk, Aba, E, W, Cm, Qg, Kd, Ad, eGl, scale, Tp, NC,
                          K=K, V=V, L=L, S=SUB, BK=c.wy_bk, BV=c.wy_bv, PREC=c.prec,
                          num_warps=c.wy_warps, num_stages=_STAGES)
        _fwd_state[(V // c.state_bv, BH)](Qg, Kd, Ad, eGl, vc, Aqk, Aqa, W, Cm,
                                          h0c if h0c is not None else hT, Hs, V2, O, hT, Tp, NC,
                                          K=K, V=V, L=L, BV=c.state_bv, HAS_H0=h0c is not None,
                                          PREC=c.prec, LO=c.lo, num_warps=c.state_warps,
                                          num_stages=_STAGES)
    return (_seq_layout(O, B, H, T), hT.view(B, H, K, V),
            qc, kc, vc, ac, bc, G, Aqk, Aqa, Abk, E, W, V2, Hs, Qg, Kd, Ad, eGl)


def _backward(qc, kc, vc, ac, bc, G, Aqk, Aqa, Abk, E, W, V2, Hs, Qg, Kd, Ad, eGl, do, dhT,
              B: int, T: int, scale: float, L: int, gk_dtype, h0_dtype, config: str,
              launch: bool = True):
    """The _SAVED scratch of `_forward`; do: [B, T, H, V] or None; dhT: [B, H, K, V] or None.
    Returns dq, dk, dv, da, db, dgk ([B, T, H, ·] in the dtypes of q, k, v, a, b and gk) and dh0
    ([B, H, K, V] in h0_dtype; empty when h0_dtype is None)."""
    BH, Tp, K = qc.shape
    H = BH // B
    V = vc.shape[-1]
    NC = Tp // L
    dev = qc.device
    new = lambda *shape: torch.empty(*shape, device=dev, dtype=torch.float32)  # noqa: E731
    # dO is read in its own dtype (the kernels widen it on load)
    dO = new(BH, Tp, V).zero_() if do is None else _chunk_layout(do, Tp)
    dhTc = None if dhT is None else dhT.to(torch.float32).reshape(BH, K, V).contiguous()
    dH, dV2, dh0 = new(BH, NC, K, V), new(BH, Tp, V), new(BH, K, V)
    GC = new(BH, Tp, V)
    dA = [new(BH, NC, L, L) for _ in range(4)]
    dqk_d, dqa_d = new(BH, Tp), new(BH, Tp)
    dv = torch.empty(BH, Tp, V, device=dev, dtype=vc.dtype)
    dq, dk, da, db, dg = (torch.empty(BH, Tp, K, device=dev, dtype=dt)
                          for dt in (qc.dtype, kc.dtype, ac.dtype, bc.dtype, gk_dtype))
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        _bwd_state[(V // c.state_bv, BH)](Qg, Ad, eGl, Aqa, W, dO, dhTc if dhTc is not None else dh0,
                                          dH, dV2, dh0, Tp, NC, K=K, V=V, L=L, BV=c.state_bv,
                                          HAS_DHT=dhTc is not None, PREC=c.prec,
                                          num_warps=c.state_warps, num_stages=_STAGES)
        _bwd_dv[(NC, BH)](Kd, vc, Aqk, Abk, E, V2, dO, dH, dV2, GC, *dA, dv, dqk_d, dqa_d, Tp, NC,
                          K=K, V=V, L=L, BK=c.dv_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo,
                          num_warps=c.dv_warps, num_stages=_STAGES)
        _bwd_dk[(NC, K // c.dk_bk, BH)](qc, kc, vc, ac, bc, G, V2, Hs, dO, dH, GC, *dA, dqk_d, dqa_d,
                                        dq, dk, da, db, dg, scale, Tp, NC, K=K, V=V, L=L, S=SUB,
                                        BK=c.dk_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo,
                                        num_warps=c.dk_warps, num_stages=_STAGES)
    grads = tuple(_seq_layout(g, B, H, T) for g in (dq, dk, dv, da, db, dg))
    dh0 = dh0.new_empty(0) if h0_dtype is None else dh0.view(B, H, K, V).to(h0_dtype)
    return (*grads, dh0)


# ----------------------------------------------------------------------------------------------
# custom ops and autograd
# ----------------------------------------------------------------------------------------------


def _tensors(names) -> str:
    return ", ".join(f"Tensor {n}" for n in names)


def _fwd_impl(*args):
    return _forward(*args)


def _fwd_fake(*args):
    return _forward(*args, launch=False)


def _bwd_impl(*args):
    return _backward(*args)


def _bwd_fake(*args):
    return _backward(*args, launch=False)


_fwd_op = torch.library.custom_op(
    "xlstm_kit::dplr_chunkwise_fwd", _fwd_impl, mutates_args=(),
    schema=f"({_tensors('qkvab')}, Tensor gk, Tensor? h0, float scale, int chunk_size, str config)"
           f" -> ({_tensors(('o', 'hT') + _SAVED)})")
_fwd_op.register_fake(_fwd_fake)

_bwd_op = torch.library.custom_op(
    "xlstm_kit::dplr_chunkwise_bwd", _bwd_impl, mutates_args=(),
    schema=f"({_tensors(_SAVED)}, Tensor? do, Tensor? dhT, int B, int T, float scale, "
           f"int chunk_size, ScalarType gk_dtype, ScalarType? h0_dtype, str config)"
           f" -> ({_tensors(_GRADS)})")
_bwd_op.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, a, b, gk, h0, scale, L, config = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(*output[2:])
    ctx.meta = (q.shape[0], q.shape[1], scale, L, gk.dtype, None if h0 is None else h0.dtype, config)
    ctx.set_materialize_grads(False)


def _grad(ctx, do, dhT, *_):
    B, T, scale, L, gk_dtype, h0_dtype, config = ctx.meta
    *grads, dh0 = _bwd_op(*ctx.saved_tensors, do, dhT, B, T, scale, L, gk_dtype, h0_dtype, config)
    return (*grads, None if h0_dtype is None else dh0, None, None, None)


_fwd_op.register_autograd(_grad, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------


def supports(op: str, *, K: int, V: int, chunk_size: int, dtype: torch.dtype, **_) -> str | None:
    """backend.choose_backend's question: K, V powers of two in [16, 256], chunk_size 16/32/64,
    not float64."""
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d > 256 or d & (d - 1):
            return f"the Triton DPLR kernels need {name} a power of two in [16, 256], got {d}"
    if chunk_size not in (16, 32, 64):
        return f"the Triton DPLR kernels need chunk_size in (16, 32, 64), got {chunk_size}"
    if dtype == torch.float64:
        return "the Triton DPLR kernels compute in float32; use backend='torch' for float64"
    return None


def _check(q, v, chunk_size, *named):
    check_chunk(chunk_size)
    for name, x in named:
        if x.dtype == torch.float64:
            # the kernels compute in float32: a float64 caller wants float64 accuracy
            raise ValueError(f"{name} is float64: the Triton DPLR kernels compute in float32; "
                             "use backend='torch' for float64")
    reason = supports("dplr_chunkwise", K=q.shape[-1], V=v.shape[-1], chunk_size=chunk_size,
                      dtype=q.dtype)
    if reason:
        raise ValueError(reason)


@functools.lru_cache(maxsize=256)
def _cached_key(config: DPLRKernelConfig | None, dtypes: tuple) -> str:
    return (config or DPLRKernelConfig()).for_dtypes(*dtypes).key()


@torch.compiler.assume_constant_result
def _config_key(config: DPLRKernelConfig | None, *dtypes: torch.dtype) -> str:
    """The key of `config` (None: the defaults) for inputs of `dtypes` (`for_dtypes`): cached per
    call site's values, and a constant to torch.compile (which cannot trace json)."""
    return _cached_key(config, dtypes)


def _apply(q, k, v, a, b, gk, initial_state, scale, output_final_state, chunk_size, config):
    o, hT, *_ = _fwd_op(q, k, v, a, b, gk, initial_state, scale, chunk_size, config)
    return o, (hT if output_final_state else None)


def dplr_chunkwise_triton(q, k, v, a, b, gk, *, scale=None, initial_state=None,
                          output_final_state=False, chunk_size=64, config=None):
    """DPLR chunkwise with the Triton kernels of this package (forward and hand-written backward).

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t), o_t = S_t (scale·q_t).

    Args:
        q, k, a, b, gk: [B, T, H, K]; gk ≤ 0, safe down to −5 per step (package docstring).
        v: [B, T, H, V]. K, V powers of two in [16, 256]; any T.
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] (= Sᵀ of the seed) or None for zeros.
        chunk_size: 16, 32 or 64.
        config: a `DPLRKernelConfig`, default `DPLRKernelConfig()`; its low-precision mode
            applies only when all of q, k, v, a, b, gk are bfloat16 (`for_dtypes`).
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    B, T, H, K, V = check_dplr_inputs(q, k, v, a, b, gk, initial_state)
    _check(q, v, chunk_size, *zip("qkvab", (q, k, v, a, b)), ("gk", gk))
    key = _config_key(config, q.dtype, k.dtype, v.dtype, a.dtype, b.dtype, gk.dtype)
    return _apply(q, k, v, a, b, gk, initial_state, float(check_scale(scale, K)),
                  output_final_state, chunk_size, key)


def kda_chunkwise_triton(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                         chunk_size=64, config=None):
    """KDA through the DPLR kernels: a = k, b = β k, v ← β v (seed "与KDA的关系"); gradients reach
    k, v, g and β through autograd of the substitution. The low-precision rule of `config`
    looks at the KDA inputs (all bfloat16), not at the float32 substituted ones.

    q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; initial_state: [B, H, K, V] or None.
    Returns (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32 or None).
    """
    check_kda_inputs(q, k, v, g, beta)
    _check(q, v, chunk_size, *zip("qkvg", (q, k, v, g)), ("beta", beta))
    key = _config_key(config, q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype)
    # products formed in float32 so 16-bit inputs are rounded only once (as kda.py)
    kf, beta_ = k.float(), beta.float().unsqueeze(-1)
    vb = v.float() * beta_
    check_dplr_inputs(q, kf, vb, kf, kf, g, initial_state)
    return _apply(q, kf, vb, kf, kf * beta_, g, initial_state,
                  float(check_scale(scale, q.shape[-1])), output_final_state, chunk_size, key)
