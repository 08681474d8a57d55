"""Float64 PyTorch references of the chunkwise mLSTM kernel phases (xlstm_kit.ops.mlstm.triton),
written from the formulas of the package docstring, one per phase. Gate and state tensors are
[B, H, NC, L] / [B, H, NC, ...]; sequence tensors [B, T, H, D]. The stabilizers are computed
from detached values, so autograd through these functions gives the fixed-stabilizer
gradients that the backward kernels compute."""
import torch
import torch.nn.functional as F

from xlstm_kit.ops.mlstm.triton._common import NEG


def chunked(x, L):
    """[B, T, H, D] → [B, H, NC, L, D] float64, zero-padded to NC·L steps."""
    B, T, H, D = x.shape
    NC = -(-T // L)
    x = F.pad(x.double(), (0, 0, 0, 0, 0, NC * L - T))
    return x.reshape(B, NC, L, H, D).permute(0, 3, 1, 2, 4)


def unchunked(x, T):
    """[B, H, NC, L, D] → [B, T, H, D]."""
    B, H, NC, L, D = x.shape
    return x.permute(0, 2, 3, 1, 4).reshape(B, NC * L, H, D)[:, :T]


def gates(i, f, L):
    """Prologue: β (in-chunk cumsum of log σ(f)), ĩ, u = β + cummax(ĩ − β) and xm (ĩ − β at a
    new running max of its chunk, else NEG), each [B, H, NC, L]; padded steps log f = 0, ĩ = NEG."""
    B, T, H = i.shape
    NC = -(-T // L)
    lf = F.pad(F.logsigmoid(f.double()).permute(0, 2, 1), (0, NC * L - T)).reshape(B, H, NC, L)
    ig = F.pad(i.double().permute(0, 2, 1), (0, NC * L - T), value=NEG).reshape(B, H, NC, L)
    beta = lf.cumsum(-1)
    x = ig - beta
    cm = torch.cummax(x, -1).values
    return beta, ig, beta + cm, torch.where(x == cm, x, torch.full_like(x, NEG))


def chunk_states(k, v, beta, ig, u, C0, n0, m0):
    """Forward state passing: the states entering every chunk, cs [B,H,NC,K,V], ns [B,H,NC,K],
    ms [B,H,NC+1] (ms[NC] the final m), and the final (C, n)."""
    L = beta.shape[-1]
    kc, vc = chunked(k, L), chunked(v, L)
    C, n, m = C0.double(), n0.double(), m0.double()
    cs, ns, ms = [], [], [m]
    for c in range(beta.shape[2]):
        cs.append(C)
        ns.append(n)
        b_last = beta[:, :, c, -1]
        m_next = torch.maximum(b_last.detach() + m, u[:, :, c, -1].detach())
        decay = torch.exp(b_last + m - m_next)
        w = torch.exp(b_last[..., None] - beta[:, :, c] + ig[:, :, c] - m_next[..., None])
        C = decay[..., None, None] * C + torch.einsum("bhl,bhlk,bhlv->bhkv", w, kc[:, :, c], vc[:, :, c])
        n = decay[..., None] * n + torch.einsum("bhl,bhlk->bhk", w, kc[:, :, c])
        m = m_next
        ms.append(m)
    return torch.stack(cs, 2), torch.stack(ns, 2), torch.stack(ms, 2), (C, n)


def chunk_output(q, k, v, beta, ig, u, cs, ns, ms, eps):
    """Forward output from the chunk-start states: h [B,T,H,V] and per row n̄, m [B,H,NC,L]."""
    T, K = q.shape[1], q.shape[-1]
    L = beta.shape[-1]
    qc, kc, vc = chunked(q, L), chunked(k, L), chunked(v, L)
    scale = K ** -0.5
    m_prev = ms[:, :, :-1, None].detach()
    m_row = torch.maximum(beta.detach() + m_prev, u.detach())
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    D = beta[..., :, None] - beta[..., None, :] + ig[..., None, :] - m_row[..., :, None]
    P = (qc @ kc.transpose(-1, -2)) * scale * torch.where(causal, D, torch.full_like(D, NEG)).exp()
    ea = torch.exp(beta + m_prev - m_row)
    nbar = ea * scale * (qc @ ns[..., None])[..., 0] + P.sum(-1)
    num = (ea * scale)[..., None] * (qc @ cs) + P @ vc
    den = torch.maximum(nbar.abs(), torch.exp(-m_row)) + eps
    return unchunked(num / den[..., None], T).contiguous(), nbar, m_row


def row_factors(dh, h, nbar, m_row, eps):
    """Per-row factors of δh, [B,H,T]: r = δh·h/d, 1/d and δn̄ = −r·sign(n̄) where |n̄| wins the
    max of the denominator (else 0); nbar, m_row [B,H,T]."""
    den = torch.maximum(nbar.abs(), torch.exp(-m_row)) + eps
    r = (dh.double() * h.double()).sum(-1).permute(0, 2, 1) / den
    g = torch.where(nbar.abs() > torch.exp(-m_row), -r * torch.sign(nbar), torch.zeros_like(r))
    return r, 1.0 / den, g


def chunk_dstates(q, dh, beta, u, rd, g, ms, dCf, dnf):
    """Backward state passing (stabilizers fixed): δC, δn at the end of every chunk, dcs
    [B,H,NC,K,V], dns [B,H,NC,K], and the initial state's (δC_0, δn_0); rd, g [B,H,NC,L]."""
    K, L = q.shape[-1], beta.shape[-1]
    qc, dhc = chunked(q, L), chunked(dh, L)
    dC, dn = dCf.double(), dnf.double()
    dcs, dns = [], []
    for c in reversed(range(beta.shape[2])):
        dcs.append(dC)
        dns.append(dn)
        m_prev, m_next = ms[:, :, c], ms[:, :, c + 1]
        b = beta[:, :, c]
        sea = K ** -0.5 * torch.exp(b + m_prev[..., None] - torch.maximum(b + m_prev[..., None], u[:, :, c]))
        decay = torch.exp(b[..., -1] + m_prev - m_next)
        dC = decay[..., None, None] * dC + torch.einsum("bhl,bhlk,bhlv->bhkv", sea * rd[:, :, c], qc[:, :, c], dhc[:, :, c])
        dn = decay[..., None] * dn + torch.einsum("bhl,bhlk->bhk", sea * g[:, :, c], qc[:, :, c])
    return torch.stack(dcs[::-1], 2), torch.stack(dns[::-1], 2), (dC, dn)
