"""mLSTM operators: public entry points, input checks and the one backend choice.

Maths (docs/design.md, "mLSTM"; xLSTM paper, arXiv 2405.04517, eqs. 19–27): with
log f_t = logsigmoid(f̃_t), stabilizer m_t = max(log f_t + m_{t-1}, ĩ_t),
C_t = f'_t C_{t-1} + i'_t k_t v_tᵀ, n_t = f'_t n_{t-1} + i'_t k_t and
h_t = C_tᵀ q̂_t / (max(|n_tᵀ q̂_t|, exp(-m_t)) + eps), q̂_t = q_t / √K.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; i, f [B, T, H] (gate pre-activations);
state (C [B, H, K, V], n [B, H, K], m [B, H]). Every op computes in float32 (float64 stays
float64), keeps states in that precision and returns h in the dtype of q.
"""
from __future__ import annotations

import torch

from .._checks import autocast_off, check_chunk_size, check_cu_seqlens, check_varlen_state, run_varlen, check_head_dim, check_same_device, check_tensor, compute_dtype, floor_log_gate
from ..backend import choose_backend, on_device
from .chunkwise import mlstm_chunkwise_torch
from .naive import mlstm_recurrent_naive, mlstm_step_naive
from .parallel import mlstm_parallel_torch
from ...errors import XLSTMKitError

__all__ = ["mlstm_recurrent", "mlstm_chunkwise", "mlstm_parallel", "mlstm_step"]

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _sequence_dims(q, k, v, i, f) -> tuple[int, int, int, int, int]:
    """Validate sequence inputs; return (B, T, H, K, V)."""
    check_tensor("q", q, (None, None, None, None), "B,T,H,K")
    B, T, H, K = q.shape
    check_tensor("k", k, (B, T, H, K), "B,T,H,K")
    check_tensor("v", v, (B, T, H, None), "B,T,H,V")
    V = v.shape[-1]
    check_tensor("i", i, (B, T, H), "B,T,H")
    check_tensor("f", f, (B, T, H), "B,T,H")
    check_same_device(q=q, k=k, v=v, i=i, f=f)
    if min(B, T, H, K, V) < 1:
        raise XLSTMKitError(f"q [B,T,H,K] and v [B,T,H,V] need every size >= 1, got {tuple(q.shape)} and {tuple(v.shape)}")
    return B, T, H, K, V


def _check_state(state, B: int, H: int, K: int, V: int, device, name: str) -> None:
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise XLSTMKitError(f"{name} must be a tuple (C [B,H,K,V], n [B,H,K], m [B,H]), got {type(state).__name__}")
    C, n, m = state
    check_tensor(f"{name} C", C, (B, H, K, V), "B,H,K,V")
    check_tensor(f"{name} n", n, (B, H, K), "B,H,K")
    check_tensor(f"{name} m", m, (B, H), "B,H")
    check_same_device(q=torch.empty(0, device=device), C=C, n=n, m=m)


def _varlen_bounds(cu_seqlens, initial_state, B, T, H, K, V, device):
    """Validate cu_seqlens and the N-row initial state that goes with it; the boundaries [N+1]."""
    bounds = check_cu_seqlens(cu_seqlens, B, T, device)
    if initial_state is not None:
        check_varlen_state(initial_state, len(bounds) - 1)
        _check_state(initial_state, len(bounds) - 1, H, K, V, device, "initial_state")
    return bounds


def _check_eps(eps) -> float:
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise XLSTMKitError(f"eps must be a non-negative float, got {eps!r}")
    return float(eps)


@autocast_off
def mlstm_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    initial_state: State | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    backend: str | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, State | None]:
    """Step-by-step mLSTM (the reference; autograd differentiates the loop).

    q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] → h [B,T,H,V], state (C [B,H,K,V], n [B,H,K], m [B,H])
    or None unless `output_final_state`. `cu_seqlens` as in `mlstm_chunkwise`.
    """
    B, T, H, K, V = _sequence_dims(q, k, v, i, f)
    eps = _check_eps(eps)
    if cu_seqlens is not None:
        bounds = _varlen_bounds(cu_seqlens, initial_state, B, T, H, K, V, q.device)
        return run_varlen(lambda *xs, **kw: mlstm_recurrent(*xs, eps=eps, backend=backend, **kw),
                          (q, k, v, i, f), bounds, initial_state, output_final_state)
    if initial_state is not None:
        _check_state(initial_state, B, H, K, V, q.device, "initial_state")
    choose_backend("mlstm_recurrent", backend, q.device)
    cd = compute_dtype(q, k, v, i, f)
    state = None if initial_state is None else tuple(s.to(cd) for s in initial_state)
    h, final = mlstm_recurrent_naive(q.to(cd), k.to(cd), v.to(cd), i.to(cd), f.to(cd), state, eps)
    return h.to(q.dtype), (final if output_final_state else None)


@autocast_off
def mlstm_chunkwise(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    initial_state: State | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 64,
    backend: str | None = None,
    recompute_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    config=None,
) -> tuple[torch.Tensor, State | None]:
    """Chunkwise-parallel mLSTM with a hand-written backward; any T (the last chunk may be partial).

    q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] → h [B,T,H,V], state (C [B,H,K,V], n [B,H,K], m [B,H])
    or None unless `output_final_state`. The final m equals the recurrent stabilizer exactly.
    Gradients reach q, k, v, i, f and the initial state, and flow back from the final state.
    f = −inf is a closed forget gate, as in `mlstm_recurrent` (its gradient is 0).
    `recompute_states`: the Triton kernels keep no per-chunk states [B, H, T/L, K, V] for the
    backward and recompute them there (bitwise the same gradients; at the 125M model's heads
    0.56 GiB less per layer for ~15 % more op time); the torch path ignores it.
    `cu_seqlens`: int32/int64 [N+1] (0 = cu[0] < ... < cu[N] = T) with B = 1: N sequences packed
    along T, each starting from its own row of `initial_state` (C [N,H,K,V], n [N,H,K], m [N,H];
    None: zeros) and returning its own final state (N rows); nothing crosses a boundary.
    `config`: the Triton kernels' `MLSTMKernelConfig` (None: the tuned defaults for the shapes);
    unused on the PyTorch path.
    """
    B, T, H, K, V = _sequence_dims(q, k, v, i, f)
    eps = _check_eps(eps)
    check_chunk_size(chunk_size)
    bounds = None
    if cu_seqlens is not None:
        bounds = _varlen_bounds(cu_seqlens, initial_state, B, T, H, K, V, q.device)
    elif initial_state is not None:
        _check_state(initial_state, B, H, K, V, q.device, "initial_state")
    cd = compute_dtype(q, k, v, i, f)
    # f = -inf (a closed gate, log f = -inf) would give -inf - -inf in the cumulative sums
    f = floor_log_gate(f)
    # The kernels pick their own chunk length (results do not depend on it); float64 is
    # reference work and stays on the torch path.
    if choose_backend("mlstm_chunkwise", backend, q.device, inputs=(q, k, v, i, f, *(initial_state or ())),
                      dtype=cd, head_dims=(K, V)) == "triton":
        from .triton.op import mlstm_chunkwise_triton

        # packed sequences: the kernels walk each sequence's own chunks (triton/varlen.py)
        varlen = {} if bounds is None else {"cu_seqlens": cu_seqlens}
        with on_device(q):
            return mlstm_chunkwise_triton(
                q, k, v, i, f, initial_state=initial_state, output_final_state=output_final_state, eps=eps,
                config=config, recompute_states=bool(recompute_states), **varlen)
    if bounds is not None:
        return run_varlen(lambda *xs, **kw: mlstm_chunkwise(*xs, eps=eps, chunk_size=chunk_size, backend="torch", **kw),
                          (q, k, v, i, f), bounds, initial_state, output_final_state)
    state = (None, None, None) if initial_state is None else tuple(s.to(cd) for s in initial_state)
    h, C, n, m = mlstm_chunkwise_torch(q, k, v, i, f, *state, eps=eps, chunk_size=chunk_size, dtype=cd)
    return h.to(q.dtype), ((C, n, m) if output_final_state else None)


@autocast_off
def mlstm_parallel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    *,
    eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, None]:
    """Quadratic (parallel) mLSTM, xLSTM paper eqs. 71–86, with its backward (eqs. 87–105) by hand.

    q, k [B,T,H,K]; v [B,T,H,V]; i, f [B,T,H] → (h [B,T,H,V], None). Starts from the zero state;
    O(T²) memory, meant for short sequences and as a check of the chunkwise form.
    `cu_seqlens` [N+1] with B = 1: N packed sequences, each from the zero state.
    """
    B, T = _sequence_dims(q, k, v, i, f)[:2]
    eps = _check_eps(eps)
    if cu_seqlens is not None:
        bounds = check_cu_seqlens(cu_seqlens, B, T, q.device)
        return run_varlen(lambda *xs, initial_state, output_final_state: mlstm_parallel(*xs, eps=eps),
                          (q, k, v, i, f), bounds, None, False)
    cd = compute_dtype(q, k, v, i, f)
    # f = -inf (a closed gate) would give -inf - -inf in the cumulative sums
    h = mlstm_parallel_torch(q.to(cd), k.to(cd), v.to(cd), i.to(cd), floor_log_gate(f.to(cd)), eps)
    return h.to(q.dtype), None


@autocast_off
def mlstm_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    i: torch.Tensor,
    f: torch.Tensor,
    state: State | None,
    *,
    eps: float = 1e-6,
    inplace: bool = False,
) -> tuple[torch.Tensor, State]:
    """One recurrent step (generation).

    q, k [B,H,K]; v [B,H,V]; i, f [B,H]; state (C [B,H,K,V], n [B,H,K], m [B,H]) or None for zeros
    → (h [B,H,V], new state).
    inplace: write C' into the state's C (the caller gives the old state up, as a decode loop
    does) and return that tensor: the step then reads and writes C once, where a new C and a
    copy back into a fixed buffer (a CUDA graph's) would move it twice more. n', m' are new
    tensors either way. Needs a state with a contiguous C in the state dtype (float32; float64
    for float64 inputs).
    """
    check_tensor("q", q, (None, None, None), "B,H,K")
    B, H, K = q.shape
    check_head_dim("the head dimension K of q [B,H,K]", K)
    check_tensor("k", k, (B, H, K), "B,H,K")
    check_tensor("v", v, (B, H, None), "B,H,V")
    V = v.shape[-1]
    check_tensor("i", i, (B, H), "B,H")
    check_tensor("f", f, (B, H), "B,H")
    check_same_device(q=q, k=k, v=v, i=i, f=f)
    eps = _check_eps(eps)
    if state is not None:
        _check_state(state, B, H, K, V, q.device, "state")
    cd = compute_dtype(q, k, v, i, f)
    needs_grad = torch.is_grad_enabled() and any(
        x.requires_grad for x in (q, k, v, i, f, *(state or ())))
    if inplace:
        C0 = None if state is None else state[0]
        if C0 is None or C0.dtype != cd or not C0.is_contiguous():
            raise XLSTMKitError(
                f"mlstm_step(inplace=True) needs a state whose C is a contiguous {cd} tensor, got "
                + ("no state" if C0 is None else f"C {C0.dtype}, contiguous={C0.is_contiguous()}"))
    if choose_backend("mlstm_step", None, q.device, dtype=cd, requires_grad=needs_grad) == "triton":
        from .triton.step import mlstm_step_triton

        with on_device(q):
            return mlstm_step_triton(q, k, v, i, f, state, eps=eps, inplace=inplace)
    if state is None:
        z = q.new_zeros((), dtype=cd)
        state = (z.expand(B, H, K, V), z.expand(B, H, K), z.expand(B, H))
    C, n, m = (s.to(cd) for s in state)
    h, (C_new, n_new, m_new) = mlstm_step_naive(q.to(cd), k.to(cd), v.to(cd), i.to(cd), f.to(cd), C, n, m, eps)
    if inplace:
        C_new = C.copy_(C_new)
    return h.to(q.dtype), (C_new, n_new, m_new)
