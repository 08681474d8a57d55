"""Forward output (_fwd_out) against the float64 chunk formula, fed the reference's states."""
import torch

from tests.helpers import rel_err
from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import make
from xlstm_kit.ops.mlstm.triton import output


def test_output_matches_reference():
    x = make()
    B, T, H, K = x["q"].shape
    NC, L = x["NC"], x["L"]
    cs, ns, ms, _ = ref.chunk_states(x["k"].cpu(), x["v"].cpu(), *x["ref_gates"],
                                     x["C0"].cpu(), x["n0"].cpu(), x["m0"].cpu())
    h64, nbar64, mrow64 = ref.chunk_output(x["q"].cpu(), x["k"].cpu(), x["v"].cpu(), *x["ref_gates"], cs, ns, ms, 1e-6)
    dev = x["q"].device
    h = torch.empty_like(x["v"])
    nbar = torch.empty(B, H, NC * L, device=dev)
    mrow = torch.empty_like(nbar)
    beta, blo, ig, u, _ = x["gates"]
    cfg = x["cfg"].replace(out_bk=16, out_bv=16)  # K = 24 over two tiles, V = 40 over three
    output.fwd_out(x["q"], x["k"], x["v"], beta, blo, ig, u, cs.float().to(dev), ns.float().to(dev),
                   ms.float().to(dev), h, h, nbar, mrow, 1e-6, cfg, 2, "ieee")
    assert rel_err(h.cpu(), h64) < 1e-5
    valid = lambda t: t.reshape(B, H, NC * L)[..., :T]
    assert rel_err(valid(nbar.cpu()), valid(nbar64)) < 1e-5
    assert rel_err(valid(mrow.cpu()), valid(mrow64)) < 1e-6
