"""The xLSTM-7B ("large") block family: an independent float64 reference of the block (forward,
state and every gradient), transformers' xLSTMForCausalLM and the official xLSTMLarge (logits,
greedy tokens, conversion both ways), state carry, step, checkpoints, compile and recomputation."""
import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import rel_err
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.layers.large import LargeBlock


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def large_config(d=64, heads=2, qk=0.5, v=1.0, bias=False, vocab=96, **kw):
    return XLSTMConfig(family="large", vocab_size=vocab, d_model=d, n_blocks=2, n_heads=heads, qk_dim_factor=qk,
                       v_dim_factor=v, bias=bias, chunk_size=16, **kw)


def perturbed(module, scale=0.2):
    """Every weight off its initial value (zero gate maps and all-one norms hide layout mistakes)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * scale)
    return module


# ---------------------------------------------------------------------------- float64 reference
def reference_block(x, p, *, heads, eps_norm, cap, state=None):
    """The large block as the DESIGN paragraph states it, one time step at a time (float64).

    x [B, T, d]; p: the block's parameters by state_dict name; state (C, n, m) or None.
    Returns y [B, T, d] and the final (C, n, m).
    """
    def lin(name, z):
        out = z @ p[name + ".weight"].T
        return out + p[name + ".bias"] if name + ".bias" in p else out

    def rms(name, z):
        z = z / torch.sqrt((z * z).mean(-1, keepdim=True) + eps_norm) * p[name + ".weight"]
        return z + p[name + ".bias"] if name + ".bias" in p else z

    B, T, _ = x.shape
    xn = rms("norm_mlstm", x)
    L = "mlstm_layer."
    q, k, v, o = (lin(L + n, xn) for n in ("q", "k", "v", "ogate_preact"))
    i_pre = cap * torch.tanh(lin(L + "igate_preact", xn) / cap)
    f_pre = cap * torch.tanh(lin(L + "fgate_preact", xn) / cap)
    K, V = q.shape[-1] // heads, v.shape[-1] // heads
    q, k, v = q.view(B, T, heads, K), k.view(B, T, heads, K), v.view(B, T, heads, V)
    if state is None:
        C, n, m = x.new_zeros(B, heads, K, V), x.new_zeros(B, heads, K), x.new_zeros(B, heads)
    else:
        C, n, m = state
    hs = []
    for t in range(T):
        log_f = F.logsigmoid(f_pre[:, t])
        m_new = torch.maximum(log_f + m, i_pre[:, t])
        fa, ia = torch.exp(log_f + m - m_new), torch.exp(i_pre[:, t] - m_new)
        C = fa[..., None, None] * C + ia[..., None, None] * k[:, t, :, :, None] * v[:, t, :, None, :]
        n = fa[..., None] * n + ia[..., None] * k[:, t]
        m = m_new
        qs = q[:, t] / math.sqrt(K)
        num = (qs[..., None] * C).sum(-2)
        den = torch.maximum((qs * n).sum(-1).abs(), torch.exp(-m)) + 1e-6
        hs.append(num / den[..., None])
    h = torch.stack(hs, 1)  # [B, T, H, V]
    mu = h.mean(-1, keepdim=True)
    var = ((h - mu) ** 2).mean(-1, keepdim=True)
    hn = ((h - mu) / torch.sqrt(var + eps_norm)).reshape(B, T, heads * V) * p[L + "multihead_norm.weight"]
    if L + "multihead_norm.bias" in p:
        hn = hn + p[L + "multihead_norm.bias"]
    x = x + lin(L + "out_proj", torch.sigmoid(o) * hn)
    xn = rms("norm_ffn", x)
    x = x + lin("ffn.proj_down", F.silu(lin("ffn.proj_up_gate", xn)) * lin("ffn.proj_up", xn))
    return x, (C, n, m)


BLOCK_CASES = {
    "qk head 16 != v head 32 (the 7B ratio)": dict(d=64, heads=2, qk=0.5, v=1.0),
    "equal head dims, biases": dict(d=32, heads=2, qk=1.0, v=1.0, bias=True),
    "v wider than d, 4 heads": dict(d=32, heads=4, qk=0.5, v=2.0),
}


@pytest.mark.parametrize("case", BLOCK_CASES)
def test_block_matches_float64_reference_forward_state_and_gradients(case):
    c = BLOCK_CASES[case]
    cfg = large_config(**c)
    d, H = cfg.d_model, cfg.n_heads
    qk, v = int(cfg.qk_dim_factor * d), int(cfg.v_dim_factor * d)
    block = LargeBlock(d, H, qk, v, cfg.ffn_dim, n_blocks=2, bias=cfg.bias, norm_eps=1e-5, gate_soft_cap=3.0,
                       chunk_size=16).double()
    perturbed(block, 0.3)
    with torch.no_grad():  # gates in the soft cap's curved range and both branches of the max
        block.mlstm_layer.igate_preact.weight.mul_(10.0)
        block.mlstm_layer.fgate_preact.weight.mul_(10.0)
    B, T = 2, 37
    x = torch.randn(B, T, d, dtype=torch.float64, requires_grad=True)
    K, Vh = qk // H, v // H
    s0 = [torch.randn(B, H, K, Vh, dtype=torch.float64), torch.randn(B, H, K, dtype=torch.float64),
          torch.randn(B, H, dtype=torch.float64)]
    s0 = [s.requires_grad_() for s in s0]
    state = block.init_state(B)
    state = state._replace(C=s0[0], n=s0[1], m=s0[2])
    y, new = block(x, state, return_state=True)
    params = dict(block.named_parameters())
    y_ref, (C, n, m) = reference_block(x, params, heads=H, eps_norm=1e-5, cap=3.0, state=tuple(s0))
    assert rel_err(y, y_ref) < 1e-10
    for got, want in zip((new.C, new.n, new.m), (C, n, m)):
        assert rel_err(got, want) < 1e-10
    dy, dC, dn = torch.randn_like(y), torch.randn_like(C), torch.randn_like(n)
    wrt = [x, *s0, *params.values()]
    ours = torch.autograd.grad((y * dy).sum() + (new.C * dC).sum() + (new.n * dn).sum(), wrt)
    ref = torch.autograd.grad((y_ref * dy).sum() + (C * dC).sum() + (n * dn).sum(), wrt)
    names = ["x", "C0", "n0", "m0", *params]
    for name, g, r in zip(names, ours, ref):
        assert r.abs().max() > 0, name  # every gradient is exercised
        assert rel_err(g, r) < 1e-9, name


def test_step_equals_forward_and_split_sequence_equals_whole():
    model = perturbed(XLSTMLanguageModel(large_config())).eval()
    tokens = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        whole, end = model(tokens, return_state=True)
        a, s = model(tokens[:, :23], return_state=True)
        b, s = model(tokens[:, 23:], state=s, return_state=True)
        assert rel_err(torch.cat([a, b], 1), whole) < 1e-5
        assert rel_err(model(tokens[1:]), whole[1:]) < 1e-5  # a batch row is the sequence alone
        for x, y in zip(s[1], end[1]):
            assert rel_err(x, y) < 1e-5
        state = model.init_state(2)
        for t in range(6):
            logits, state = model.step(tokens[:, t], state)
            assert rel_err(logits, whole[:, t]) < 1e-5
    assert whole.abs().max() <= model.config.logit_soft_cap
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_save_load_round_trip(tmp_path):
    model = perturbed(XLSTMLanguageModel(large_config(bias=True))).eval()
    model.save(tmp_path / "ckpt")
    loaded = XLSTMLanguageModel.load(tmp_path / "ckpt")
    assert loaded.config == model.config and loaded.config.family == "large"
    tokens = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        assert torch.equal(loaded(tokens), model(tokens))


def _loss_and_grads(model, tokens):
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return loss.detach(), grads


def test_activation_checkpointing_and_compiled_blocks_give_the_same_loss_and_gradients():
    torch.manual_seed(0)
    model = perturbed(XLSTMLanguageModel(large_config(d=32)))
    tokens = torch.randint(0, 96, (2, 33))
    loss, grads = _loss_and_grads(model, tokens)
    model.set_activation_checkpointing("mlstm")
    assert model.activation_checkpointing == (0, 1)
    loss_r, grads_r = _loss_and_grads(model, tokens)
    assert torch.equal(loss_r, loss)
    for g, r in zip(grads_r, grads):
        assert rel_err(g, r) < 1e-6
    model.set_activation_checkpointing("none")
    model.compile_blocks(backend="aot_eager", fullgraph=True)
    loss_c, grads_c = _loss_and_grads(model, tokens)
    assert abs(loss_c.item() - loss.item()) < 1e-5 * abs(loss.item())
    for g, r in zip(grads_c, grads):
        assert rel_err(g, r) < 1e-5


def test_initialisation_follows_transformers():
    transformers = pytest.importorskip("transformers")
    cfg = large_config(d=64, qk=1.0)
    ours = XLSTMLanguageModel(cfg)
    hf = transformers.xLSTMForCausalLM(hf_config(cfg))
    theirs = {ours_name(k): v for k, v in hf.state_dict().items()}
    for name, p in ours.state_dict().items():
        q = theirs[name]
        assert p.shape == q.shape, name
        if q.std() == 0 or q.numel() <= cfg.n_heads:  # constants: zeros, ones, gate biases
            assert torch.equal(p, q), name
        else:  # random: the same distribution
            assert p.mean().abs() < 0.1 * q.std() + 1e-3 and 0.8 < p.std() / q.std() < 1.25, name


# ---------------------------------------------------------------------------- transformers
def hf_config(cfg: XLSTMConfig):
    transformers = pytest.importorskip("transformers")
    return transformers.xLSTMConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_blocks, num_heads=cfg.n_heads,
        qk_dim_factor=cfg.qk_dim_factor, v_dim_factor=cfg.v_dim_factor, ffn_proj_factor=cfg.ffn_proj_factor,
        ffn_round_up_to_multiple_of=cfg.round_proj_to, norm_eps=cfg.norm_eps, use_bias=cfg.bias,
        gate_soft_cap=cfg.gate_soft_cap, output_logit_soft_cap=cfg.logit_soft_cap, tie_word_embeddings=False,
        weight_mode="single", chunk_size=16, mode="inference", eps=1e-6,
        # its own PyTorch kernels (also where the xlstm package supplies the blocks)
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native", step_kernel="native",
        autocast_kernel_dtype="float32", inference_state_dtype="float32",
    )


def ours_name(hf_name: str) -> str:
    name = hf_name.removeprefix("backbone.")
    return {"embeddings.weight": "embedding.weight", "out_norm.weight": "norm.weight"}.get(name, name)


def _transformers_own_modeling():
    """transformers' xLSTM as it runs where the xlstm package is not installed (its own PyTorch
    code; with xlstm installed it builds xlstm_large's blocks): modeling_xlstm.py imported a
    second time, under another module name, with is_xlstm_available() returning False."""
    import importlib.util
    import sys
    from unittest import mock

    import transformers.models.xlstm.modeling_xlstm as installed
    import transformers.utils

    name = "transformers.models.xlstm._modeling_xlstm_without_xlstm_package"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, installed.__file__)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # its docstring decorators look the source file up by module
        with mock.patch.object(transformers.utils, "is_xlstm_available", lambda: False):
            spec.loader.exec_module(module)
        assert not module.external_xlstm
    return sys.modules[name]


@pytest.fixture(params=["as installed", "transformers' own code"])
def hf_impl(request):
    pytest.importorskip("transformers")
    import transformers.models.xlstm.modeling_xlstm as installed

    return installed if request.param == "as installed" else _transformers_own_modeling()


def hf_twin(model: XLSTMLanguageModel, impl=None):
    transformers = pytest.importorskip("transformers")
    impl = impl or transformers
    hf = impl.xLSTMForCausalLM(hf_config(model.config)).eval()
    ours = model.state_dict()
    hf.load_state_dict({k: ours[ours_name(k)] for k in hf.state_dict()}, strict=True)
    assert len(hf.state_dict()) == len(ours)  # every weight has one twin
    return hf


# transformers' cache rounds the q/k width up to a multiple of 64 (its config.qk_dim), so it runs
# where d * qk_dim_factor is one (d 128, qk 0.5: q/k heads of 32, v heads of 64)
HF_CASES = {
    "qk = v head dims": dict(d=64, qk=1.0),
    "qk head 32 != v head 64": dict(d=128, qk=0.5),
    "biases": dict(d=64, qk=1.0, bias=True),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_logits_equal_transformers(case, hf_impl):
    model = perturbed(XLSTMLanguageModel(large_config(**HF_CASES[case]))).eval()
    hf = hf_twin(model, hf_impl)
    tokens = torch.randint(0, 96, (2, 40))  # 2 chunks of 16 and 8 steps of its sequence kernel
    with torch.no_grad():
        assert rel_err(model(tokens), hf(tokens).logits) < 1e-5


@pytest.mark.parametrize("case", ["qk = v head dims", "qk head 32 != v head 64"])
def test_greedy_generation_equals_transformers(case, hf_impl):
    model = perturbed(XLSTMLanguageModel(large_config(**HF_CASES[case])), 0.5).eval()
    hf = hf_twin(model, hf_impl)
    prompt = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        ours = model.generate(prompt, max_new_tokens=12, temperature=0)
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert ours.shape == (1, 21) and torch.equal(ours, theirs)
    assert len(set(ours[0, 9:].tolist())) > 1  # a continuation that is not one repeated token


# ---------------------------------------------------------------------------- official xLSTMLarge
def official_large(mode, weight_mode, bias=False):
    large = pytest.importorskip("xlstm.xlstm_large.model")
    oc = large.xLSTMLargeConfig(
        embedding_dim=64, num_heads=2, num_blocks=2, vocab_size=96, use_bias=bias, qk_dim_factor=0.5,
        chunkwise_kernel="chunkwise--native_autograd", sequence_kernel="native_sequence__native",
        step_kernel="native", mode=mode, chunk_size=16, weight_mode=weight_mode,
        return_last_states=mode == "train",  # its train mode fails without
    )
    official = perturbed(large.xLSTMLarge(oc))
    if bias:  # a final-norm bias has no place in our model (nor in transformers')
        torch.nn.init.zeros_(official.backbone.out_norm.bias)
    return official.eval()


def _logits(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("mode,weight_mode,bias,T", [("inference", "single", False, 37), ("train", "fused", True, 32)])
def test_official_xlstm_large_converts_both_ways(mode, weight_mode, bias, T):
    from xlstm_kit.io.compat import from_official_xlstm, to_official_xlstm

    official = official_large(mode, weight_mode, bias)
    ours = from_official_xlstm(official)
    assert ours.config.family == "large" and ours.config.bias == bias
    tokens = torch.randint(0, 96, (2, T))
    with torch.no_grad():
        expected = _logits(official(tokens))
        assert rel_err(ours(tokens), expected) < 1e-5
        back = to_official_xlstm(ours, weight_mode=weight_mode)
        assert rel_err(_logits(back(tokens)), expected) < 1e-5
    assert type(back) is type(official)


def test_trains_through_xlstm_kit_train_and_reloads(tmp_path, monkeypatch):
    from tests.test_train import TEXT, small_config
    from xlstm_kit import training as T
    from xlstm_kit.training.data import load_data

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "corpus.txt").write_text(TEXT)
    data = load_data(str(tmp_path / "corpus.txt"), "byte")
    model = XLSTMLanguageModel(large_config(d=32, vocab=256, context_length=16))
    res = T.train(model, data, small_config(steps=12, eval_interval=6, checkpoint_interval=12), tmp_path / "run",
                  device="cpu")
    assert res.step == 12 and res.evals[-1][1].loss < res.evals[0][1].loss - 0.3
    loaded = XLSTMLanguageModel.load(T.resolve_checkpoint(tmp_path / "run"))
    assert loaded.config.family == "large"
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
def test_triton_kernels_give_the_torch_path_results():
    # the kernels a GPU runs in training and prefill (chunkwise mLSTM, head norm), here in the
    # interpreter; q/k heads of 24 and v heads of 48 are not powers of two (large-125M: 96, 192)
    pytest.importorskip("triton")
    cfg = large_config(d=96, heads=2, qk=0.5, v=1.0)
    ref = perturbed(XLSTMLanguageModel(dataclasses.replace(cfg, backend="torch")))
    fast = XLSTMLanguageModel(dataclasses.replace(cfg, backend="triton"))
    fast.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 96, (2, 21))
    (loss, grads), (loss_f, grads_f) = _loss_and_grads(ref, tokens), _loss_and_grads(fast, tokens)
    assert abs(loss_f.item() - loss.item()) < 1e-5 * loss.item()
    for g, r in zip(grads_f, grads):
        assert rel_err(g, r) < 1e-4
    with torch.no_grad():
        whole, state = ref(tokens, return_state=True)
        logits, state_f = fast(tokens[:, :-1], return_state=True)
        step, state_f = fast.step(tokens[:, -1], state_f)
    assert rel_err(logits, whole[:, :-1]) < 1e-5 and rel_err(step, whole[:, -1]) < 1e-5
    for s, r in zip(state_f, state):
        assert rel_err(s.C, r.C) < 1e-5
