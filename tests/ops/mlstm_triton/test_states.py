"""Forward state passing: the sequential kernel (_fwd_states) and the parallel path (_m_chain,
_fwd_local, _state_scan) against the float64 chunk loop, which is itself checked against the
recurrent reference's final state."""
import pytest
import torch

from tests.helpers import rel_err
from tests.ops.mlstm_triton import reference as ref
from tests.ops.mlstm_triton.phase_inputs import make
from xlstm_kit.ops.mlstm.naive import mlstm_recurrent_naive
from xlstm_kit.ops.mlstm.triton import scan, states


@pytest.mark.parametrize("path", ["sequential", "scan"])
def test_chunk_start_states_match_reference(path):
    x = make()
    B, T, H, K = x["k"].shape
    V, NC = x["v"].shape[-1], x["NC"]
    cs64, ns64, ms64, (Cf64, nf64) = ref.chunk_states(x["k"].cpu(), x["v"].cpu(), *x["ref_gates"],
                                                      x["C0"].cpu(), x["n0"].cpu(), x["m0"].cpu())
    # the reference against the recurrent loop (an independent check of the chunked maths)
    args64 = [x[n].cpu().double() for n in "qkvif"]
    _, (C_r, n_r, m_r) = mlstm_recurrent_naive(*args64, tuple(x[n].cpu().double() for n in ("C0", "n0", "m0")), 1e-6)
    assert rel_err(Cf64, C_r) < 1e-12 and rel_err(ms64[..., -1], m_r) < 1e-12

    cfg = x["cfg"].replace(states_bk=16, states_bv=16, local_bk=16, local_bv=16, scan_g=2, scan_be=32)
    e = lambda *s: torch.empty(*s, device=x["k"].device)
    out = (e(B, H, NC, K, V), e(B, H, NC, K), e(B, H, NC + 1), e(B, H, K, V), e(B, H, K), e(B, H))
    run = states.fwd_states if path == "sequential" else scan.fwd_states_scan
    beta, blo, ig, u, _ = x["gates"]
    run(x["k"], x["v"], beta, blo, ig, u, x["C0"], x["n0"], x["m0"], out, cfg, 2, "ieee")
    cs, ns, ms, Cf, nf, mf = (t.cpu() for t in out)
    for name, a, b in [("cs", cs, cs64), ("ns", ns, ns64), ("ms", ms, ms64), ("C", Cf, Cf64), ("n", nf, nf64),
                       ("m", mf, ms64[..., -1])]:
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
