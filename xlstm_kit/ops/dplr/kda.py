"""KDA (Kimi Delta Attention) as the DPLR special case a = k, b = β k, v ← β v (Kimi Linear, arXiv 2510.26692).

S_t = S_{t-1} Diag(α_t)(I − β_t k_t k_tᵀ) + β_t v_t k_tᵀ, α_t = exp(g_t): the decayed state is
corrected towards v_t along k_t with step β_t. Gradients reach k, v, g and β through autograd of
the substitution and the DPLR backward.
"""
from __future__ import annotations

from .._checks import check_head_dim, check_same_device, check_tensor
from .chunkwise import dplr_chunkwise
from .naive import compute_dtype


def check_kda_inputs(q, k, v, g, beta, initial_state=None) -> None:
    check_tensor("q", q, (None, None, None, None), "B,T,H,K")
    B, T, H, K = q.shape
    check_head_dim("the head dimension K of q [B,T,H,K]", K)
    check_tensor("k", k, (B, T, H, K), "B,T,H,K")
    check_tensor("g", g, (B, T, H, K), "B,T,H,K")
    check_tensor("v", v, (B, T, H, None), "B,T,H,V")
    check_tensor("beta", beta, (B, T, H), "B,T,H")
    if initial_state is not None:
        check_tensor("initial_state", initial_state, (B, H, K, v.shape[-1]), "B,H,K,V")
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)


def kda_chunkwise(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  chunk_size=64):
    """KDA, chunkwise (through dplr_chunkwise with a = k, b = βk, v ← βv).

    Args:
        q, k, g: [B, T, H, K]; g is the per-channel log decay (≤ 0).
        v: [B, T, H, V].  beta: [B, T, H].
        scale: query scale, default 1/√K.
        initial_state: [B, H, K, V] or None.  output_final_state: return the final state.
    Returns:
        (o [B, T, H, V] in q's dtype, final state [B, H, K, V] float32/float64 or None).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state)
    # the products are formed in compute precision so bf16 inputs are rounded only once
    cd = compute_dtype(q, k, v, g, beta, initial_state)
    kc, beta_ = k.to(cd), beta.to(cd).unsqueeze(-1)
    return dplr_chunkwise(q, kc, v.to(cd) * beta_, kc, kc * beta_, g, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, chunk_size=chunk_size)
