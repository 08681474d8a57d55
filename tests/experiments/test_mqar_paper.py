"""MQAR in the paper's settings: power-law query spacing and the settings table."""
import numpy as np
import pytest
import torch

from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.experiments.experiment import MODEL_NAMES, build_model, evaluate_mqar
from xlstm_kit.experiments.mqar import MQAR_SETTINGS, POWER_A, check_mqar_shape, mqar_batch, powerlaw_slots


def test_powerlaw_slots_follow_the_law():
    rng = np.random.default_rng(0)
    s = powerlaw_slots(rng, 20000, 50, 1)[:, 0]
    w = np.arange(1, 51) ** (POWER_A - 1.0)
    freq = np.bincount(s, minlength=50) / len(s)
    np.testing.assert_allclose(freq[:3], (w / w.sum())[:3], rtol=0.05)  # the frequent early slots
    many = powerlaw_slots(rng, 64, 50, 10)
    assert all(len(set(r)) == 10 for r in many.tolist())  # distinct
    with pytest.raises(XLSTMKitError):
        powerlaw_slots(rng, 1, 5, 6)


def test_powerlaw_batch_queries_every_key_once_near_the_pairs():
    rng = np.random.default_rng(1)
    T, N, V = 128, 8, 256
    b = mqar_batch(rng, 200, T, N, V, spacing="powerlaw")
    u = mqar_batch(rng, 200, T, N, V, spacing="uniform")
    inp, tgt, mask = b.inputs.numpy(), b.targets.numpy(), b.mask.numpy()
    for r in range(20):
        keys, values = inp[r, 0:2 * N:2], inp[r, 1:2 * N:2]
        pos = np.flatnonzero(mask[r])
        assert len(pos) == N and all((p - 2 * N) % 2 == 0 for p in pos)  # two-token slots
        assert sorted(inp[r, pos]) == sorted(keys)
        lookup = dict(zip(keys, values))
        assert [lookup[k] for k in inp[r, pos]] == list(tgt[r, pos])
        assert (inp[r, 2 * N:][~mask[r, 2 * N:]] == 0).all()
    # power law: queries sit much closer to the pairs than uniformly placed ones
    mean_pos = lambda m: np.mean(np.nonzero(m)[1])  # noqa: E731
    assert mean_pos(mask) + 20 < mean_pos(u.mask.numpy())
    with pytest.raises(XLSTMKitError, match="spacing"):
        mqar_batch(rng, 2, T, N, V, spacing="zipf")


def test_settings_are_valid_shapes():
    assert MQAR_SETTINGS["zoology"]["shapes"] == ((64, 4), (128, 8), (256, 16))
    assert MQAR_SETTINGS["fig5"]["shapes"] == ((2048, 48), (2048, 96), (2048, 256))
    for s in MQAR_SETTINGS.values():
        for T, N in s["shapes"]:
            check_mqar_shape(T, N, 8192)
            assert T >= 4 * N  # power-law slots need T - 2N >= 2N
        assert len(s["widths"]) >= 3


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_evaluate_mqar_scores_the_queries_as_full_logits_would(name):
    # the head runs at the query positions only; the count must be the one that full logits
    # masked to the queries give (vocabulary 16: these untrained models hit 3-11 of the 96)
    T, N, V, n = 32, 4, 16, 24
    torch.manual_seed(1)
    model = build_model(name, V, d_model=16, n_heads=2, n_blocks=2, backend="torch")
    rng = np.random.default_rng(5)
    correct = total = 0
    with torch.no_grad():
        for i in range(0, n, 8):
            b = mqar_batch(rng, 8, T, N, V, "powerlaw")
            hit = (model(b.inputs).argmax(-1) == b.targets) & b.mask
            correct, total = correct + int(hit.sum()), total + int(b.mask.sum())
    assert total == n * N and 0 < correct < total
    acc = evaluate_mqar(model, T, N, n, vocab_size=V, batch_size=8, seed=5, spacing="powerlaw")
    assert acc == correct / total
    assert model.training  # evaluation puts the model back as it found it



def test_transformer_conv_feeds_q_and_k_through_the_causal_conv():
    # float64 reference: q, k read SiLU(depthwise causal conv_4(x)), v reads x, causal softmax
    from xlstm_kit.experiments import baselines as B

    torch.manual_seed(3)
    model = build_model("transformer-conv", 16, d_model=16, n_heads=2).double()
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.conv.weight.normal_(), attn.conv.bias.normal_()
    B_, T, C, H, hd = 2, 9, 16, 2, 8
    x = torch.randn(B_, T, C, dtype=torch.float64, requires_grad=True)
    cos, sin = B.rope_tables(T, hd, "cpu")
    got = attn(x, cos, sin)
    pad = torch.cat([torch.zeros(B_, 3, C, dtype=x.dtype), x], dim=1)
    conv = attn.conv.bias + sum(attn.conv.weight[:, j] * pad[:, j:j + T] for j in range(4))
    c = torch.nn.functional.silu(conv)
    wq, wk, wv = attn.qkv.weight.split(C)
    heads = lambda t: t.view(B_, T, H, hd).transpose(1, 2)  # noqa: E731
    q, k, v = heads(c @ wq.T), heads(c @ wk.T), heads(x @ wv.T)
    q, k = B.apply_rope(q, cos, sin), B.apply_rope(k, cos, sin)
    s = (q @ k.transpose(-1, -2)) / hd ** 0.5
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.out((s.softmax(-1) @ v).transpose(1, 2).reshape(B_, T, C))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # gradients too: the fused conv's backward against autograd through the reference
    g = torch.randn_like(got)
    wrt = (x, attn.conv.weight, attn.conv.bias, attn.qkv.weight)
    for a, b in zip(torch.autograd.grad(got, wrt, g), torch.autograd.grad(want, wrt, g)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # the model stays causal, and differs from the plain Transformer by the conv alone
    tok = torch.randint(0, 16, (2, 12))
    later = tok.clone()
    later[:, 7:] = (later[:, 7:] + 5) % 16
    with torch.no_grad():
        a, b = model(tok), model(later)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])
    plain = build_model("transformer", 16, d_model=16, n_heads=2)
    n = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n(model) - n(plain) == 2 * (16 * 4 + 16) and plain.blocks[0].attn.conv is None


def test_ablation_models_are_named_but_not_run_by_default():
    from xlstm_kit.cli.parsers import MODEL_HELP
    from xlstm_kit.experiments.models import ABLATION_MODELS, DEFAULT_MODELS

    assert all(m in MODEL_HELP for m in MODEL_NAMES)
    assert "transformer-conv" in ABLATION_MODELS and not set(ABLATION_MODELS) & set(DEFAULT_MODELS)
    assert set(DEFAULT_MODELS) | set(ABLATION_MODELS) == set(MODEL_NAMES)


def test_transformer_without_rope_sees_positions_only_through_causality():
    """rope=False (the training benchmark's faster reference): in one block, the last position's
    output does not depend on the order of the tokens before it; with RoPE it does. (From the
    second block on, causality alone makes earlier positions' states order-dependent.)"""
    from xlstm_kit.experiments.baselines import TransformerLM

    torch.manual_seed(0)
    tokens = torch.tensor([[3, 7, 1, 9, 4]])
    swapped = torch.tensor([[7, 3, 1, 9, 4]])
    plain = TransformerLM(16, d_model=16, n_blocks=1, n_heads=2, rope=False).double()
    roped = TransformerLM(16, d_model=16, n_blocks=1, n_heads=2).double()
    roped.load_state_dict(plain.state_dict())
    torch.testing.assert_close(plain(tokens)[0, -1], plain(swapped)[0, -1])
    assert (roped(tokens)[0, -1] - roped(swapped)[0, -1]).abs().max() > 1e-6
