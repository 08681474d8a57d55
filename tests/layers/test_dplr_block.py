"""KDA-style DPLR block: step path = parallel path, state carried across calls, the kda op it
wraps, gradients, the decay bounds, dtypes, and a language model with DPLR blocks."""
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.layers import DPLRBlock, DPLRLayer, DPLRState
from xlstm_kit.layers.dplr import G_MAX
from xlstm_kit.ops.dplr import dplr_recurrent

F64 = torch.float64


def randomize_(module, scale=0.3):
    """Move every parameter off its initial value (zero biases would hide layout mistakes)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


def test_step_path_and_carried_state_equal_one_parallel_call():
    block = randomize_(DPLRBlock(16, 2, chunk_size=4)).double()
    x = torch.randn(2, 11, 16, dtype=F64)
    y, s = block(x, return_state=True)
    assert isinstance(s, DPLRState) and s.S.shape == (2, 2, 8, 8) and s.conv.shape == (2, 3, 48)
    assert y.abs().max() > 0.1 and s.S.abs().max() > 1e-3
    assert torch.equal(block(x), y)
    # token by token from init_state
    st, outs = block.init_state(2), []
    for t in range(11):
        o, st = block.step(x[:, t], st)
        outs.append(o)
    assert rel_err(torch.stack(outs, 1), y) < 1e-12
    assert rel_err(st.S, s.S) < 1e-12 and rel_err(st.conv, s.conv) < 1e-12
    # two calls (split inside a chunk) with the carried state
    y1, s1 = block(x[:, :6], return_state=True)
    y2, s2 = block(x[:, 6:], s1, return_state=True)
    assert rel_err(torch.cat([y1, y2], 1), y) < 1e-12 and rel_err(s2.S, s.S) < 1e-12


def test_layer_is_the_kda_recurrence_of_its_projections():
    layer = randomize_(DPLRLayer(12, 3)).double()
    x = torch.randn(2, 7, 12, dtype=F64)
    qkv = F.silu(layer.conv(layer.qkv_proj(x))[0]).view(2, 7, 3, 3, 4)
    q, k, v = F.normalize(qkv[:, :, 0], dim=-1), F.normalize(qkv[:, :, 1], dim=-1), qkv[:, :, 2]
    beta = torch.sigmoid(layer.beta_proj(x)).unsqueeze(-1)
    g = -G_MAX * torch.sigmoid(layer.decay_proj(x)).view(2, 7, 3, 4)
    h, _ = dplr_recurrent(q, k, v * beta, k, k * beta, g)  # the step-by-step reference loop
    h = F.layer_norm(h, (4,)) * layer.out_norm.weight.view(3, 4)
    ref = layer.out_proj(h.flatten(-2) * torch.sigmoid(layer.gate_proj(x)))
    assert rel_err(layer(x), ref) < 1e-12


def test_every_parameter_gets_a_gradient():
    block = randomize_(DPLRBlock(16, 2, bias=True))
    x = torch.randn(2, 9, 16, requires_grad=True)
    _, s0 = block(torch.randn(2, 3, 16), return_state=True)
    y, s = block(x, s0, return_state=True)
    (y.square().mean() + s.S.square().mean()).backward()
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().max() > 0, name
    assert x.grad.abs().max() > 0


def test_decay_stays_within_bounds():
    layer = DPLRLayer(16, 2)
    g0 = -G_MAX * torch.sigmoid(layer.decay_proj.bias)  # input-free part at init
    assert (g0 < 0).all() and g0.min() > -0.6 and g0.max() < -5e-4
    randomize_(layer, scale=3.0)
    x = 100 * torch.randn(4, 5, 16)
    _, _, _, beta, g = layer._mix_inputs(x, torch.randn(4, 5, 48))
    assert g.min() >= -G_MAX and g.max() <= 0 and g.min() < -4.0  # the large inputs do reach the bound
    assert beta.min() >= 0 and beta.max() <= 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes(dtype):
    ref = randomize_(DPLRBlock(16, 2)).double()
    block = DPLRBlock(16, 2).to(dtype)
    block.load_state_dict(ref.state_dict())
    x = torch.randn(2, 10, 16, dtype=F64)
    y, s = block(x.to(dtype), return_state=True)
    assert y.dtype == dtype and s.S.dtype == torch.float32 and block.init_state(2).S.dtype == torch.float32
    o, st = block.step(x[:, 0].to(dtype), block.init_state(2))
    assert o.dtype == dtype and st.S.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(y, ref(x)) < tol


def dplr_model(**kw):
    cfg = XLSTMConfig(vocab_size=23, d_model=16, n_blocks=3, n_heads=2, slstm_at=[2], dplr_at=[0],
                      chunk_size=4, **kw)
    return XLSTMLanguageModel(cfg).double()


def test_model_with_dplr_block_gives_logits_and_greedy_generation_matches():
    model = dplr_model()
    assert model.config.block_types == ("d", "m", "s")
    assert [type(b).__name__ for b in model.blocks] == ["DPLRBlock", "MLSTMBlock", "SLSTMBlock"]
    tokens = torch.randint(0, 23, (2, 9))
    logits, state = model(tokens, return_state=True)
    assert logits.shape == (2, 9, 23) and torch.isfinite(logits).all()
    assert isinstance(state[0], DPLRState)
    prompt = tokens[:, :5]
    out = model.generate(prompt, max_new_tokens=8, temperature=0)
    assert out.shape == (2, 13) and torch.equal(out[:, :5], prompt)
    assert torch.equal(model(out)[:, 4:-1].argmax(-1), out[:, 5:])
    # the config survives a dict round trip; a state of another block type is refused
    assert XLSTMConfig.from_dict(model.config.to_dict()) == model.config
    with pytest.raises(ValueError, match="takes a DPLRState"):
        model(tokens, state=[state[1], state[1], state[2]])


@pytest.mark.parametrize("kw, match", [
    (dict(dplr_at=[3]), "dplr_at position 3"),
    (dict(dplr_at=[0, 0]), "twice"),
    (dict(dplr_at=[1], slstm_at=[1]), "both slstm_at and dplr_at"),
    (dict(dplr_at="0"), "list of block positions"),
    (dict(dplr_at=[True]), "dplr_at position True"),
    (dict(dplr_at=[0, 1, 2], d_model=18, n_heads=4), "d_model=18 is not divisible by n_heads=4"),
])
def test_bad_config_raises(kw, match):
    base = dict(vocab_size=10, d_model=16, n_blocks=3, n_heads=2)
    with pytest.raises(ValueError, match=match):
        XLSTMConfig(**{**base, **kw})


def _spy_dtypes(monkeypatch, run):
    """Runs `run()` with the block's kda_chunkwise wrapped; returns what reached it each call."""
    import xlstm_kit.layers.dplr as mod
    seen, orig = [], mod.kda_chunkwise

    def spy(q, k, v, g, beta, **kw):
        seen.append(dict(dtypes=[x.dtype for x in (q, k, v, g, beta)], v_is_view=v._is_view()))
        return orig(q, k, v, g, beta, **kw)

    monkeypatch.setattr(mod, "kda_chunkwise", spy)
    run()
    return seen


@pytest.mark.parametrize("mode", ["bf16_params", "autocast"])
def test_activations_and_gates_reach_the_op_in_one_dtype(monkeypatch, mode):
    # one dtype for q, k, v, g, β is the Triton op's fast path (float32 gates would
    # make its gate-gradient products float32-accurate, a float32 q its output products); v
    # reaches it as a view of the convolution's output (no copy on the way)
    block = randomize_(DPLRBlock(32, 2, chunk_size=16))
    x = torch.randn(2, 20, 32)
    if mode == "bf16_params":
        block, x = block.bfloat16(), x.bfloat16()
        run = lambda: block(x).float().sum().backward()  # noqa: E731
    else:
        def run():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                block(x).float().sum().backward()
    seen = _spy_dtypes(monkeypatch, run)
    assert len(seen) == 1
    assert seen[0]["dtypes"] == [torch.bfloat16] * 5 and seen[0]["v_is_view"]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_autocast_keeps_q_and_k_bf16(monkeypatch):
    # CUDA autocast runs norms in float32: F.normalize there returned float32 q, k (slow path)
    block = randomize_(DPLRBlock(256, 2)).cuda()
    x = torch.randn(2, 100, 256, device="cuda")

    def run():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            block(x).float().sum().backward()
    seen = _spy_dtypes(monkeypatch, run)
    assert seen[0]["dtypes"] == [torch.bfloat16] * 5
