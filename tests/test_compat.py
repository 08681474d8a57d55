"""Conversion from and to the official `xlstm` package (2.0.6, pure-PyTorch paths: mLSTM
parallel_stabilized_simple and sLSTM "vanilla"): same logits after moving every weight."""
import pytest
import torch
import xlstm

from tests.helpers import rel_err
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.io.compat import from_official_xlstm, to_official_xlstm


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def official_model(slstm_at, *, num_blocks=3, mlstm_heads=2, slstm_heads=2, bias=False, tie=False,
                   embedding_dim=32, vocab_size=50, context_length=24):
    cfg = xlstm.xLSTMLMModelConfig(
        mlstm_block=xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(num_heads=mlstm_heads)),
        slstm_block=xlstm.sLSTMBlockConfig(
            slstm=xlstm.sLSTMLayerConfig(backend="vanilla", num_heads=slstm_heads),
            feedforward=xlstm.FeedForwardConfig(proj_factor=1.3, act_fn="gelu", bias=bias),
        ),
        context_length=context_length, num_blocks=num_blocks, embedding_dim=embedding_dim,
        slstm_at=slstm_at, vocab_size=vocab_size, bias=bias, tie_weights=tie,
    )
    model = xlstm.xLSTMLMModel(cfg)
    model.reset_parameters()
    # every weight off its initial value: zero gate weights, zero recurrent kernels and
    # all-one norms would hide layout mistakes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


CASES = {
    "xLSTM[1:0]": dict(slstm_at=[]),
    "xLSTM[0:1]": dict(slstm_at=[0, 1, 2]),
    "mixed": dict(slstm_at=[1]),
    "mixed, biases, tied, other head counts": dict(slstm_at=[0, 2], num_blocks=4, mlstm_heads=4,
                                                   slstm_heads=8, bias=True, tie=True, embedding_dim=64),
    "odd widths (d_model 72, 16 mLSTM heads of 12)": dict(slstm_at=[1], embedding_dim=72, mlstm_heads=16,
                                                         slstm_heads=4),
}


@pytest.mark.parametrize("case", CASES)
def test_converted_official_model_gives_the_same_logits(case):
    official = official_model(**CASES[case])
    ours = from_official_xlstm(official)
    tokens = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        expected = official(tokens)
        assert rel_err(ours(tokens), expected) < 1e-4
        # and back: the official model rebuilt from ours
        again = to_official_xlstm(ours)
        assert rel_err(again(tokens), expected) < 1e-5
    assert ours.config.slstm_positions == tuple(CASES[case]["slstm_at"])
    assert ours.config.tie_embeddings == CASES[case].get("tie", False)


def test_config_is_carried_over():
    official = official_model(**CASES["mixed, biases, tied, other head counts"])
    cfg = from_official_xlstm(official).config
    assert (cfg.d_model, cfg.n_blocks, cfg.n_heads, cfg.slstm_num_heads, cfg.vocab_size) == (64, 4, 4, 8, 50)
    assert cfg.bias and cfg.mlstm_inner_dim == 128 and cfg.ffn_dim == 128
    assert cfg.context_length == 24


def test_round_trip_from_ours():
    torch.manual_seed(3)
    ours = XLSTMLanguageModel(XLSTMConfig(vocab_size=50, d_model=32, n_blocks=3, n_heads=2, slstm_at=[0],
                                          context_length=20))
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    official = to_official_xlstm(ours)
    back = from_official_xlstm(official)
    assert back.config == ours.config
    for (name, a), b in zip(ours.state_dict().items(), back.state_dict().values()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
    tokens = torch.randint(0, 50, (2, 20))
    with torch.no_grad():
        assert rel_err(official(tokens), ours(tokens)) < 1e-4


def test_generation_matches_the_official_step():
    official = official_model(slstm_at=[1])
    ours = from_official_xlstm(official)
    tokens = torch.randint(0, 50, (2, 6))
    state, ours_state = None, ours.init_state(2)
    with torch.no_grad():
        for t in range(6):
            expected, state = official.step(tokens[:, t : t + 1], state)
            got, ours_state = ours.step(tokens[:, t], ours_state)
            assert rel_err(got, expected[:, 0]) < 1e-4


def test_unsupported_official_configs_raise():
    cfg = xlstm.xLSTMLMModelConfig(
        mlstm_block=xlstm.mLSTMBlockConfig(mlstm=xlstm.mLSTMLayerConfig(num_heads=2, conv1d_kernel_size=4)),
        slstm_block=xlstm.sLSTMBlockConfig(slstm=xlstm.sLSTMLayerConfig(backend="vanilla", num_heads=2,
                                                                          conv1d_kernel_size=2)),
        context_length=8, num_blocks=2, embedding_dim=32, slstm_at=[1], vocab_size=20,
    )
    with pytest.raises(ValueError, match="one conv1d kernel size"):
        from_official_xlstm(xlstm.xLSTMLMModel(cfg))
    with pytest.raises(ValueError, match="xLSTMLMModel"):
        from_official_xlstm(torch.nn.Linear(2, 2))


def test_dplr_blocks_are_refused_not_mangled():
    from xlstm_kit.io.compat import to_official_xlstm

    cfg = XLSTMConfig(vocab_size=32, d_model=32, n_blocks=2, n_heads=4, slstm_at=[], dplr_at=[1])
    with pytest.raises(ValueError, match="DPLR"):
        to_official_xlstm(XLSTMLanguageModel(cfg))
