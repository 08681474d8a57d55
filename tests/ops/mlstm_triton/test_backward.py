"""Per-chunk backward (_bwd_fused, or _bwd_dqk + _bwd_dv for large K) against autograd through
the float64 chunk references with the stabilizers held fixed: δq, δk, δv and the log-gate
gradients δlog f, δĩ, given the reference's states, row factors and δ-states."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import make
from xlstm_kit.ops.mlstm.triton import backward
from xlstm_kit.ops.mlstm.triton._common import NEG


@pytest.mark.parametrize("path", ["fused", "k_tiled"])
def test_chunk_backward_matches_autograd(path):
    x = make(seed=2, gates="normal")
    B, T, H, K = x["q"].shape
    V, NC, L = x["v"].shape[-1], x["NC"], x["L"]
    eps = 1e-6
    # float64 forward from q, k, v, log f, ĩ with autograd; stabilizers fixed
    q, k, v = (x[n].cpu().double().requires_grad_(True) for n in "qkv")
    lf = F.logsigmoid(x["f"].cpu().double()).permute(0, 2, 1).detach().requires_grad_(True)   # [B,H,T]
    ig = x["i"].cpu().double().permute(0, 2, 1).detach().requires_grad_(True)
    pad = NC * L - T
    beta = F.pad(lf, (0, pad)).reshape(B, H, NC, L).cumsum(-1)
    igp = F.pad(ig, (0, pad), value=NEG).reshape(B, H, NC, L)
    u = beta + torch.cummax(igp - beta, -1).values
    C0, n0, m0 = (x[n].cpu().double() for n in ("C0", "n0", "m0"))
    cs, ns, ms, (Cf, nf) = ref.chunk_states(k, v, beta, igp, u, C0, n0, m0)
    h, nbar, mrow = ref.chunk_output(q, k, v, beta, igp, u, cs, ns, ms, eps)
    dh, dCf, dnf = torch.randn_like(h), torch.randn_like(Cf), torch.randn_like(nf)
    loss = (h * dh).sum() + (Cf * dCf).sum() + (nf * dnf).sum()
    want = torch.autograd.grad(loss, [q, k, v, lf, ig])

    with torch.no_grad():
        nb, mr = nbar.reshape(B, H, -1)[..., :T], mrow.reshape(B, H, -1)[..., :T]
        r, rd, g = (F.pad(t, (0, pad)).reshape(B, H, NC, L) for t in ref.row_factors(dh, h, nb, mr, eps))
        dcs, dns, _ = ref.chunk_dstates(q, dh, beta, u, rd, g, ms, dCf, dnf)
    dev = x["q"].device
    f32 = lambda t: t.detach().float().contiguous().to(dev)
    flat = lambda t: f32(t.reshape(B, H, NC * L))
    cfg = x["cfg"].replace(fused_bv=16) if path == "fused" else x["cfg"].replace(fused_max_k=0, dqk_bk=16, dqk_bv=16,
                                                                                 dv_bk=16, dv_bv=16)
    beta32, blo32, ig32, u32, _ = x["gates"]
    dq, dk, dv, dlf, di = backward.bwd_chunks(
        x["q"], x["k"], x["v"], f32(dh), beta32, blo32, ig32, u32, flat(rd), flat(g), f32(ms), f32(cs), f32(ns),
        f32(dcs), f32(dns), f32(dCf), cfg, 2, "ieee")
    got = (dq, dk, dv, dlf.reshape(B, H, -1)[..., :T], di.reshape(B, H, -1)[..., :T])
    for name, a, b in zip(("dq", "dk", "dv", "dlf", "di"), got, want):
        assert rel_err(a.cpu(), b) < 1e-5, (name, rel_err(a.cpu(), b))
