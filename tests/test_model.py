"""XLSTMConfig validation and presets; the language model: resumable forward, step path,
generation, initialisation, dtypes and bad input."""
import json
import math

import pytest
import torch

from tests.helpers import rel_err
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.generation.generate import sample_next

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def small_config(**kw):
    base = dict(vocab_size=40, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], chunk_size=8)
    return XLSTMConfig(**{**base, **kw})


def small_model(dtype=torch.float32, noise=0.2, **kw):
    model = XLSTMLanguageModel(small_config(**kw)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return model.eval()


# ------------------------------------------------------------------------------ config
@pytest.mark.parametrize("kwargs, needle", [
    (dict(d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
    (dict(d_model=32, n_heads=3, slstm_at=[]), "inner width 64 (mlstm_proj_factor * d_model rounded up"),
    (dict(slstm_heads=3, slstm_at=[0]), "slstm_heads=3"),
    (dict(n_blocks=4, slstm_at=[4]), "position 4 is out of range for n_blocks=4"),
    (dict(slstm_at=[-1]), "out of range"),
    (dict(slstm_at=[1, 1]), "twice"),
    (dict(slstm_at="7-1"), "ratio"),
    (dict(slstm_at="0:0"), "ratio"),
    (dict(slstm_at=3), "list of block positions"),
    (dict(d_model=-8), "d_model must be a positive integer"),
    (dict(n_blocks=0), "n_blocks must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size must be a positive integer"),
    (dict(n_heads=True), "n_heads must be a positive integer"),
    (dict(mlstm_proj_factor=float("nan")), "mlstm_proj_factor must be a positive finite number"),
    (dict(ffn_proj_factor=-1.0), "ffn_proj_factor"),
    (dict(dropout=1.0), "dropout"),
    (dict(qkv_block_size=5), "qkv_block_size=5"),
    (dict(backend="cuda"), "backend"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(bias="yes"), "bias must be True or False"),
    # fields that pass one by one but multiply into a width no machine holds
    (dict(round_proj_to=1099511627776), "round_proj_to must be at most"),
    (dict(mlstm_proj_factor=1e12), "mlstm_inner_dim = "),
    (dict(ffn_proj_factor=1e300, slstm_at=[0]), "ffn_dim = "),
    (dict(n_heads=2**40), "n_heads must be at most"),
])
def test_impossible_configs_raise_one_line_value_errors(kwargs, needle):
    with pytest.raises(ValueError) as e:
        small_config(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("spec, n, expected", [
    ("7:1", 16, (7, 15)),
    ("1:1", 4, (1, 3)),
    ("3:1", 4, (3,)),
    ("1:0", 5, ()),
    ("0:1", 3, (0, 1, 2)),
    ([2, 0], 3, (0, 2)),
])
def test_slstm_positions(spec, n, expected):
    cfg = small_config(n_blocks=n, slstm_at=spec)
    assert cfg.slstm_positions == expected
    assert cfg.block_types == tuple("s" if t in expected else "m" for t in range(n))


def test_presets_match_the_paper():
    tiny = XLSTMConfig.from_name("tiny")
    assert (tiny.vocab_size, tiny.d_model, tiny.n_blocks) == (256, 128, 4)
    assert XLSTMConfig.from_name("TINY", d_model=64).d_model == 64
    assert XLSTMConfig.from_name("xlstm-125m") == XLSTMConfig.from_name("125M")
    # mLSTM heads split the inner width, not d_model: the official package accepts this
    assert XLSTMConfig(d_model=72, n_heads=16, slstm_at=[]).mlstm_inner_dim == 192
    # parameter counts of the paper's xLSTM[7:1] models (163.7M, 409.3M, 840.4M, 1420.4M)
    paper = {"125M": 163.7e6, "350M": 409.3e6, "760M": 840.4e6, "1.3B": 1420.4e6}
    for name, count in paper.items():
        cfg = XLSTMConfig.from_name(name)
        assert cfg.context_length == 2048 and cfg.vocab_size == 50257
        with torch.device("meta"):
            n = XLSTMLanguageModel(cfg).num_parameters()
        assert abs(n / count - 1) < 0.005, (name, n)
    with pytest.raises(ValueError, match="unknown preset"):
        XLSTMConfig.from_name("13B")


def test_pack_factor_looks_only_at_packable_counts():
    """How many 4-wide heads pack into a 16-wide block, for a head count far beyond any model
    (the loop once ran over every count up to it)."""
    from xlstm_kit.layers.common import _pack_factor

    assert _pack_factor(2**38, 4) == 4 and _pack_factor(6, 4) == 3 and _pack_factor(7, 4) == 1
    assert _pack_factor(2**38, 32) == 1


def test_config_json_round_trip():
    cfg = small_config(slstm_at=(2, 0), slstm_heads=4, tie_embeddings=True)
    again = XLSTMConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg
    with pytest.raises(ValueError, match="unknown XLSTMConfig fields"):
        XLSTMConfig.from_dict({**cfg.to_dict(), "n_layers": 3})


# ------------------------------------------------------------------------------ model
def test_forward_shapes_and_state_carried_across_calls():
    model = small_model(F64)
    tokens = torch.randint(0, 40, (2, 29))
    logits = model(tokens)
    assert logits.shape == (2, 29, 40) and logits.dtype == F64
    a, s = model(tokens[:, :11], return_state=True)
    b, s = model(tokens[:, 11:12], state=s, return_state=True)
    c = model(tokens[:, 12:], state=s)
    assert rel_err(torch.cat([a, b, c], 1), logits) < 1e-10
    # float32: the same within float32 rounding
    model32 = small_model()
    a, s = model32(tokens[:, :17], return_state=True)
    assert rel_err(torch.cat([a, model32(tokens[:, 17:], state=s)], 1), model32(tokens)) < 1e-5


def test_step_equals_forward():
    model = small_model(F64, slstm_at=[0, 2])
    tokens = torch.randint(0, 40, (3, 9))
    ref = model(tokens)
    state, outs = model.init_state(3), []
    for t in range(9):
        logits, state = model.step(tokens[:, t], state)
        outs.append(logits)
    assert rel_err(torch.stack(outs, 1), ref) < 1e-10
    first, _ = model.step(tokens[:, 0])  # state=None: the zero state
    assert rel_err(first, ref[:, 0]) < 1e-10
    # any integer dtype works for token ids
    assert torch.equal(model(tokens.to(torch.uint8)), ref) and torch.equal(model(tokens.int()), ref)


def test_greedy_generation_is_argmax_of_teacher_forced_logits():
    model = small_model()
    prompt = torch.randint(0, 40, (2, 7))
    out = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert out.shape == (2, 19) and torch.equal(out[:, :7], prompt)
    logits = model(out)
    assert torch.equal(logits[:, 6:-1].argmax(-1), out[:, 7:])
    # a 1-D prompt gives a 1-D result; top_k=1 is greedy too
    one = model.generate(prompt[0], max_new_tokens=5, temperature=1.0, top_k=1)
    assert torch.equal(one, out[0, :12])


def test_generation_state_does_not_grow():
    model = small_model()
    _, s = model(torch.randint(0, 40, (1, 3)), return_state=True)
    _, s_long = model(torch.randint(0, 40, (1, 50)), return_state=True)
    size = lambda state: sum(t.numel() for block in state for t in block)  # noqa: E731
    assert size(s) == size(s_long) == size(model.init_state(1))


def test_sampling_options():
    model = small_model()
    prompt = torch.randint(0, 40, (3, 4))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a = model.generate(prompt, 10, temperature=1.5, top_k=5, top_p=0.9, generator=g1)
    b = model.generate(prompt, 10, temperature=1.5, top_k=5, top_p=0.9, generator=g2)
    assert torch.equal(a, b) and a.shape == (3, 14)
    # top_k / top_p keep only the allowed tokens
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(200, 1)
    assert set(sample_next(logits, 1.0, top_k=2).tolist()) <= {0, 1}
    assert set(sample_next(logits, 1.0, top_p=0.5).tolist()) == {0}  # p(0) = 0.64 >= 0.5
    assert set(sample_next(logits, 1.0, top_p=0.7).tolist()) == {0, 1}
    assert len(set(sample_next(logits, 5.0).tolist())) == 5


def test_eos_stops_and_pads():
    model = small_model()
    prompt = torch.randint(0, 40, (2, 5))
    greedy = model.generate(prompt, 8, temperature=0)
    eos = int(greedy[0, 7])  # the 3rd token generated for sequence 0
    out = model.generate(prompt, 8, temperature=0, eos_token_id=eos)
    row0 = out[0, 5:].tolist()
    assert row0[:3] == greedy[0, 5:8].tolist() and all(t == eos for t in row0[2:])
    if eos not in greedy[1, 5:].tolist():
        assert out.shape[1] == 13  # sequence 1 never finished: no early stop
    else:
        assert out.shape[1] <= 13
    stop_now = int(greedy[:, 5][0])
    if int(greedy[1, 5]) == stop_now:  # both finish at once: stops after one token
        assert model.generate(prompt, 8, temperature=0, eos_token_id=stop_now).shape[1] == 6
    assert model.training is False
    model.train()
    model.generate(prompt, 2)
    assert model.training is True  # generation restores the mode


@pytest.mark.parametrize("dtype", [torch.bfloat16, F64])
def test_other_dtypes(dtype):
    ref = small_model()
    model = small_model(dtype)
    model.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, 40, (2, 10))
    logits, state = model(tokens, return_state=True)
    assert logits.dtype == dtype
    assert all(t.dtype == (F64 if dtype == F64 else torch.float32) for s in state for t in s)
    assert rel_err(logits, ref(tokens)) < (0.05 if dtype == torch.bfloat16 else 1e-5)


def test_initialisation_follows_the_official_package():
    cfg = XLSTMConfig(vocab_size=300, d_model=64, n_blocks=4, n_heads=4, slstm_at=[3])
    model = XLSTMLanguageModel(cfg)
    small = math.sqrt(2 / (5 * 64))
    assert abs(model.embedding.weight.std().item() / small - 1) < 0.05
    assert abs(model.lm_head.weight.std().item() / small - 1) < 0.05
    assert torch.equal(model.blocks[0].layer.fgate.bias.detach(), torch.linspace(3, 6, 4))
    slstm = model.blocks[3].layer
    expected = 5.0 - 12.0 * torch.linspace(0, 1, 16) ** 1.6  # last block: exponent 0.3 + 1.3
    assert torch.allclose(slstm.bias[1], expected.expand(4, 16))
    assert abs(model.blocks[3].ffn.down_proj.weight.std().item() / (2 / 4 / 8) - 1) < 0.05
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p.detach(), torch.ones_like(p)), name


def test_tied_embeddings_share_one_matrix():
    model = XLSTMLanguageModel(small_config(tie_embeddings=True))
    assert model.lm_head.weight is model.embedding.weight
    assert model.num_parameters() == XLSTMLanguageModel(small_config()).num_parameters() - 40 * 32


def test_training_reduces_loss():
    torch.manual_seed(0)
    model = XLSTMLanguageModel(small_config(vocab_size=8, d_model=32, n_blocks=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.arange(8).repeat(4, 5)  # a periodic sequence the model can learn
    losses = []
    for _ in range(15):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 8), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


# ------------------------------------------------------------------------------ bad input
def test_bad_tokens_raise():
    model = small_model()
    with pytest.raises(ValueError, match=r"ids in \[1, 40\] but vocab_size is 40"):
        model(torch.tensor([[1, 2, 40]]))
    with pytest.raises(ValueError, match="ids in"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="integer token ids"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"shape \[B, T\]"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"shape \[B\]"):
        model.step(torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), -1)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, top_p=0.0)
    with pytest.raises(ValueError, match="eos_token_id"):
        model.generate(torch.zeros(1, 2, dtype=torch.long), 2, eos_token_id=40)


def test_foreign_states_raise():
    model = small_model()
    tokens = torch.randint(0, 40, (2, 5))
    _, state = model(tokens, return_state=True)
    with pytest.raises(ValueError, match="batch size 2 but the tokens have batch size 3"):
        model(torch.randint(0, 40, (3, 5)), state=state)
    other = small_model(slstm_at=[0])  # another block layout
    with pytest.raises(ValueError, match="another config"):
        other(tokens, state=state)
    wider = small_model(d_model=64)
    with pytest.raises(ValueError, match="another config"):
        wider(tokens, state=state)
    with pytest.raises(ValueError, match="list of 3 block states"):
        model(tokens, state=state[:2])
    with pytest.raises(ValueError, match="batch size"):
        model.step(tokens[:1, 0], state)


def test_cuda_graph_option_on_cpu():
    model = small_model()
    prompt = torch.randint(0, 40, (2, 5))
    eager = model.generate(prompt, 6, temperature=0, cuda_graph=False)
    assert torch.equal(model.generate(prompt, 6, temperature=0), eager)  # None on CPU: eager
    with pytest.raises(ValueError, match="CUDA"):
        model.generate(prompt, 6, temperature=0, cuda_graph=True)


def test_model_step_equals_checked_step():
    model = small_model()
    _, state = model(torch.randint(0, 40, (2, 6)), return_state=True)
    tok = torch.randint(0, 40, (2,))
    a, sa = model.step(tok, state)
    b, sb = model.step(tok, state, check=False)
    assert torch.equal(a, b) and all(torch.equal(x, y) for u, v in zip(sa, sb) for x, y in zip(u, v))
    with pytest.raises(ValueError, match="ids"):
        model.step(torch.tensor([0, 40]), state)


@pytest.mark.parametrize("family", ["neurips", "large"])
def test_in_place_step_equals_step_and_reuses_the_mlstm_state(family):
    """_step(inplace=True), what a CUDA graph replays: the same logits and state as step(), the
    mLSTM blocks' C written into the given tensors (the sLSTM and DPLR blocks' states anew)."""
    if family == "neurips":
        model = XLSTMLanguageModel(small_config(d_model=64, n_heads=4, dplr_at=[2])).double()
    else:
        model = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=40, d_model=64, n_blocks=2,
                                               n_heads=2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    _, state = model(torch.randint(0, 40, (2, 6)), return_state=True)
    tok = torch.randint(0, 40, (2,))
    a, sa = model.step(tok, state)
    mine = [type(s)(*(t.clone() for t in s)) for s in state]
    b, sb = model.step(tok, mine, inplace=True, check=False)
    assert torch.equal(a, b) and all(torch.equal(x, y) for u, v in zip(sa, sb) for x, y in zip(u, v))
    kinds = [type(s).__name__ for s in mine]
    reused = [s.C is n.C for s, n, k in zip(mine, sb, kinds) if k == "MLSTMState"]
    assert reused and all(reused)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_decoding_equals_eager(dtype):
    torch.manual_seed(0)
    model = XLSTMLanguageModel(small_config(d_model=64, n_heads=4, dplr_at=[2])).cuda().to(dtype)
    prompt = torch.randint(0, 40, (3, 9), device="cuda")
    eager = model.generate(prompt, 20, temperature=0, cuda_graph=False)
    graphed = model.generate(prompt, 20, temperature=0, cuda_graph=True)
    assert torch.equal(graphed, eager)
    # the graph's state buffers follow a state handed in from elsewhere
    from xlstm_kit.generation.generate import GraphedStep

    _, s0 = model(prompt, return_state=True)
    step = GraphedStep(model, prompt[:, -1], s0)
    tok = prompt[:, -1]
    la, sa = step(tok, s0)
    lb, sb = model.step(tok, s0)
    assert torch.equal(la, lb)
    _, s1 = model(prompt[:, :4], return_state=True)
    la, _ = step(tok, s1)
    assert torch.equal(la, model.step(tok, s1)[0])
