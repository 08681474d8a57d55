"""Seeded fuzz test of the three fused one-token block steps (ops/blocks/decode.py,
slstm_decode.py, large_decode.py) under TRITON_INTERPRET=1.

Each case draws a block (MLSTMBlock, SLSTMBlock or LargeBlock) with a random shape in the ranges
its constructor allows (head widths that are not powers of two, qk head dim != v head dim, batch
1..8, sometimes wide enough for the kernels' multi-tile paths), random GEMV tiles for the sLSTM
and large steps, every parameter moved off its init by noise of a random std (0.1..2; the init
zeroes gate and recurrent weights and sets the norms to one), sometimes extreme gate biases
(±20: the stabiliser paths), a random state (m of either sign, sometimes ±30; the sLSTM's n > 0)
and an input x of random scale (2^-10..2^10), sometimes on a large mean offset (8..8192 times
its spread).

The contract every case is held to:
- the block in float32 with backend "triton" takes its fused step (`_fused_step` is True), except
  an mLSTM block whose convolution is narrower than 2 or whose q/k/v block size is not a power of
  two: the fused step's `supports` refuses those, and the step must be the PyTorch step, bitwise;
- the output and every state tensor the fused step returns equal the block's PyTorch step in
  float64 (backend "torch": the sLSTM layer's sequence kernels refuse float64 under "triton") to
  a relative error (norm over the whole tensor) of TOL = 1e-5, the unit tests' bound, where the
  case does not amplify float32 rounding (most cases: ~1e-7). Where it does, the bound is the
  larger of two estimates of what float32 cannot avoid:
  * TOL + COND_FACTOR x the case's condition (`_condition`: the float64 step's response to a
    random relative 2^-24 perturbation of every parameter and state element). It is large where
    gate pre-activations of 1e2..1e3, summed from terms of both signs, go into exp() (an
    absolute error of 1e-4 there is a relative error of 1e-4 in C and n). For the sLSTM's
    output with an offset x it adds the float64 output's change when the feed-forward
    LayerNorm's mean moves by SHIFT_ULPS ulps of it: that norm's input x1 = x + norm(h') is
    float32 and carries the offset, so its mean is off by a few ulps of the offset, up to 1e-3
    of its spread;
  * the project's usual rule, 2 x the float32 PyTorch step's own error + 1e-6: it sees what an
    input perturbation cannot, rounding that breaks a structure (h = (q.k) v / |q.n| with q.k
    and q.n cancelling alike: rounding each product apart leaves h off by u |q||k| / |q.k|,
    a perturbation of q or k does not). Alone it would be too tight at times and too loose at
    others: it is one draw of a rounding error (the fused step's was up to 3.4x it where one
    row's mean dominates), and the PyTorch step on the CPU has errors of its own (its LayerNorm
    of the offset rows is off by up to 1e-4 where the fused two-pass one is exact, see `_x`);
- nothing is NaN or inf where the float64 reference is finite;
- inplace=True and inplace=False give bitwise equal outputs and states, and inplace=False leaves
  the caller's state bitwise unchanged.

Failure messages name the block, the case number and its seed, the drawn case, the tensor and
the errors; `_case(kind, i)` rebuilds a case from its number alone.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import random

import pytest
import torch

from xlstm_kit.layers.large import LargeBlock
from xlstm_kit.layers.mlstm import MLSTMBlock
from xlstm_kit.layers.slstm import SLSTMBlock

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None
                       or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                       reason="Triton kernels need CUDA or TRITON_INTERPRET=1"),
    # the interpreter's numpy exp overflows to inf in the sigmoids of extreme gates (1 / (1 + inf)
    # = 0, as on the GPU); a non-finite result is checked for below
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]

SEED = 20261215
KINDS = ("mlstm", "slstm", "large")
N_CASES = {"mlstm": 24, "slstm": 14, "large": 11}
TOL = 1e-5
COND_FACTOR = 16   # a float32 step rounds each value a few times; `_condition` perturbs each input once
SHIFT_ULPS = 8
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _one_thread(single_thread):  # tiny shapes: a second OpenMP thread only waits (tests/conftest.py)
    yield


def _seed(kind: str, i: int) -> int:
    return SEED + 1000 * KINDS.index(kind) + i


def _logu(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _draw(kind: str, i: int) -> dict:
    """The shape and the knobs of one case (plain values: the failure message prints them).
    Sizes lean small (the interpreter runs each program of each launch in Python); a "wide"
    case takes the kernels' multi-tile paths at batch 1..2."""
    rng = random.Random(_seed(kind, i))
    wide = rng.random() < 0.2 and i >= 2
    c = dict(B=rng.choice([1, 2]) if wide else rng.choice([1, 1, 2, 2, 3, 4, 5, 6, 7, 8]))
    if i < 2:   # both ends of the batch range in every run
        c["B"] = (1, 8)[i]
    if kind == "mlstm":
        H = rng.randint(1, 4)
        # q/k/v block size: a power of two, sometimes not (the fused step refuses: the fallback)
        P = rng.choice([1, 2, 4, 4, 8]) if rng.random() < 0.9 else rng.choice([3, 6])
        # wide: inner > 128, over 32 channel tiles of the up kernel, as many partial gate sums
        D = rng.randint(129 // H + 1, 260 // H) if wide else rng.randint(1, 32)
        while (H * D) % P:
            D += 1
        c.update(d=rng.randint(4, 64), H=H, D=D, P=P, conv=1 if rng.random() < 0.12 else rng.randint(2, 4))
    elif kind == "slstm":
        # wide: a head of 65..80 units, two 64-wide input tiles in the cell kernel
        H = 1 if wide else rng.randint(1, 4)
        c.update(H=H, D=rng.randint(65, 80) if wide else rng.randint(1, 28), conv=rng.randint(0, 4),
                 ffn=rng.randint(1, 64))
    else:
        H = rng.randint(1, 4)
        c.update(d=rng.randint(4, 64), H=H, K=rng.randint(1, 24), V=rng.randint(1, 24), ffn=rng.randint(1, 64))
        if wide:
            c.update(d=rng.randint(65, 160), H=1)
    if kind != "mlstm":   # the GEMV tiles (large_decode.gemv_config): its default, or a random one
        c["tiles"] = "default" if rng.random() < 0.25 else (rng.choice([4, 8, 16, 32]), rng.choice([16, 32, 64]))
    # the std of the noise on every parameter, log-uniform in 0.1..2, a quarter of it per i % 4
    c["pstd"] = round(_logu(rng, *((0.1, 0.2), (0.2, 0.5), (0.5, 1.0), (1.0, 2.0))[i % 4]), 3)
    c["gates"] = rng.choice(["init", "init", "extreme-i", "extreme-f", "extreme-both"])
    c["m"] = rng.choice([1.0, 30.0])                           # the stabiliser's spread
    c["xscale"] = 2.0 ** rng.randint(-10, 10)
    c["offset"] = 0 if rng.random() < 0.6 else rng.choice([-1, 1]) * 2 ** rng.randint(3, 13)
    # which step is compared with the reference; "both": also inplace=True against inplace=False
    c["inplace"] = ("both", False, True)[i % 3]
    return c


def _block(kind: str, c: dict):
    if kind == "mlstm":
        blk = MLSTMBlock(c["d"], c["H"] * c["D"], c["H"], qkv_block_size=c["P"], conv_kernel_size=c["conv"],
                         backend="triton")
        gi, gf = blk.layer.igate.bias, blk.layer.fgate.bias
    elif kind == "slstm":
        blk = SLSTMBlock(c["H"] * c["D"], c["H"], c["ffn"], conv_kernel_size=c["conv"], backend="triton")
        gi, gf = blk.layer.bias[0], blk.layer.bias[1]
    else:
        blk = LargeBlock(c["d"], c["H"], c["H"] * c["K"], c["H"] * c["V"], c["ffn"], backend="triton")
        gi, gf = blk.mlstm_layer.igate_preact.bias, blk.mlstm_layer.fgate_preact.bias
    return blk, gi, gf


def _x(c: dict, d: int, gen: torch.Generator) -> torch.Tensor:
    """x [B, d] = xscale * (offset + noise). With an offset the noise lies on a grid of 1/4 and
    sums to 0 in each row: every partial sum of a row is a float32 number (< 2^23 quarters), so
    a two-pass LayerNorm gets mean = offset and x - mean = noise exactly, in any summation order,
    while a one-pass E[x²] - E[x]² loses up to all of the variance (offset² / spread² up to 2^26)."""
    B = c["B"]
    noise = torch.randn(B, d, generator=gen, dtype=torch.float64)
    if c["offset"]:
        noise = torch.round(4 * noise) / 4
        noise[:, -1] -= noise.sum(1)       # exact: quarters of magnitude < 2^9
    return (c["xscale"] * (c["offset"] + noise)).float()


def _case(kind: str, i: int):
    """(case dict, block in float32 with backend "triton", state, x) of case i, from its seed alone."""
    c = _draw(kind, i)
    gen = torch.Generator().manual_seed(_seed(kind, i))
    torch.manual_seed(_seed(kind, i))       # the blocks' own init
    blk, gi, gf = _block(kind, c)
    r = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        for p in blk.parameters():
            p.add_(c["pstd"] * r(*p.shape))
        for name, b in (("i", gi), ("f", gf)):
            if c["gates"] in (f"extreme-{name}", "extreme-both"):
                b.copy_(20.0 * torch.where(r(*b.shape) < 0, -1.0, 1.0))
    blk.eval()
    st = blk.layer.init_state(c["B"]) if kind == "mlstm" else blk.init_state(c["B"])
    fields = {}
    for name, s in zip(st._fields, st):
        v = r(*s.shape)
        if name == "m":
            v = c["m"] * v
        elif name == "n" and kind == "slstm":   # the sLSTM's normaliser stays positive
            v = 10.0 ** (2 * torch.rand(s.shape, generator=gen) - 1)
        fields[name] = v
    st = type(st)(**fields)
    d = c["H"] * c["D"] if kind == "slstm" else c["d"]
    return c, blk.to(DEV), type(st)(*(s.to(DEV) for s in st)), _x(c, d, gen).to(DEV)


def _set_backend(kind: str, blk, backend: str):
    (blk.mlstm_layer if kind == "large" else blk.layer).backend = backend
    return blk


def _clone(st):
    return type(st)(*(s.clone() for s in st))


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    diff = float((a.double() - ref).norm())
    scale = float(ref.norm())
    return diff / scale if scale > 0 else diff


def _expect_fused(kind: str, c: dict) -> bool:
    return kind != "mlstm" or (c["conv"] >= 2 and c["P"] & (c["P"] - 1) == 0)


@contextlib.contextmanager
def _tiles(c: dict):
    """The case's GEMV tiles for the large and sLSTM steps (their kernels take any block_n,
    block_k; the default gives 4-row tiles and one K tile at these widths)."""
    from xlstm_kit.ops.blocks import large_decode, slstm_decode

    tiles = c.get("tiles", "default")
    if tiles == "default":
        yield
        return
    saved = large_decode.gemv_config, slstm_decode.gemv_config, large_decode.matmul_config
    cfg = lambda rows, k: large_decode.GemvConfig(*tiles)  # noqa: E731
    large_decode.gemv_config = slstm_decode.gemv_config = cfg
    # a block of batch rows takes tiles of >= 16 rows (tl.dot's least N)
    large_decode.matmul_config = lambda rows, k: large_decode.GemvConfig(max(16, tiles[0]), tiles[1])  # noqa: E731
    try:
        yield
    finally:
        large_decode.gemv_config, slstm_decode.gemv_config, large_decode.matmul_config = saved


class _ShiftedMeanLayerNorm(torch.nn.Module):
    """`ln` (bias-free) with each row's mean moved by `ulps` float32 ulps of it (2^-24 |mean|
    each): what a float32 mean of an offset row may be off by."""

    def __init__(self, ln: torch.nn.LayerNorm, ulps: float):
        super().__init__()
        self.ln, self.ulps = ln, ulps

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        xc = x - mean
        rstd = torch.rsqrt((xc * xc).mean(-1, keepdim=True) + self.ln.eps)
        return (xc - self.ulps * 2.0 ** -24 * mean.abs()) * rstd * self.ln.weight


def _condition(blk64, x64, st64, ref, gen: torch.Generator, draws: int = 4) -> list[float]:
    """How much one float32 rounding moves this case's results: the float64 step's relative change
    (per result tensor, root mean square over `draws`) when every parameter and state element is
    multiplied by 1 + 2^-24 r, r ~ N(0, 1). Large where the case amplifies rounding (gate
    pre-activations summing large terms of both signs into an exponent, ...), ~1e-7 elsewhere.
    x is left exact: the offset rows are built to be exact for the LayerNorms (see `_x`)."""
    sq = None
    for _ in range(draws):
        b = copy.deepcopy(blk64)
        for p in b.parameters():
            p.mul_(1 + 2.0 ** -24 * torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))
        st = type(st64)(*(s * (1 + 2.0 ** -24 * torch.randn(s.shape, generator=gen, dtype=s.dtype).to(s.device))
                          for s in st64))
        y, new = b.step(x64, st)
        e = [_rel(a, r) ** 2 for a, r in zip((y, *new), ref)]
        sq = e if sq is None else [u + v for u, v in zip(sq, e)]
    return [math.sqrt(v / draws) for v in sq]


def _check(kind: str, i: int) -> None:
    c, blk, st, x = _case(kind, i)
    what = f"{kind} case {i} (seed {_seed(kind, i)}) {c}"
    keep = _clone(st)
    with torch.no_grad():
        ref64 = _set_backend(kind, copy.deepcopy(blk).double(), "torch")
        st64 = type(st)(*(s.double() for s in st))
        ref, ref_st = ref64.step(x.double(), st64)
        t32, t32_st = _set_backend(kind, copy.deepcopy(blk), "torch").step(x, _clone(st))
        fused = blk._fused_step(x, st)
        assert fused == _expect_fused(kind, c), f"{what}: _fused_step is {fused}"
        with _tiles(c):
            if c["inplace"] is True:
                y, new = blk.step(x, _clone(st), inplace=True)
            else:
                y, new = blk.step(x, st)
                for name, a, b in zip(st._fields, st, keep):
                    assert torch.equal(a, b), f"{what}: inplace=False changed the caller's state.{name}"
            if c["inplace"] == "both":
                y_in, new_in = blk.step(x, _clone(st), inplace=True)
                assert torch.equal(y, y_in), f"{what}: inplace=True and inplace=False give different outputs"
                for name, a, b in zip(st._fields, new, new_in):
                    assert torch.equal(a, b), f"{what}: inplace=True and inplace=False give different state.{name}"
        if not fused:   # the fallback is the PyTorch step itself
            for name, a, b in zip(("y", *st._fields), (y, *new), (t32, *t32_st)):
                assert torch.equal(a, b), f"{what}: the fallback's {name} is not the PyTorch step's"
            return
        cond = _condition(ref64, x.double(), st64, (ref, *ref_st), torch.Generator().manual_seed(_seed(kind, i)))
        tols = [TOL + COND_FACTOR * e for e in cond]
        if kind == "slstm" and c["offset"]:
            ref64.ffn_norm = _ShiftedMeanLayerNorm(ref64.ffn_norm, SHIFT_ULPS)
            tols[0] += _rel(ref64.step(x.double(), st64)[0], ref)
        tols = [max(tol, 2 * _rel(t, b) + 1e-6) for tol, t, b in zip(tols, (t32, *t32_st), (ref, *ref_st))]
    assert y.dtype == x.dtype and y.shape == x.shape, f"{what}: output {y.dtype} {tuple(y.shape)}"
    for name, a, t, b, tol, cnd in zip(("y", *st._fields), (y, *new), (t32, *t32_st), (ref, *ref_st), tols, cond):
        assert a.shape == b.shape, f"{what}: {name} shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if not a.numel():
            continue
        assert a.dtype == torch.float32, f"{what}: {name} is {a.dtype}"
        assert b.isfinite().all(), f"{what}: the float64 reference's {name} is not finite (a fuzzer bug)"
        assert a.isfinite().all(), f"{what}: {name} is not finite where the float64 reference is"
        err = _rel(a, b)
        assert err <= tol, (f"{what}: {name}: the fused step's relative error {err:.3g} > {tol:.3g} "
                            f"(the float32 PyTorch step's: {_rel(t, b):.3g}; condition {cnd:.3g})")


CASES = [(kind, i) for kind in KINDS for i in range(N_CASES[kind])]


@pytest.mark.parametrize("kind,i", CASES, ids=[f"{k}-{i}" for k, i in CASES])
def test_fused_step_matches_float64_step(kind, i):
    _check(kind, i)


def test_the_cases_cover_what_they_claim():
    """The fixed seed's draws reach every path named above; cheap: it builds no block."""
    seen = {k: [_draw(k, i) for i in range(N_CASES[k])] for k in KINDS}
    m = seen["mlstm"]
    assert any(c["conv"] == 1 for c in m) and any(c["P"] & (c["P"] - 1) for c in m)   # the fallbacks
    assert sum(_expect_fused("mlstm", c) for c in m) >= 15
    assert any(_expect_fused("mlstm", c) and c["H"] * c["D"] > 128 for c in m)        # several channel tiles
    assert {c["conv"] for c in seen["slstm"]} == {0, 1, 2, 3, 4}
    assert any(c["D"] > 64 for c in seen["slstm"])                                    # two input tiles
    assert any(c["K"] != c["V"] for c in seen["large"]) and any(c["d"] > 64 for c in seen["large"])
    for k in KINDS:
        cs = seen[k]
        assert {c["B"] for c in cs} >= {1, 8}, k
        assert any(c["offset"] for c in cs) and any(not c["offset"] for c in cs), k
        gates = {c["gates"] for c in cs}
        assert "init" in gates and {"extreme-i", "extreme-both"} & gates and {"extreme-f", "extreme-both"} & gates, k
        assert {c["m"] for c in cs} == {1.0, 30.0} and {c["inplace"] for c in cs} == {False, True, "both"}, k
        assert min(c["xscale"] for c in cs) < 0.01 and max(c["xscale"] for c in cs) > 100, k
        if k != "mlstm":
            assert any(c["tiles"] == "default" for c in cs) and any(c["tiles"] != "default" for c in cs), k
