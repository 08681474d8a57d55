"""Gate prologue (_gate_prep) against its float64 reference."""
import torch

from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import DEV
from xlstm_kit.ops.mlstm.triton import gates
from xlstm_kit.ops.mlstm.triton._common import NEG


def test_gate_prep_matches_float64():
    """β (hi + lo) = in-chunk cumsum of log σ(f) to float64 accuracy, ĩ, u = β + cummax(ĩ − β),
    and xm (ĩ − β at a chunk's new running max, else NEG), with a padded tail (log f = 0, ĩ =
    NEG there); f spans closed to open gates."""
    B, T, H, L = 2, 45, 3, 16
    i = torch.randn(B, T, H) * 8.0
    f = torch.randn(B, T, H) * 10.0
    hi, lo, ig, u, xm = gates.gates_padded(i.to(DEV), f.to(DEV), L)
    beta, ig64, u64, xm64 = (x.reshape(B, H, -1) for x in ref.gates(i, f, L))
    assert (hi.cpu().double() + lo.cpu().double() - beta).abs().max() < 1e-12 * beta.abs().max()
    assert torch.equal(ig.cpu(), ig64.float())
    assert torch.allclose(u.cpu().double(), u64, rtol=1e-6, atol=1e-5)
    new_max = xm64 != NEG
    assert 0 < new_max.sum() < new_max.numel()  # both kinds of steps occur
    xm = xm.cpu().reshape(B, H, -1)
    assert torch.equal(xm != NEG, new_max)
    assert torch.allclose(xm[new_max], xm64[new_max], rtol=1e-12, atol=1e-12)


def test_gate_tail_adds_the_stabilizer_chain():
    """The epilogue (_gate_tail): from the fixed-stabilizer gate gradients (autograd through the
    float64 chunk references, stabilizers detached), the row factors and δm_T, it must return
    the full δi, δf and δm_0 of the recurrent float64 loop. Extreme gates (the chain switches
    branch often); blocks of 16 steps, so the carry crosses three block boundaries."""
    import torch.nn.functional as F

    from tests.helpers import rel_err
    from tests.ops.mlstm_triton.phase_inputs import make
    from xlstm_kit.ops.mlstm.naive import mlstm_recurrent_naive

    x = make(seed=3, gates="extreme")
    B, T, H, K = x["q"].shape
    NC, L, eps = x["NC"], x["L"], 1e-6
    q, k, v = (x[n].cpu().double() for n in "qkv")
    zC, zn = torch.zeros(B, H, K, v.shape[-1], dtype=torch.float64), torch.zeros(B, H, K, dtype=torch.float64)
    i, f, m0 = (x[n].cpu().double().requires_grad_(True) for n in ("i", "f", "m0"))
    h, (C, n, m) = mlstm_recurrent_naive(q, k, v, i, f, (zC, zn, m0), eps)
    dh, dCf, dnf, dmf = torch.randn_like(h), torch.randn_like(C), torch.randn_like(n), torch.randn_like(m)
    loss = (h * dh).sum() + (C * dCf).sum() + (n * dnf).sum() + (m * dmf).sum()
    want = torch.autograd.grad(loss, [i, f, m0])

    lf = F.logsigmoid(f.detach()).permute(0, 2, 1).requires_grad_(True)
    ig = i.detach().permute(0, 2, 1).requires_grad_(True)
    pad = NC * L - T
    beta = F.pad(lf, (0, pad)).reshape(B, H, NC, L).cumsum(-1)
    igp = F.pad(ig, (0, pad), value=NEG).reshape(B, H, NC, L)
    u = beta + torch.cummax(igp - beta, -1).values
    cs, ns, ms, (Cf, nf) = ref.chunk_states(k, v, beta, igp, u, zC, zn, m0.detach())
    h2, nbar, mrow = ref.chunk_output(q, k, v, beta, igp, u, cs, ns, ms, eps)
    dlf, di = torch.autograd.grad((h2 * dh).sum() + (Cf * dCf).sum() + (nf * dnf).sum(), [lf, ig])
    r = ref.row_factors(dh, h2.detach(), nbar.reshape(B, H, -1)[..., :T], mrow.reshape(B, H, -1)[..., :T], eps)[0]
    elast = dmf - (dCf * Cf.detach()).sum((-2, -1)) - (dnf * nf.detach()).sum(-1)

    f32 = lambda t: F.pad(t, (0, pad)).float().contiguous().to(DEV)
    xm = x["gates"][4]
    dio, dfo, dm0 = gates.gate_tail(x["i"], x["f"], ms.float().to(DEV), xm, f32(r), f32(dlf), f32(di),
                                    elast.contiguous().to(DEV), eps, L, 16)
    for name, a, b in zip(("di", "df", "dm0"), (dio, dfo, dm0), want):
        assert rel_err(a.cpu(), b) < 1e-5, (name, rel_err(a.cpu(), b))
