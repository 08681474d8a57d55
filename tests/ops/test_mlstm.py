"""mLSTM ops, tested in a chain, each link against the one before:
recurrent reference (float64) → parallel → chunkwise → step loop, every gradient including the
initial state's, gradcheck of the hand-written backwards, and the installed mlstm_kernels peer."""
import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit.ops.backend import BackendUnavailableError
from xlstm_kit.ops.mlstm import mlstm_chunkwise, mlstm_parallel, mlstm_recurrent, mlstm_step
from xlstm_kit.ops.mlstm.naive import mlstm_recurrent_naive

F64 = torch.float64
TIGHT = 1e-10  # float64 against float64: only rounding separates the forms


def make_inputs(B=2, T=17, H=2, K=8, V=6, dtype=F64, gate_scale=1.0, f_shift=1.0):
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    i = torch.randn(B, T, H, dtype=dtype) * gate_scale
    f = torch.randn(B, T, H, dtype=dtype) * gate_scale + f_shift
    return [x.requires_grad_() for x in (q, k, v, i, f)]


def make_state(B=2, H=2, K=8, V=6, dtype=F64):
    C = torch.randn(B, H, K, V, dtype=dtype)
    n = torch.randn(B, H, K, dtype=dtype)
    m = torch.randn(B, H, dtype=dtype)
    return [x.requires_grad_() for x in (C, n, m)]


def grads(outputs, inputs, upstream):
    return torch.autograd.grad(outputs, inputs, upstream, allow_unused=False)


# ---------------------------------------------------------------------------------------------
# the chain, float64


def test_recurrent_equals_step_loop_with_state():
    q, k, v, i, f = make_inputs(T=9)
    state = tuple(s.detach() for s in make_state())
    h, final = mlstm_recurrent(q, k, v, i, f, initial_state=state, output_final_state=True)
    s = state
    for t in range(q.shape[1]):
        h_t, s = mlstm_step(q[:, t], k[:, t], v[:, t], i[:, t], f[:, t], s)
        assert rel_err(h_t, h[:, t]) < TIGHT
    for a, b in zip(s, final):
        assert rel_err(a, b) < TIGHT
    # hand-computed first step from the zero state: m_1 = max(log f_1, ĩ_1), C_1 = i'_1 k vᵀ
    h1, (C1, n1, m1) = mlstm_step(q[:, 0], k[:, 0], v[:, 0], i[:, 0], f[:, 0], None)
    m_exp = torch.maximum(torch.nn.functional.logsigmoid(f[:, 0]), i[:, 0])
    assert rel_err(m1, m_exp) < TIGHT
    i_act = torch.exp(i[:, 0] - m_exp)
    assert rel_err(C1, i_act[..., None, None] * k[:, 0, :, :, None] * v[:, 0, :, None, :]) < TIGHT
    qh = q[:, 0] / 8 ** 0.5
    den = torch.maximum((n1 * qh).sum(-1).abs(), torch.exp(-m_exp)) + 1e-6
    assert rel_err(h1, torch.einsum("bhk,bhkv->bhv", qh, C1) / den[..., None]) < TIGHT


@pytest.mark.parametrize("T", [1, 63, 100])
def test_parallel_matches_recurrent_outputs_and_gradients(T):
    args = make_inputs(T=T, gate_scale=3.0)
    h_ref, _ = mlstm_recurrent(*args)
    h, state = mlstm_parallel(*args)
    assert state is None
    assert rel_err(h, h_ref) < TIGHT
    dh = torch.randn_like(h_ref)
    for name, g, g_ref in zip("qkvif", grads(h, args, dh), grads(h_ref, args, dh)):
        assert rel_err(g, g_ref) < 1e-9, name


@pytest.fixture(params=["factored", "exact"])
def chunk_path(request, monkeypatch):
    """Run a test through each of the chunkwise op's two intra-chunk paths; ordinary gates take
    the factored one, so the exact one is forced here and must give the same numbers."""
    from xlstm_kit.ops.mlstm import chunkwise as cw

    taken = []
    decide = cw._can_factor if request.param == "factored" else (lambda lift: False)
    monkeypatch.setattr(cw, "_can_factor", lambda lift: taken.append(decide(lift)) or taken[-1])
    yield request.param
    assert taken and all(t == (request.param == "factored") for t in taken)


@pytest.mark.parametrize("T,chunk", [(1, 16), (63, 16), (100, 16), (100, 32), (63, 64), (100, 256)])
def test_chunkwise_matches_recurrent_all_gradients(T, chunk, chunk_path):
    args = make_inputs(T=T, gate_scale=3.0)
    state = make_state()
    ref_out = mlstm_recurrent(*args, initial_state=state, output_final_state=True)
    out = mlstm_chunkwise(*args, initial_state=state, output_final_state=True, chunk_size=chunk)
    h_ref, (C_ref, n_ref, m_ref) = ref_out
    h, (C, n, m) = out
    assert rel_err(h, h_ref) < TIGHT
    assert rel_err(C, C_ref) < TIGHT and rel_err(n, n_ref) < TIGHT
    assert (m - m_ref).abs().max() < 1e-12  # the chunk stabilizer is the recurrent m exactly
    ups = [torch.randn_like(x) for x in (h_ref, C_ref, n_ref, m_ref)]
    inputs = args + state
    g = grads([h, C, n, m], inputs, ups)
    g_ref = grads([h_ref, C_ref, n_ref, m_ref], inputs, ups)
    for name, a, b in zip(["q", "k", "v", "i", "f", "C0", "n0", "m0"], g, g_ref):
        assert rel_err(a, b) < 1e-9, name


def test_chunkwise_gradient_through_m_is_not_negligible():
    # The final m's own gradient reaches ĩ, f and m0 through the max; a backward that dropped
    # the stabilizer path would still match h but fail here.
    args = make_inputs(T=20)
    state = make_state()
    _, (_, _, m) = mlstm_chunkwise(*args, initial_state=state, output_final_state=True, chunk_size=16)
    _, (_, _, m_ref) = mlstm_recurrent(*args, initial_state=state, output_final_state=True)
    dm = torch.randn_like(m)
    g = grads(m, args[3:] + state[2:], dm)
    g_ref = grads(m_ref, args[3:] + state[2:], dm)
    assert sum(x.abs().sum() for x in g_ref) > 0.1
    for a, b in zip(g, g_ref):
        assert rel_err(a, b) < TIGHT


def test_chunkwise_without_state_equals_zero_state_and_parallel():
    args = make_inputs(T=40)
    zeros = [torch.zeros(2, 2, 8, 6, dtype=F64), torch.zeros(2, 2, 8, dtype=F64), torch.zeros(2, 2, dtype=F64)]
    h0, _ = mlstm_chunkwise(*args, chunk_size=16)
    hz, _ = mlstm_chunkwise(*args, initial_state=zeros, chunk_size=16)
    hp, _ = mlstm_parallel(*args)
    assert rel_err(h0, hz) < TIGHT and rel_err(h0, hp) < TIGHT


@pytest.mark.parametrize("op", ["chunkwise", "recurrent"])
def test_split_in_two_with_state_equals_whole(op):
    args = [x.detach() for x in make_inputs(T=70)]
    fn = (lambda *a, **kw: mlstm_chunkwise(*a, chunk_size=16, **kw)) if op == "chunkwise" else mlstm_recurrent
    h, final = fn(*args, output_final_state=True)
    first = [x[:, :29] for x in args]
    second = [x[:, 29:] for x in args]
    h1, s1 = fn(*first, output_final_state=True)
    h2, s2 = fn(*second, initial_state=s1, output_final_state=True)
    assert rel_err(torch.cat([h1, h2], 1), h) < TIGHT
    for a, b in zip(s2, final):
        assert rel_err(a, b) < TIGHT


def test_step_in_place_writes_the_given_c():
    args = [x.detach() for x in make_inputs(T=1)]
    xs = [x[:, 0] for x in args]
    state = tuple(s.detach() for s in make_state())
    h, new = mlstm_step(*xs, state)
    mine = tuple(s.clone() for s in state)
    h2, new2 = mlstm_step(*xs, mine, inplace=True)
    assert new2[0] is mine[0] and torch.equal(mine[0], new[0])
    assert torch.equal(h2, h) and all(torch.equal(a, b) for a, b in zip(new2, new))
    with pytest.raises(ValueError, match="contiguous"):
        mlstm_step(*xs, (state[0].transpose(-1, -2).contiguous().transpose(-1, -2), *state[1:]), inplace=True)
    with pytest.raises(ValueError, match="no state"):
        mlstm_step(*xs, None, inplace=True)


def test_step_loop_equals_chunkwise():
    args = [x.detach() for x in make_inputs(T=25)]
    state = tuple(s.detach() for s in make_state())
    h, final = mlstm_chunkwise(*args, initial_state=state, output_final_state=True, chunk_size=16)
    s = state
    hs = []
    for t in range(25):
        h_t, s = mlstm_step(*(x[:, t] for x in args), s)
        hs.append(h_t)
    assert rel_err(torch.stack(hs, 1), h) < TIGHT
    for a, b in zip(s, final):
        assert rel_err(a, b) < TIGHT


# ---------------------------------------------------------------------------------------------
# gradcheck of the hand-written backwards


def test_gradcheck_parallel():
    args = make_inputs(B=1, T=6, H=2, K=3, V=2, gate_scale=2.0)
    assert torch.autograd.gradcheck(lambda *a: mlstm_parallel(*a)[0], args, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("T,chunk", [(7, 3), (4, 16)])
def test_gradcheck_chunkwise_with_state(T, chunk, chunk_path):
    args = make_inputs(B=1, T=T, H=2, K=3, V=2, gate_scale=2.0)
    state = make_state(B=1, H=2, K=3, V=2)

    def fn(q, k, v, i, f, C, n, m):
        h, (C1, n1, m1) = mlstm_chunkwise(q, k, v, i, f, initial_state=(C, n, m),
                                          output_final_state=True, chunk_size=chunk)
        return h, C1, n1, m1

    assert torch.autograd.gradcheck(fn, args + state, eps=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# numerics: extreme gates and dtypes


@pytest.mark.parametrize("i_val,f_val", [(50, 50), (50, -50), (-50, 50), (-50, -50), (None, None)])
def test_extreme_gates_finite_and_exact(i_val, f_val):
    B, T, H = 2, 40, 2
    q, k, v, _, _ = make_inputs(B=B, T=T, H=H)
    if i_val is None:  # anywhere in [-50, 50]
        i = (torch.rand(B, T, H, dtype=F64) * 100 - 50).requires_grad_()
        f = (torch.rand(B, T, H, dtype=F64) * 100 - 50).requires_grad_()
        grad_tol = 1e-8
    else:
        i = torch.full((B, T, H), float(i_val), dtype=F64, requires_grad=True)
        f = torch.full((B, T, H), float(f_val), dtype=F64, requires_grad=True)
        # Constant gates make the stabilizer max an exact tie at many steps (e.g. log f + 50 == 50
        # in float64). Autograd splits a tie's gradient in halves, the hand-written backward sends
        # it to one branch; both are valid and differ only in the eps-sized stabilizer term.
        grad_tol = 1e-6
    args = [q, k, v, i, f]
    h_ref, s_ref = mlstm_recurrent(*args, output_final_state=True)
    dh = torch.randn_like(h_ref)
    g_ref = grads(h_ref, args, dh)
    for dtype in (F64, torch.float32):
        a = [x.detach().to(dtype).requires_grad_() for x in args]
        h, s = mlstm_chunkwise(*a, output_final_state=True, chunk_size=16)
        hp, _ = mlstm_parallel(*a)
        tol = TIGHT if dtype == F64 else 1e-4
        assert rel_err(h, h_ref) < tol and rel_err(hp, h_ref) < tol
        assert (s[2].double() - s_ref[2]).abs().max() < 1e-9 * (1 if dtype == F64 else 1e5)
        for which, out in (("chunkwise", h), ("parallel", hp)):
            g = grads(out, a, dh.to(dtype))
            # Some gate gradients vanish here (e.g. ĩ when f̃ = −50 forgets everything at once):
            # measure those against the size of the v gradient, not their own.
            scale = g_ref[2].norm().item()
            for name, x, y in zip("qkvif", g, g_ref):
                assert torch.isfinite(x).all(), (which, name)
                if dtype == F64:
                    err = (x - y).norm().item() / max(y.norm().item(), 1e-6 * scale)
                    assert err < grad_tol, (which, name, err)


def test_extreme_gates_recurrent_gradients_finite():
    args = make_inputs(T=10)
    # alternating extremes: every combination of ±50 input and forget gates occurs
    i = torch.tensor([-50.0, 50.0], dtype=F64).repeat(20).view(2, 10, 2).requires_grad_()
    f = torch.tensor([50.0, -50.0, -50.0], dtype=F64).repeat(14)[:40].view(2, 10, 2).requires_grad_()
    h, s = mlstm_recurrent(*args[:3], i, f, output_final_state=True)
    g = grads([h, *s], args[:3] + [i, f], [torch.ones_like(h)] + [torch.ones_like(x) for x in s])
    assert torch.isfinite(h).all() and all(torch.isfinite(x).all() for x in g)


def test_steep_gates_take_exact_path_and_agree(monkeypatch):
    # a forget gate slamming shut inside a chunk lifts ĩ − Σlog f by ~50 per step: far beyond
    # what the factored product may hold in float32, so the exact path must run (and agree)
    from xlstm_kit.ops.mlstm import chunkwise as cw

    taken = []
    decide = cw._can_factor
    monkeypatch.setattr(cw, "_can_factor", lambda lift: taken.append(decide(lift)) or taken[-1])
    args = [x.detach() for x in make_inputs(T=32)]
    args[4] = torch.full_like(args[4], -50.0)
    args[3] = torch.linspace(-50, 50, 32, dtype=F64)[None, :, None].expand(2, 32, 2).contiguous()
    h_ref, s_ref = mlstm_recurrent(*args, output_final_state=True)
    h, s = mlstm_chunkwise(*[x.float() for x in args], output_final_state=True, chunk_size=16)
    assert taken == [False]
    assert rel_err(h, h_ref) < 1e-5 and rel_err(s[0], s_ref[0]) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_dtypes(dtype):
    args64 = [x.detach() for x in make_inputs(B=2, T=50, H=2, K=16, V=16)]
    low = [x.to(dtype) for x in args64]
    # reference: float64 on the rounded inputs
    h_ref, s_ref = mlstm_recurrent(*[x.double() for x in low], output_final_state=True)
    h, (C, n, m) = mlstm_chunkwise(*low, output_final_state=True, chunk_size=16)
    hp, _ = mlstm_parallel(*low)
    assert h.dtype == dtype and hp.dtype == dtype
    assert C.dtype == n.dtype == m.dtype == torch.float32
    if dtype == torch.float32:
        assert rel_err(h, h_ref) < 1e-5 and rel_err(hp, h_ref) < 1e-5 and rel_err(C, s_ref[0]) < 1e-5
    else:
        # flash-attention's rule: at most 2x the error of the plain reference run in that dtype
        h_low = mlstm_recurrent_naive(*low, None, 1e-6)[0]
        base = rel_err(h_low, h_ref)
        assert rel_err(h, h_ref) <= 2 * base and rel_err(hp, h_ref) <= 2 * base
    # gradients come back in the input dtype
    lo = [x.clone().requires_grad_() for x in low]
    mlstm_chunkwise(*lo, chunk_size=16)[0].float().square().sum().backward()
    assert all(x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all() for x in lo)


def test_float64_inputs_give_float64_state():
    h, (C, n, m) = mlstm_chunkwise(*make_inputs(T=5), output_final_state=True)
    assert h.dtype == C.dtype == n.dtype == m.dtype == F64


# ---------------------------------------------------------------------------------------------
# bad input


def _bad_calls():
    q, k, v, i, f = [x.detach() for x in make_inputs(T=5)]
    state = tuple(s.detach() for s in make_state())
    ch = mlstm_chunkwise
    return [
        ("k", lambda: ch(q, k[:, :4], v, i, f)),
        ("v", lambda: ch(q, k, v[:1], i, f)),
        ("i", lambda: ch(q, k, v, i[..., :1], f)),
        ("f", lambda: ch(q, k, v, i, f[:, :, :, None])),
        ("q", lambda: ch(q[0], k, v, i, f)),
        ("q", lambda: ch(q.long(), k, v, i, f)),
        ("v", lambda: ch(q, k, v.int(), i, f)),
        ("initial_state C", lambda: ch(q, k, v, i, f, initial_state=(state[0][..., :3], state[1], state[2]))),
        ("initial_state m", lambda: ch(q, k, v, i, f, initial_state=(state[0], state[1], state[2][:, :1]))),
        ("initial_state", lambda: ch(q, k, v, i, f, initial_state=state[:2])),
        ("chunk_size", lambda: ch(q, k, v, i, f, chunk_size=0)),
        ("k", lambda: mlstm_recurrent(q, k[..., :3], v, i, f)),
        ("initial_state n", lambda: mlstm_recurrent(q, k, v, i, f, initial_state=(state[0], state[1][:1], state[2]))),
        ("i", lambda: mlstm_parallel(q, k, v, i.long(), f)),
        ("state C", lambda: mlstm_step(q[:, 0], k[:, 0], v[:, 0], i[:, 0], f[:, 0], (state[0][:1], state[1], state[2]))),
        ("v", lambda: mlstm_step(q[:, 0], k[:, 0], v[:, 0, :1], i[:, 0], f[:, 0], None)),
    ]


def test_bad_input_raises_value_error_naming_tensor():
    for name, call in _bad_calls():
        with pytest.raises(ValueError, match=name):
            call()


def test_shape_error_message_names_expected_shape():
    q, k, v, i, f = [x.detach() for x in make_inputs(T=5)]
    with pytest.raises(ValueError, match=r"k \[B,T,H,K\] has shape \[2, 4, 2, 8\], expected \[2, 5, 2, 8\]"):
        mlstm_chunkwise(q, k[:, :4], v, i, f)


def test_triton_backend_unavailable_without_kernel(monkeypatch):
    # the torch ops must refuse a forced backend that has no kernel for them
    import xlstm_kit.ops.backend as backend_mod

    monkeypatch.setattr(backend_mod, "KERNEL_MODULES", {})
    args = [x.detach() for x in make_inputs(T=3)]
    with pytest.raises(BackendUnavailableError):
        mlstm_chunkwise(*args, backend="triton")
    with pytest.raises(BackendUnavailableError):
        mlstm_recurrent(*args, backend="triton")
    with pytest.raises(ValueError, match="backend"):
        mlstm_chunkwise(*args, backend="cuda")
    h, _ = mlstm_chunkwise(*args, backend="torch")
    assert torch.isfinite(h).all()


def test_triton_refuses_heads_narrower_than_a_dot_tile(monkeypatch):
    # head dim 8 (make_inputs' default) is below tl.dot's 16: a forced Triton call says so
    # before compiling, and the automatic choice (a tiny model on CUDA) takes the torch path
    pytest.importorskip("triton")
    from xlstm_kit.ops.mlstm.triton.op import supports

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q, k, v, i, f = [x.detach().float() for x in make_inputs(T=3)]
    with pytest.raises(BackendUnavailableError, match="K, V >= 16, got K=8"):
        mlstm_chunkwise(q, k, v, i, f, backend="triton")
    assert supports("mlstm_chunkwise", dtype=torch.bfloat16, head_dims=(16, 8)) is not None
    assert supports("mlstm_chunkwise", dtype=torch.bfloat16, head_dims=(16, 16)) is None


# ---------------------------------------------------------------------------------------------
# the installed peer (mlstm_kernels: layout [B, H, T, D], scales q by 1/sqrt(K) itself)


def _to_peer(x):
    return x.transpose(1, 2).contiguous() if x.dim() == 4 else x.transpose(1, 2).contiguous()


@pytest.mark.parametrize("kernel", ["native_autograd", "native_custbw"])
def test_matches_mlstm_kernels_chunkwise(kernel):
    pk = pytest.importorskip("mlstm_kernels.torch.chunkwise.native")
    fn = getattr(pk, f"mlstm_chunkwise__{kernel}")
    args = [x.detach().float().requires_grad_() for x in make_inputs(T=64, K=16, V=16, gate_scale=2.0)]
    C0, n0, m0 = [s.detach().float().requires_grad_() for s in make_state(K=16, V=16)]
    peer_args = [_to_peer(x) for x in args]
    h_p, (C_p, n_p, m_p) = fn(*peer_args, c_initial=C0, n_initial=n0, m_initial=m0[..., None],
                              return_last_states=True, chunk_size=16)
    h, (C, n, m) = mlstm_chunkwise(*args, initial_state=(C0, n0, m0), output_final_state=True, chunk_size=16)
    assert rel_err(h, h_p.transpose(1, 2)) < 1e-5
    assert rel_err(C, C_p) < 1e-5 and rel_err(n, n_p) < 1e-5 and rel_err(m, m_p[..., 0]) < 1e-6
    dh = torch.randn_like(h)
    if kernel == "native_custbw":
        # Its backward drops the denominator's gradient by design (exact when a per-head norm
        # follows, which makes <δh_t, h_t> = 0); give both ops such an upstream gradient.
        hd = h.detach()
        dh = dh - hd * (dh * hd).sum(-1, keepdim=True) / (hd * hd).sum(-1, keepdim=True)
    g_p = grads(h_p, args + [C0, n0], dh.transpose(1, 2))
    g = grads(h, args + [C0, n0], dh)
    for name, a, b in zip(["q", "k", "v", "i", "f", "C0", "n0"], g, g_p):
        if kernel == "native_custbw" and name == "n0":
            # n only reaches the denominator, so the peer returns exactly 0 and ours is ~0
            assert a.norm() < 1e-5 * g[5].norm() and b.abs().max() == 0
            continue
        assert rel_err(a, b) < 1e-4, name


def test_matches_mlstm_kernels_recurrent_and_step():
    rec = pytest.importorskip("mlstm_kernels.torch.recurrent")
    args = [x.detach() for x in make_inputs(T=12)]
    state = [s.detach() for s in make_state()]
    h_p, (C_p, n_p, m_p) = rec.mlstm_recurrent_sequence__native_fw(
        *[_to_peer(x) for x in args], c_initial=state[0], n_initial=state[1], m_initial=state[2][..., None],
        return_last_states=True, dtype_state=F64)
    h, (C, n, m) = mlstm_recurrent(*args, initial_state=state, output_final_state=True)
    assert rel_err(h, h_p.transpose(1, 2)) < TIGHT
    assert rel_err(C, C_p) < TIGHT and rel_err(n, n_p) < TIGHT and rel_err(m, m_p[..., 0]) < TIGHT
    hs, (Cs, ns, ms) = rec.mlstm_recurrent_step__native(
        *(x[:, 0] for x in args[:3]), args[3][:, 0, :, None], args[4][:, 0, :, None],
        state[0], state[1], state[2][..., None], dtype_state=F64)
    h1, (C1, n1, m1) = mlstm_step(*(x[:, 0] for x in args), state)
    assert rel_err(h1, hs) < TIGHT and rel_err(C1, Cs) < TIGHT and rel_err(m1, ms[..., 0]) < TIGHT


def test_parallel_matches_mlstm_kernels_parallel():
    par = pytest.importorskip("mlstm_kernels.torch.parallel")
    # i well above Σ log f, so the zero-state column never sets m and both forms agree exactly
    args = [x.detach().requires_grad_() for x in make_inputs(T=20, gate_scale=0.5)]
    with torch.no_grad():
        args[3] += 3.0
    h_p = par.mlstm_parallel__native_autograd(*[_to_peer(x) for x in args])
    h, _ = mlstm_parallel(*args)
    assert rel_err(h, h_p.transpose(1, 2)) < TIGHT
    dh = torch.randn_like(h)
    for a, b in zip(grads(h, args, dh), grads(h_p, args, dh.transpose(1, 2))):
        assert rel_err(a, b) < 1e-9


def test_chunkwise_compiles_with_dynamic_lengths():
    """torch.compile with a symbolic T (marked dynamic here, as Dynamo's automatic dynamic shapes
    make it after a second length): the chunk layout's arithmetic on T must trace (divmod of a
    symbolic int does not), and every length gives the eager result without a graph break or a
    second compilation. Only T is symbolic: dynamic=True (symbolic batch, heads and head sizes
    too) made AOTAutograd's trace four times longer."""
    from torch._dynamo.utils import counters

    def op(*t):
        return mlstm_chunkwise(*t, chunk_size=16, backend="torch")[0]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(op, fullgraph=True, backend="aot_eager")
    for T in (37, 45):
        q, k, v = (torch.randn(2, T, 2, 8) for _ in range(3))
        i, f = torch.randn(2, T, 2), torch.randn(2, T, 2) + 2
        for x in (q, k, v, i, f):
            torch._dynamo.mark_dynamic(x, 1)
        ref = op(q, k, v, i, f)
        assert ref.abs().max() > 0.1
        torch.testing.assert_close(compiled(q, k, v, i, f), ref, atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
