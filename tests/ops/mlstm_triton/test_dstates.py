"""Backward per-row factors (_bwd_rows) and δ-state passing (_bwd_dstates, or _bwd_local +
reverse _state_scan) against their float64 references."""
import pytest
import torch

from tests.helpers import rel_err
from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import make
from xlstm_kit.ops.mlstm.triton import backward, scan, states


def _forward_rows(x):
    """h, n̄ and m per row from the reference forward (float64, [B,H,NC·L] for n̄, m)."""
    cs, ns, ms, _ = ref.chunk_states(x["k"].cpu(), x["v"].cpu(), *x["ref_gates"],
                                     x["C0"].cpu(), x["n0"].cpu(), x["m0"].cpu())
    h, nbar, mrow = ref.chunk_output(x["q"].cpu(), x["k"].cpu(), x["v"].cpu(), *x["ref_gates"], cs, ns, ms, 1e-6)
    B, H = nbar.shape[:2]
    return h, nbar.reshape(B, H, -1), mrow.reshape(B, H, -1), ms


def test_row_factors_match_reference():
    x = make()
    T = x["q"].shape[1]
    h, nbar, mrow, _ = _forward_rows(x)
    assert (nbar.abs() > torch.exp(-mrow))[..., :T].any() and (nbar.abs() < torch.exp(-mrow))[..., :T].any()
    dh = torch.randn_like(h)
    dev = x["q"].device
    r, rd, g = backward.bwd_rows(dh.float().to(dev), h.float().to(dev), torch.empty(0, device=dev),
                                 nbar.float().to(dev), mrow.float().to(dev), 1e-6)
    for name, a, b in zip(("r", "rd", "g"), (r, rd, g), ref.row_factors(dh, h, nbar[..., :T], mrow[..., :T], 1e-6)):
        assert rel_err(a.cpu()[..., :T], b) < 1e-5, name
        assert (a.cpu()[..., T:] == 0).all(), name  # padded rows carry nothing


@pytest.mark.parametrize("path", ["sequential", "scan"])
def test_dstates_match_reference(path):
    x = make(seed=1, gates="normal")
    B, T, H, K = x["q"].shape
    V, NC, L = x["v"].shape[-1], x["NC"], x["L"]
    h, nbar, mrow, ms = _forward_rows(x)
    dh = torch.randn_like(h)
    r, rd, g = (torch.nn.functional.pad(t, (0, NC * L - T)) for t in ref.row_factors(dh, h, nbar[..., :T], mrow[..., :T], 1e-6))
    dCf, dnf = torch.randn(B, H, K, V), torch.randn(B, H, K)
    as4 = lambda t: t.reshape(B, H, NC, L)
    beta64, _, u64 = x["ref_gates"]
    dcs64, dns64, (dC0_64, dn0_64) = ref.chunk_dstates(x["q"].cpu(), dh, beta64, u64, as4(rd), as4(g), ms, dCf, dnf)

    dev = x["q"].device
    e = lambda *s: torch.empty(*s, device=dev)
    out = (e(B, H, NC, K, V), e(B, H, NC, K), e(B, H, K, V), e(B, H, K))
    cfg = x["cfg"].replace(dstates_bk=16, dstates_bv=16, local_bk=16, local_bv=16, scan_g=2, scan_be=32)
    beta, blo, _, u, _ = x["gates"]
    f32 = lambda t: t.float().to(dev)
    if path == "sequential":
        states.bwd_dstates(x["q"], f32(dh), beta, u, f32(rd), f32(g), f32(ms), f32(dCf), f32(dnf), out, cfg, 2, "ieee")
    else:
        scan.bwd_dstates_scan(x["q"], f32(dh), beta, blo, u, f32(rd), f32(g), f32(ms), f32(dCf), f32(dnf), out, cfg,
                              2, "ieee")
    for name, a, b in zip(("dcs", "dns", "dC0", "dn0"), out, (dcs64, dns64, dC0_64, dn0_64)):
        assert rel_err(a.cpu(), b) < 1e-5, (name, rel_err(a.cpu(), b))
