"""The chunkwise DPLR/KDA op over the kernels of this package: the launchers of the forward and
backward phases, the `torch.library` custom ops `xlstm_kit::dplr_chunkwise_fwd` /
`xlstm_kit::dplr_chunkwise_bwd` (so `torch.compile` traces through them), and the entry points
`dplr_chunkwise_triton` and `supports` (backend.py's question); KDA has its own (kda_op.py).

No layout copies: the kernels read q, k, v, a, b, δO and write o and every gradient in the
caller's [B, T, H, ·] layout (common.py); only the scratch is in the chunk layout [B·H, Tp, ·].

Packed sequences (cu_seqlens, B = 1): the scratch keeps the length T (no padding), the chunks come from the device-side chunk table of the mLSTM kernels
(mlstm/triton/varlen.py: per sequence ⌈len / L⌉ chunks, the last one partial, at most
⌈T / L⌉ + N − 1 in all, spare ones idle), every per-chunk kernel runs over the chunks of all
sequences at once with masked rows (common.py), and the two state kernels run one program per
(sequence, head, V-tile) from that sequence's initial state to its final state. No host sync."""
from __future__ import annotations

import functools

import torch

from ....errors import XLSTMKitError
from ..._checks import check_tensor
from ...backend import assume_constant_result, interpreting
from ...mlstm.triton.varlen import chunk_table, num_chunks
from ..naive import check_chunk, check_dplr_inputs, check_scale
from .backward import _bwd_dv
from .common import SUB
from .config import DPLRKernelConfig, resolve
from .dplr_dk import _bwd_dk_pairs, _bwd_dk_state
from .pairs import _fwd_gamma, _fwd_pairs
from .state import _bwd_state, _fwd_state
from .wy import _fwd_wy

# num_stages = 1 everywhere: the default software pipelining double-buffers every [L, K] operand
# of the chunk loops in shared memory (378 KB for _fwd_state at K = V = 128, far over the 227 KB
# an H200 block may use); unpipelined, the largest kernel needs 196 KB at 256.
_STAGES = 1

# forward scratch the backward reads (it re-runs none of the forward kernels): G, the pair
# matrices, E, W, V2, the chunk states and the decayed operands and the varlen chunk table (tab,
# sinfo: empty [0, 4] without cu_seqlens). q, k, v, a, b themselves are saved by autograd as the
# caller passed them (the kernels read them in place; a custom op may not return an alias of an
# input) and handed to the backward op as inputs, as kda_op.py does.
_SAVED = ("G", "Aqk", "Aqa", "Abk", "E", "W", "V2", "Hs", "Qg", "Kd", "Ad", "eGl", "tab", "sinfo")
_GRADS = ("dq", "dk", "dv", "da", "db", "dgk", "dh0")


def _table(cu_seqlens, T: int, L: int, dev, launch: bool):
    """(tab, sinfo, number of table chunks) of the varlen chunk table; empty [0, 4] tables and
    None without cu_seqlens; the fake implementations get the shapes only."""
    if cu_seqlens is None:
        e = torch.empty(0, 4, device=dev, dtype=torch.int32)
        return e, e.clone(), None
    N = cu_seqlens.shape[0] - 1
    NC = num_chunks(T, N, L)
    if launch:
        vl = chunk_table(cu_seqlens, T, L)
        return vl.tab, vl.sinfo, NC
    new = lambda n: torch.empty(n, 4, device=dev, dtype=torch.int32)  # noqa: E731
    return new(NC), new(N), NC


# ----------------------------------------------------------------------------------------------
# launchers (launch=False: the same buffers, no kernels — the custom ops' fake implementations)
# ----------------------------------------------------------------------------------------------


def _forward(q, k, v, a, b, gk, h0, scale: float, L: int, config: str, cu_seqlens=None,
             launch: bool = True):
    """q, k, a, b, gk: [B, T, H, K]; v: [B, T, H, V]; h0: [S, H, K, V] or None; config: a
    `DPLRKernelConfig.key()` (already through `for_dtypes`); cu_seqlens: [N+1] with B = 1 (S = N
    packed sequences, module docstring) or None (S = B).
    The kernels read q, k, v, a, b in this layout; a non-contiguous one is copied first.
    Returns (o [B, T, H, V] in q's dtype, hT [S, H, K, V] float32, *the _SAVED scratch)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    BH = B * H
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    tab, sinfo, Tp, NC, S, G, h0c, vl = _prologue(gk, h0, V, L, cu_seqlens, launch)
    new = lambda *shape: torch.empty(*shape, device=q.device, dtype=torch.float32)  # noqa: E731
    Aqk, Aqa, Abk, Aba, E = (new(BH, NC, L, L) for _ in range(5))
    W, Qg, Kd, Ad = (new(BH, Tp, K) for _ in range(4))
    eGl = new(BH, NC, K)
    Cm, V2 = new(BH, Tp, V), new(BH, Tp, V)
    O = torch.empty(B, T, H, V, device=q.device, dtype=q.dtype)
    Hs = new(BH, NC, K, V)
    hT = new(S, K, V)
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        _fwd_pairs[(NC * (L // SUB), BH)](q, k, a, b, G, Aqk, Aqa, Abk, Aba, scale, Tp, NC, T, H,
                                          K=K, L=L, S=SUB, BK=c.pairs_bk, PREC=c.prec, LO=c.lo_qk,
                                          num_warps=c.pairs_warps, num_stages=_STAGES, **vl)
        _fwd_wy[(NC, BH)](q, k, a, b, v, G, Abk, Aba, E, W, Cm, Qg, Kd, Ad, eGl, scale, Tp, NC, T, H,
                          K=K, V=V, L=L, S=SUB, BK=c.wy_bk, BV=c.wy_bv, PREC=c.prec,
                          num_warps=c.wy_warps, num_stages=_STAGES, **vl)
        h_in = h0c if h0c is not None else hT
        _fwd_state[(V // c.state_bv, S)](Qg, Kd, Ad, eGl, v, Aqk, Aqa, W, Cm, h_in, Hs, V2, O, hT, Tp,
                                         NC, T, H, K=K, V=V, L=L, BV=c.state_bv,
                                         HAS_H0=h0c is not None, PREC=c.prec, LO=c.lo_o,
                                         num_warps=c.state_warps, num_stages=_STAGES,
                                         **_seq_args(vl, sinfo))
    return (O, hT.view(S // H, H, K, V), G, Aqk, Aqa, Abk, E, W, V2, Hs, Qg, Kd, Ad, eGl, tab, sinfo)


def _prologue(gk, h0, V: int, L: int, cu_seqlens, launch: bool):
    """What both forward launchers (DPLR, KDA) set up first: (tab, sinfo, Tp, NC, S, G, h0c, vl)
    — the varlen chunk table (empty without cu_seqlens), the padded length Tp (T when packed),
    the number of chunks NC, the rows S of the initial and final states, the in-chunk cumulative
    gates G (float64, `_fwd_gamma`; over the table's chunks when packed), h0 as float32 [S, K, V]
    (or None) and the per-chunk kernels' varlen arguments vl."""
    B, T, H, K = gk.shape
    tab, sinfo, NCV = _table(cu_seqlens, T, L, gk.device, launch)
    varlen = NCV is not None
    Tp = T if varlen else (T + L - 1) // L * L
    NC = NCV if varlen else Tp // L
    S = sinfo.shape[0] * H if varlen else B * H
    # one kernel reading gk in place instead of a layout copy and a torch cumsum
    G = torch.empty(B * H, Tp, K, device=gk.device, dtype=torch.float64)
    if launch:
        _fwd_gamma[(NC, B * H, K // min(K, 64))](gk.contiguous(), G, tab, T, H, Tp, K=K, L=L,
                                                 BK=min(K, 64), VARLEN=varlen, num_warps=4)
    h0c = None if h0 is None else h0.to(torch.float32).reshape(S, K, V).contiguous()
    return tab, sinfo, Tp, NC, S, G, h0c, (dict(tab=tab, VARLEN=True) if varlen else {})


def _seq_args(vl: dict, sinfo) -> dict:
    """The varlen arguments of the state kernels: the per-chunk ones plus sinfo."""
    return dict(vl, sinfo=sinfo) if vl else {}


def _bwd_prologue(G, Hs, tab, sinfo, dhT, B: int):
    """What both backward launchers (DPLR, KDA) set up first: (BH, Tp, K, V, H, NC, S, varlen,
    new, dhTc, dH, dV2, dh0, GC) — sizes, `new` (an empty float32 tensor), dhT as float32
    [S, K, V] or None, and the scratch of `_bwd_state` / `_bwd_dv`."""
    BH, Tp, K = G.shape
    H = BH // B
    V = Hs.shape[-1]
    NC = Hs.shape[1]
    varlen = tab.shape[0] > 0
    S = sinfo.shape[0] * H if varlen else BH
    new = lambda *shape: torch.empty(*shape, device=G.device, dtype=torch.float32)  # noqa: E731
    dhTc = None if dhT is None else dhT.to(torch.float32).reshape(S, K, V).contiguous()
    return (BH, Tp, K, V, H, NC, S, varlen, new, dhTc, new(BH, NC, K, V), new(BH, Tp, V), new(S, K, V),
            new(BH, Tp, V))


def _backward(q, k, v, a, b, G, Aqk, Aqa, Abk, E, W, V2, Hs, Qg, Kd, Ad, eGl, tab, sinfo,
              do, dhT, B: int, T: int, scale: float, L: int, gk_dtype, h0_dtype, config: str,
              launch: bool = True):
    """The forward's inputs q, k, v, a, b and its _SAVED scratch; do: [B, T, H, V] or None;
    dhT: [S, H, K, V] or None (S = B, or N packed sequences when the table is not empty).
    Returns dq, dk, dv, da, db, dgk ([B, T, H, ·] contiguous in the dtypes of q, k, v, a, b and
    gk, written by the kernels) and dh0 ([S, H, K, V] in h0_dtype; empty when h0_dtype is None)."""
    BH, Tp, K, V, H, NC, S, varlen, new, dhTc, dH, dV2, dh0, GC = _bwd_prologue(G, Hs, tab, sinfo, dhT, B)
    dev = G.device
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    # δO read in place in its own dtype (widened by the kernels on load)
    dO = torch.zeros(B, T, H, V, device=dev, dtype=torch.float32) if do is None else do.contiguous()
    dA = [new(BH, NC, L, L) for _ in range(4)]
    dqk_d, dqa_d = new(BH, Tp), new(BH, Tp)
    dv = torch.empty(B, T, H, V, device=dev, dtype=v.dtype)
    dq, dk, da, db, dg = (torch.empty(B, T, H, K, device=dev, dtype=dt)
                          for dt in (q.dtype, k.dtype, a.dtype, b.dtype, gk_dtype))
    if launch:
        c = resolve(DPLRKernelConfig.from_key(config), K, V, L, interpreting())
        vl = dict(tab=tab, VARLEN=True) if varlen else {}
        _bwd_state[(V // c.state_bv, S)](Qg, Ad, eGl, Aqa, W, dO, dhTc if dhTc is not None else dh0,
                                         dH, dV2, dh0, Tp, NC, T, H, K=K, V=V, L=L, BV=c.state_bv,
                                         HAS_DHT=dhTc is not None, PREC=c.prec,
                                         num_warps=c.state_warps, num_stages=_STAGES,
                                         **_seq_args(vl, sinfo))
        _bwd_dv[(NC, BH)](Kd, v, Aqk, Abk, E, V2, dO, dH, dV2, GC, *dA, dv, dqk_d, dqa_d, Tp, NC, T, H,
                          K=K, V=V, L=L, BK=c.dv_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo_dk,
                          LV=c.lo_dv, LG=c.lo_gc,
                          num_warps=c.dv_warps, num_stages=_STAGES, **vl)
        # the key gradient in two kernels (dplr_dk.py): pair-matrix gradients on [16, 16] blocks,
        # then the state side and the epilogue per chunk
        dXq, dXb, dYk, dYa = (new(BH, Tp, K) for _ in range(4))
        _bwd_dk_pairs[(NC * (L // SUB), K // c.dk_bk, BH)](
            q, k, a, b, G, *dA, dXq, dXb, dYk, dYa, scale, Tp, NC, T, H, K=K, L=L, S=SUB, BK=c.dk_bk,
            PREC=c.prec, LO=c.lo_dk, num_warps=c.dkp_warps, num_stages=_STAGES, **vl)
        _bwd_dk_state[(NC, BH)](q, k, v, a, b, G, V2, Hs, dO, dH, GC, dXq, dXb, dYk, dYa,
                                dqk_d, dqa_d, dq, dk, da, db, dg, scale, Tp, NC, T, H, K=K, V=V, L=L,
                                BK=c.dk_bk, BV=c.bwd_bv, PREC=c.prec, LO=c.lo_dk,
                                num_warps=c.dk_warps, num_stages=_STAGES, **vl)
    dh0 = dh0.new_empty(0) if h0_dtype is None else dh0.view(S // H, H, K, V).to(h0_dtype)
    return dq, dk, dv, da, db, dg, dh0


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
    schema=f"({_tensors('qkvab')}, Tensor gk, Tensor? h0, float scale, int chunk_size, str config, "
           f"Tensor? cu_seqlens=None)"
           f" -> ({_tensors(('o', 'hT') + _SAVED)})")
_fwd_op.register_fake(_fwd_fake)

_bwd_op = torch.library.custom_op(
    "xlstm_kit::dplr_chunkwise_bwd", _bwd_impl, mutates_args=(),
    schema=f"({_tensors(tuple('qkvab') + _SAVED)}, Tensor? do, Tensor? dhT, int B, int T, float scale, "
           f"int chunk_size, ScalarType gk_dtype, ScalarType? h0_dtype, str config)"
           f" -> ({_tensors(_GRADS)})")
_bwd_op.register_fake(_bwd_fake)


def _setup_context(ctx, inputs, output):
    q, k, v, a, b, gk, h0, scale, L, config, _ = inputs
    ctx.mark_non_differentiable(*output[2:])
    ctx.save_for_backward(q, k, v, a, b, *output[2:])
    ctx.meta = (q.shape[0], q.shape[1], scale, L, gk.dtype, None if h0 is None else h0.dtype, config)
    ctx.set_materialize_grads(False)


def _grad(ctx, do, dhT, *_):
    B, T, scale, L, gk_dtype, h0_dtype, config = ctx.meta
    *grads, dh0 = _bwd_op(*ctx.saved_tensors, do, dhT, B, T, scale, L, gk_dtype, h0_dtype, config)
    return (*grads, None if h0_dtype is None else dh0, None, None, None, None)


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
def _cached_key(config: DPLRKernelConfig | None, o: tuple, dv: tuple, dk: tuple) -> str:
    return (config or DPLRKernelConfig()).for_dtypes(o=o, dv=dv, dk=dk).key()


@assume_constant_result
def _config_key(config: DPLRKernelConfig | None, o: tuple, dv: tuple, dk: tuple) -> str:
    """The key of `config` (None: the defaults) for outputs of the dtypes o, dv, dk (tuples,
    `DPLRKernelConfig.for_dtypes`): cached per call site's values, and a constant to
    torch.compile (which cannot trace json)."""
    return _cached_key(config, o, dv, dk)


def _check_packed(q, v, cu_seqlens, initial_state) -> None:
    """The shape rules of packed sequences that need no host sync (the public ops also check the
    values of cu_seqlens: `_checks.check_cu_seqlens`)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2 \
            or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise XLSTMKitError("cu_seqlens must be an int32 or int64 tensor of shape [N+1] with N >= 1, got "
                            + (f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}" if isinstance(cu_seqlens, torch.Tensor)
                               else type(cu_seqlens).__name__))
    if q.shape[0] != 1:
        raise XLSTMKitError(f"packed sequences (cu_seqlens) take batch 1, got batch {q.shape[0]}")
    if cu_seqlens.device != q.device:
        raise XLSTMKitError(f"cu_seqlens is on {cu_seqlens.device}, the inputs on {q.device}")
    if initial_state is not None:
        check_tensor("initial_state", initial_state,
                     (cu_seqlens.shape[0] - 1, q.shape[2], q.shape[3], v.shape[-1]), "N,H,K,V")


def _apply(q, k, v, a, b, gk, initial_state, scale, output_final_state, chunk_size, config, cu_seqlens):
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    o, hT, *_ = _fwd_op(q, k, v, a, b, gk, initial_state, scale, chunk_size, config, cu_seqlens)
    return o, (hT if output_final_state else None)


def dplr_chunkwise_triton(q, k, v, a, b, gk, *, scale=None, initial_state=None,
                          output_final_state=False, chunk_size=64, config=None, cu_seqlens=None):
    """DPLR chunkwise with the Triton kernels of this package (forward and hand-written backward).

    S_t = S_{t-1} Diag(α_t)(I − b_t a_tᵀ) + v_t k_tᵀ, α_t = exp(gk_t), o_t = S_t (scale·q_t).

    Args:
        q, k, a, b, gk: [B, T, H, K]; gk ≤ 0, safe down to −5 per step (package docstring).
        v: [B, T, H, V]. K, V powers of two in [16, 256]; any T.
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] (= Sᵀ, the transposed state of docs/design.md) or None for zeros.
        chunk_size: 16, 32 or 64.
        config: a `DPLRKernelConfig`, default `DPLRKernelConfig()`; its low-precision mode
            applies to the products of o when q is bfloat16, of δv when v is, and of δq, δk,
            δa, δb, δgk when q, k, a, b and gk all are (`for_dtypes`): bf16 activations with a
            float32 gk keep the fast forward and δv, and a float32-accurate gate gradient.
        cu_seqlens: None, or int32/int64 [N+1] (0 first, strictly increasing, T last; the
            caller checks the values) with B = 1: N packed sequences, each from its row of
            initial_state [N, H, K, V] (None: zeros) to its row of the final state [N, H, K, V].
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B or N, H, K, V] float32 or None).
    """
    packed = cu_seqlens is not None
    B, T, H, K, V = check_dplr_inputs(q, k, v, a, b, gk, None if packed else initial_state)
    if packed:
        _check_packed(q, v, cu_seqlens, initial_state)
    _check(q, v, chunk_size, *zip("qkvab", (q, k, v, a, b)), ("gk", gk))
    # the groups of low-precision products by the outputs they reach: a float32 gk keeps the
    # gate gradient's products at float32 accuracy, the output and δv stay fast
    key = _config_key(config, (q.dtype,), (v.dtype,), (q.dtype, k.dtype, a.dtype, b.dtype, gk.dtype))
    # the kernels need the caller's layout contiguous: a strided input is copied once here (and
    # autograd maps its gradient back), not once in each op
    q, k, v, a, b, gk = (x.contiguous() for x in (q, k, v, a, b, gk))
    return _apply(q, k, v, a, b, gk, initial_state, float(check_scale(scale, K)),
                  output_final_state, chunk_size, key, cu_seqlens)
