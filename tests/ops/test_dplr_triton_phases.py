"""Each phase of the chunkwise DPLR kernels against its own PyTorch reference (the `*_reference`
functions next to the kernels, float64), one kernel launch per test.

Every kernel is fed float32 copies of its inputs as the previous phase's reference produces them,
so a failure points at one kernel. The references work in the chunk layout [BH, Tp, ·]; the
kernels read q, k, v, a, b, δO and write O and the gradients in the caller's [B, T, H, ·] layout,
here B = 1 and H = BH (`seq`, `unseq`). Tiny shapes under TRITON_INTERPRET=1 on CPU (products at
"ieee", the interpreter's only float32 precision), the same on CUDA.
"""
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err

triton = pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
if not HAS_CUDA and not INTERPRET:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from xlstm_kit.ops.dplr.triton.backward import _bwd_dv, bwd_dk_reference, bwd_dv_reference  # noqa: E402
from xlstm_kit.ops.dplr.triton.common import SUB  # noqa: E402
from xlstm_kit.ops.dplr.triton.dplr_dk import _bwd_dk_pairs, _bwd_dk_state  # noqa: E402
from xlstm_kit.ops.dplr.triton.pairs import _fwd_pairs, pairs_reference  # noqa: E402
from xlstm_kit.ops.dplr.triton.state import (  # noqa: E402
    _bwd_state, _fwd_state, bwd_state_reference, state_reference)
from xlstm_kit.ops.dplr.triton.wy import _fwd_wy, wy_reference  # noqa: E402

DEV = "cpu" if INTERPRET else "cuda"
PREC = "ieee"
BH, NC, L, K, V = 2, 2, 32, 16, 32          # two chunks of two column sub-chunks
TP = NC * L
SCALE = 0.3


def f32(x):
    return x.detach().to(DEV, torch.float32).contiguous()


def seq(x):
    """A chunk-layout [BH, TP, D] tensor as the caller's [1, TP, BH, D] (float32 on DEV)."""
    return f32(x.transpose(0, 1).unsqueeze(0))


def unseq(y):
    """[1, TP, BH, D] → [BH, TP, D]."""
    return y[0].transpose(0, 1)


IO = (TP, BH)       # the kernels' T, H


@pytest.fixture(scope="module")
def chain():
    """Chunk-layout inputs ([BH, Tp, ·]) and every phase's float64 reference output."""
    torch.manual_seed(0)
    q = torch.randn(BH, TP, K, dtype=torch.float64)
    k = torch.randn(BH, TP, K, dtype=torch.float64) / K ** 0.5
    a = F.normalize(torch.randn(BH, TP, K, dtype=torch.float64), dim=-1)
    b = -a * torch.rand(BH, TP, 1, dtype=torch.float64)
    v = torch.randn(BH, TP, V, dtype=torch.float64)
    gk = torch.rand(BH, TP, K, dtype=torch.float64) * -3.0
    G = gk.view(BH, NC, L, K).cumsum(2).view(BH, TP, K)
    h0 = torch.randn(BH, K, V, dtype=torch.float64)
    r = dict(q=q, k=k, a=a, b=b, v=v, gk=gk, G=G, h0=h0)
    r.update(zip(("Aqk", "Aqa", "Abk", "Aba"), pairs_reference(q, k, a, b, G, SCALE, L)))
    r.update(wy_reference(q, k, a, b, v, G, r["Abk"], r["Aba"], SCALE, L))
    r.update(state_reference(*(r[n] for n in ("Qg", "Kd", "Ad", "eGl", "v", "Aqk", "Aqa", "W", "Cm",
                                              "h0")), L))
    r["dO"] = torch.randn(BH, TP, V, dtype=torch.float64)
    r["dhT"] = torch.randn(BH, K, V, dtype=torch.float64)
    r.update(bwd_state_reference(*(r[n] for n in ("Qg", "Ad", "eGl", "Aqa", "W", "dO", "dhT")), L))
    r.update(bwd_dv_reference(*(r[n] for n in ("Kd", "v", "Aqk", "Abk", "E", "V2", "dO", "dH",
                                               "dV2")), L))
    return r


def empty(*shape):
    return torch.empty(*shape, device=DEV, dtype=torch.float32)


def test_pairs_reference_is_the_sum_over_steps(chain):
    # the reference itself, one entry by the definition: A_qa[r, i] = Σ_k s·q_r a_i e^{G_r − G_i}
    c = chain
    r, i = 20, 5
    want = (SCALE * c["q"][1, r] * c["a"][1, i] * (c["G"][1, r] - c["G"][1, i]).exp()).sum()
    assert torch.allclose(c["Aqa"][1, 0, r, i], want)
    assert c["Abk"][1, 0, 7, 7] == 0 and c["Aqk"][1, 0, 7, 7] != 0 and c["Aqk"][1, 0, 3, 9] == 0


def test_fwd_pairs_phase(chain):
    c = chain
    A = [empty(BH, NC, L, L) for _ in range(4)]
    _fwd_pairs[(NC * (L // SUB), BH)](seq(c["q"]), seq(c["k"]), seq(c["a"]), seq(c["b"]),
                                      c["G"].to(DEV).contiguous(), *A, SCALE, TP, NC, *IO,
                                      K=K, L=L, S=SUB, BK=16, PREC=PREC, LO=0)
    for name, x in zip(("Aqk", "Aqa", "Abk", "Aba"), A):
        assert rel_err(x.cpu(), c[name]) < 1e-6, name


def test_fwd_wy_phase(chain):
    c = chain
    out = dict(E=empty(BH, NC, L, L), W=empty(BH, TP, K), Cm=empty(BH, TP, V), Qg=empty(BH, TP, K),
               Kd=empty(BH, TP, K), Ad=empty(BH, TP, K), eGl=empty(BH, NC, K))
    _fwd_wy[(NC, BH)](*(seq(c[n]) for n in "qkabv"), c["G"].to(DEV).contiguous(),
                      f32(c["Abk"]), f32(c["Aba"]), *out.values(), SCALE, TP, NC, *IO,
                      K=K, V=V, L=L, S=SUB, BK=16, BV=16, PREC=PREC)
    for name, x in out.items():
        assert rel_err(x.cpu(), c[name]) < 1e-6, name


@pytest.mark.parametrize("with_h0", [True, False])
def test_fwd_state_phase(chain, with_h0):
    c = chain
    ins = [c[n] for n in ("Qg", "Kd", "Ad", "eGl", "v", "Aqk", "Aqa", "W", "Cm")]
    ref = state_reference(*ins, c["h0"] if with_h0 else None, L)
    out = dict(Hs=empty(BH, NC, K, V), V2=empty(BH, TP, V), O=empty(1, TP, BH, V), hT=empty(BH, K, V))
    ins = [seq(x) if x is c["v"] else f32(x) for x in ins]
    _fwd_state[(V // 16, BH)](*ins, f32(c["h0"]) if with_h0 else out["hT"],
                              *out.values(), TP, NC, *IO, K=K, V=V, L=L, BV=16, HAS_H0=with_h0,
                              PREC=PREC, LO=0)
    out["O"] = unseq(out["O"])
    for name, x in out.items():
        assert rel_err(x.cpu(), ref[name]) < 1e-6, name


def test_bwd_state_phase(chain):
    c = chain
    out = dict(dH=empty(BH, NC, K, V), dV2=empty(BH, TP, V), dh0=empty(BH, K, V))
    _bwd_state[(V // 16, BH)](*(seq(c[n]) if n == "dO" else f32(c[n])
                                for n in ("Qg", "Ad", "eGl", "Aqa", "W", "dO", "dhT")),
                              *out.values(), TP, NC, *IO, K=K, V=V, L=L, BV=16, HAS_DHT=True, PREC=PREC)
    for name, x in out.items():
        assert rel_err(x.cpu(), c[name]) < 1e-6, name


def test_bwd_dv_phase(chain):
    c = chain
    out = dict(GC=empty(BH, TP, V), dAqk=empty(BH, NC, L, L), dAqa=empty(BH, NC, L, L),
               dAbk=empty(BH, NC, L, L), dAba=empty(BH, NC, L, L), dv=empty(1, TP, BH, V),
               dqk_d=empty(BH, TP), dqa_d=empty(BH, TP))
    _bwd_dv[(NC, BH)](*(seq(c[n]) if n in ("v", "dO") else f32(c[n])
                        for n in ("Kd", "v", "Aqk", "Abk", "E", "V2", "dO", "dH", "dV2")),
                      *out.values(), TP, NC, *IO, K=K, V=V, L=L, BK=16, BV=16, PREC=PREC, LO=0, LV=0, LG=0)
    out["dv"] = unseq(out["dv"])
    for name, x in out.items():
        assert rel_err(x.cpu(), c[name]) < 1e-6, name


def test_bwd_dk_phase(chain):
    # the K-side gradients, gate gradient included, against autograd through the forward's chunk
    # operands (pair matrices, decayed operands) fed the V side's gradients; its two kernels
    # (dplr_dk.py: the pair parts per sub-chunk and K-tile into scratch, then the rest per chunk)
    c = chain
    dA = [c[n] for n in ("dAqk", "dAqa", "dAbk", "dAba")]
    G = c["G"].to(DEV).contiguous()
    parts = [empty(BH, TP, K) for _ in range(4)]
    _bwd_dk_pairs[(NC * (L // SUB), K // 16, BH)](*(seq(c[n]) for n in "qkab"), G, *(f32(x) for x in dA),
                                                  *parts, SCALE, TP, NC, *IO, K=K, L=L, S=SUB, BK=16,
                                                  PREC=PREC, LO=0)
    out = [empty(1, TP, BH, K) for _ in range(5)]
    _bwd_dk_state[(NC, BH)](*(seq(c[n]) for n in "qkvab"), G,
                            *(seq(c[n]) if n == "dO" else f32(c[n]) for n in ("V2", "Hs", "dO", "dH", "GC")),
                            *parts, f32(c["dqk_d"]), f32(c["dqa_d"]), *out, SCALE, TP, NC, *IO, K=K, V=V,
                            L=L, BK=16, BV=16, PREC=PREC, LO=0)
    out = [unseq(x) for x in out]
    ref = bwd_dk_reference(*(c[n] for n in ("q", "k", "v", "a", "b", "gk", "V2", "Hs", "dO", "dH",
                                            "GC")), dA, c["dqk_d"], c["dqa_d"], SCALE, L)
    for name, x, y in zip(("dq", "dk", "da", "db", "dgk"), out, ref):
        assert rel_err(x.cpu(), y) < 1e-5, name
