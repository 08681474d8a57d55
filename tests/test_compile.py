"""torch.compile and activation checkpointing for training: XLSTMLanguageModel.compile_blocks and
set_activation_checkpointing, TrainConfig.compile / activation_checkpointing, `train --compile`.

Compiled runs use backend="aot_eager" (Dynamo and AOTAutograd build the graphs Inductor would
get and run them eagerly): Inductor's C++ builds of even these tiny models take minutes on a
2-core CPU, so the one real Inductor test is marked slow. The CPU runs the PyTorch paths of the
ops; on CUDA the Triton kernels are torch.library custom ops (their opcheck tests are under
tests/ops/)."""
import importlib.util
import json

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from xlstm_kit.cli import app as cli
from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

from tests.test_train import data  # noqa: F401  (the byte-level corpus fixture)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    # Compiled code is cached per code object: a fresh cache per test keeps each test's
    # compilations its own (and far from Dynamo's recompile limit, past which it runs eagerly).
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(vocab_size=64, d_model=32, n_blocks=4, n_heads=2, context_length=16, chunk_size=8)
    return XLSTMLanguageModel(XLSTMConfig(**{**base, **kw}))


def loss_and_grads(model, tokens, seed=0, bf16=False):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with T.autocast("cpu", "bf16" if bf16 else "fp32"):
        logits = model(tokens)
    loss = T.lm_loss(logits[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, atol, rtol):
    (la, ga), (lb, gb) = a, b
    torch.testing.assert_close(la, lb, atol=atol, rtol=rtol)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], atol=atol, rtol=rtol, msg=name)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_compiled_blocks_match_eager_for_every_block_type():
    # mLSTM, sLSTM, DPLR and mLSTM again: the last block must reuse the first one's graphs.
    model = tiny(slstm_at=[1], dplr_at=[2], chunk_size=4)  # 8 steps, 2 chunks: Dynamo unrolls the sLSTM loop
    assert model.config.block_types == ("m", "s", "d", "m")
    tokens = torch.randint(0, 64, (2, 8))
    eager = loss_and_grads(model, tokens)
    keys = list(model.state_dict())

    model.compile_blocks(backend="aot_eager")
    assert model.is_compiled and list(model.state_dict()) == keys
    blocks, _ = model._compiled
    x = torch.randn(2, 8, 32, requires_grad=True)
    blocks[0](x).sum().backward()
    after_first = graphs()
    assert after_first > 0
    blocks[3](x).sum().backward()
    assert graphs() == after_first  # an identical block costs no compilation

    compiled = loss_and_grads(model, tokens)
    assert_same(compiled, eager, atol=1e-5, rtol=1e-4)
    assert eager[0] > 1.0 and max(g.abs().max() for g in eager[1].values()) > 1e-3  # not a trivial match

    # Without gradients (validation, generation) the model runs eagerly: no new graphs.
    n = graphs()
    with torch.no_grad():
        out = model(tokens[:, :5])
    text = model.generate(tokens[0, :4], 3, temperature=0)
    assert graphs() == n
    model._compiled = None
    with torch.no_grad():
        torch.testing.assert_close(out, model(tokens[:, :5]), atol=0, rtol=0)
    assert torch.equal(text, model.generate(tokens[0, :4], 3, temperature=0)) and text.shape == (7,)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_compiled_prefill_matches_eager_and_reuses_its_graphs_across_lengths():
    """compile_prefill on the GPU's (Triton) path, interpreted: without gradients the compiled
    blocks read prompts with dynamic shapes, giving eager's logits and states for every block
    type, from zero and from a state; once the shapes are dynamic a new length compiles
    nothing; `generate` still gives eager's tokens."""
    model = tiny(n_blocks=3, slstm_at=[1], dplr_at=[2], chunk_size=16, backend="triton")
    tokens = torch.randint(0, 64, (2, 40))
    prompts = [tokens[0, :5], tokens[1, :9]]
    with torch.no_grad():
        want = [model(tokens[:, :n], return_state=True) for n in (5, 17, 23)]
        want_cont = model(tokens[:, 23:], state=want[2][1], return_state=True)
    text = model.generate(prompts, 2, temperature=0)
    model.compile_prefill(backend="eager")
    assert model.prefill_compiled and not model.is_compiled
    with torch.no_grad():
        got = [model(tokens[:, :n], return_state=True) for n in (5, 17)]
        n = graphs()
        got.append(model(tokens[:, :23], return_state=True))
        assert graphs() == n  # a third length: no new graph
        got_cont = model(tokens[:, 23:], state=got[2][1], return_state=True)
    assert n > 0
    for (lw, sw), (lg, sg) in zip(want + [want_cont], got + [got_cont]):
        torch.testing.assert_close(lg, lw, atol=1e-5, rtol=1e-5)
        for a, b in zip(sw, sg):
            for x, y in zip(a, b):
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
    assert want[0][0].abs().max() > 0.1  # not a trivial match
    assert all(torch.equal(a, b) for a, b in zip(model.generate(prompts, 2, temperature=0), text))


def test_fullgraph_without_slstm_blocks():
    model = tiny(n_blocks=2, dplr_at=[1])
    tokens = torch.randint(0, 64, (2, 16))
    eager = loss_and_grads(model, tokens)
    model.compile_blocks(backend="aot_eager", fullgraph=True)
    assert_same(loss_and_grads(model, tokens), eager, atol=1e-5, rtol=1e-4)


def test_compiled_forward_checks_token_ids_without_a_graph_break():
    # Reading the ids back (int()) would sync and split the graph; under compile an asynchronous
    # device assertion checks them. uint8 ids up to 255 must pass a 256-token vocabulary.
    from xlstm_kit.experiments.baselines import TransformerLM

    for model in (tiny(n_blocks=1, vocab_size=256), TransformerLM(256, 32, 1, 2)):
        f = torch.compile(model, backend="aot_eager", fullgraph=True)
        assert f(torch.full((2, 8), 255, dtype=torch.uint8)).shape == (2, 8, 256)
        with pytest.raises(RuntimeError, match=r"(outside|lie in) \[0, 255\]"):
            f(torch.full((2, 8), 256))
        with pytest.raises(RuntimeError, match=r"(outside|lie in) \[0, 255\]"):
            f(torch.full((2, 8), -1))


def saved_bytes(model, tokens):
    """Bytes of the tensors autograd keeps for the backward of one forward."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return total


def test_activation_checkpointing_gives_identical_gradients():
    # Dropout on, so the recomputed forward must replay the same masks.
    model = tiny(slstm_at=[1], dplr_at=[2], dropout=0.2)
    tokens = torch.randint(0, 64, (2, 16))
    plain = loss_and_grads(model, tokens, seed=3)
    assert not torch.equal(plain[0], loss_and_grads(model, tokens, seed=4)[0])  # the masks matter
    full = saved_bytes(model, tokens)
    for which, blocks in (("mlstm", (0, 3)), ("slstm", (1,)), ("dplr", (2,)), ("all", (0, 1, 2, 3))):
        model.set_activation_checkpointing(which)
        assert model.activation_checkpointing == blocks
        assert_same(loss_and_grads(model, tokens, seed=3), plain, atol=1e-7, rtol=0)
        assert saved_bytes(model, tokens) < full
    assert saved_bytes(model, tokens) < full / 3  # "all": only the blocks' inputs stay
    model.set_activation_checkpointing(False)
    assert model.activation_checkpointing == () and saved_bytes(model, tokens) == full
    with pytest.raises(XLSTMKitError, match="one of none, all, mlstm, slstm, dplr"):
        model.set_activation_checkpointing("ffn")


def test_activation_checkpointing_with_compile_and_autocast():
    model = tiny(n_blocks=2, dplr_at=[1], dropout=0.2)
    tokens = torch.randint(0, 64, (2, 16))
    model.compile_blocks(backend="aot_eager")
    plain = loss_and_grads(model, tokens, seed=3, bf16=True)
    model.set_activation_checkpointing("all")
    recomputed = loss_and_grads(model, tokens, seed=3, bf16=True)
    assert_same(recomputed, plain, atol=1e-6, rtol=0)
    assert plain[1]["blocks.0.layer.up_proj.weight"].abs().max() > 0


@pytest.mark.slow  # minutes of C++ builds on 2 CPU cores
def test_inductor_compiled_training_matches_eager():
    model = tiny(n_blocks=1)
    tokens = torch.randint(0, 64, (2, 16))
    eager = loss_and_grads(model, tokens)
    model.compile_blocks()
    compiled = loss_and_grads(model, tokens)
    assert_same(compiled, eager, atol=1e-5, rtol=1e-4)
    model.set_activation_checkpointing("all")  # recomputing Inductor's graph in the backward
    assert_same(loss_and_grads(model, tokens), compiled, atol=1e-6, rtol=0)


# ------------------------------------------------------------------------------ train and CLI




def config(**kw):
    base = dict(steps=2, batch_size=2, seq_len=16, warmup_steps=1, eval_interval=0, eval_batches=1,
                eval_at_start=False, checkpoint_interval=0, seed=1)
    return T.TrainConfig(**{**base, **kw})


def test_train_config_fields():
    assert T.TrainConfig().compile is False and T.TrainConfig().activation_checkpointing == "none"
    assert T.TrainConfig(activation_checkpointing=True).activation_checkpointing == "all"
    assert T.TrainConfig(activation_checkpointing="SLSTM").activation_checkpointing == "slstm"
    c = T.TrainConfig(compile=True, activation_checkpointing="mlstm")
    assert T.TrainConfig.from_dict(c.to_dict()) == c
    with pytest.raises(XLSTMKitError, match="compile must be True or False"):
        T.TrainConfig(compile="yes")
    with pytest.raises(XLSTMKitError, match="activation checkpointing must be one of"):
        T.TrainConfig(activation_checkpointing="some")


def test_compile_refused_in_one_line_without_a_cxx_compiler(data, tmp_path, capsys):
    import torch._inductor.config as inductor_config

    before = T.compile_unavailable("cpu")
    # Inductor's config module is patched through its own API (monkeypatch's undo deletes the key).
    with inductor_config.patch({"cpp.cxx": ("xlstm-kit-no-such-c++",)}):
        _refused(data, tmp_path, capsys)
    assert T.compile_unavailable("cpu") == before


def _refused(data, tmp_path, capsys):
    assert "C++ compiler" in T.compile_unavailable("cpu")
    with pytest.raises(XLSTMKitError, match="found none.*without compile"):
        T.train(tiny(n_blocks=1, vocab_size=256), data, config(compile=True), device="cpu", handle_signals=False)
    code = cli.main(["train", "--compile", "--steps", "2", "--out", str(tmp_path / "run"), "--data",
                     str(tmp_path / "corpus.txt"), "--batch-size", "2", "--seq-len", "16", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "C++ compiler" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "latest").exists()


def test_a_failing_compilation_becomes_one_error(data, monkeypatch):
    def broken(gm, example_inputs):
        raise RuntimeError("backend exploded")

    original = XLSTMLanguageModel.compile_blocks
    monkeypatch.setattr(XLSTMLanguageModel, "compile_blocks", lambda self: original(self, backend=broken))
    with pytest.raises(XLSTMKitError, match="torch.compile failed.*backend exploded.*without compile"):
        T.train(tiny(n_blocks=1, vocab_size=256), data, config(compile=True), device="cpu", handle_signals=False)


def test_cli_train_compile_reports_and_saves_a_plain_checkpoint(tmp_path, monkeypatch, capsys):
    from xlstm_kit import models

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    # The command line builds xlstm_kit.models' class, which xlstm_kit's subclasses: patched on
    # the subclass, the run compiled with Inductor (C++ builds: 166 s without a warm cache)
    original, compiled = models.XLSTMLanguageModel.compile_blocks, []
    monkeypatch.setattr(models.XLSTMLanguageModel, "compile_blocks",
                        lambda self: compiled.append(self) or original(self, backend="aot_eager"))
    out = tmp_path / "run"
    code = cli.main(["train", "--compile", "--activation-checkpointing", "--steps", "3", "--out", str(out),
                     "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert len(compiled) == 1  # with aot_eager
    assert "compiled: the first step took" in err and "done: step 3" in err
    assert ", compiled, recomputing all blocks in the backward" in err
    rows = [json.loads(line) for line in (out / T.METRICS_FILE).read_text().splitlines()]
    timing = [r for r in rows if "compile_s" in r]
    assert len(timing) == 1 and timing[0]["step"] == 2
    assert timing[0]["first_step_s"] > timing[0]["step_s"] > 0 and timing[0]["compile_s"] > 0
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    state = T.load_training_state(T.resolve_checkpoint(out))["train_config"]
    assert state["compile"] is True and state["activation_checkpointing"] == "all"

    model = XLSTMLanguageModel.load(out)  # a plain, uncompiled model
    assert not model.is_compiled and model.activation_checkpointing == ()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert torch.isfinite(model(tokens)).all()


@pytest.mark.parametrize("kw", [dict(n_blocks=10, slstm_at=[1, 6], dplr_at=[3]),
                                dict(family="large", n_blocks=6, n_heads=2)])
def test_compiled_step_decodes_the_same_tokens_with_graphs_per_block_type(kw):
    model = tiny(**kw).eval()
    with torch.no_grad():  # off the initial weights (the large family starts with zero gates)
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    prompt = torch.randint(0, 64, (2, 9))
    ref = model.generate(prompt, 6, temperature=0)
    logits_ref, _ = model.step(prompt[:, 0], model.init_state(2))
    model.compile_step(backend="aot_eager")
    assert torch.equal(model.generate(prompt, 6, temperature=0), ref)
    logits, _ = model.step(prompt[:, 0], model.init_state(2))
    torch.testing.assert_close(logits, logits_ref, rtol=1e-5, atol=1e-5)
    graphs = counters["stats"]["unique_graphs"]
    types = len(set(model.config.block_types))
    assert graphs <= 2 * (types + 1) < len(model.blocks) + 2  # shared across blocks, not one per block
    model.generate(prompt, 6, temperature=0)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiles on the next call


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [dict(d_model=128, n_heads=4, n_blocks=4, slstm_at=[1], dplr_at=[3]),
                                dict(family="large", d_model=256, n_heads=4, n_blocks=3)])
def test_compiled_graphed_bf16_step_within_twice_the_eager_error(kw):
    """compile_step on CUDA (Inductor, coordinate-descent tuning) replayed in generate's CUDA
    graph with the state updated in place: a few steps of bf16 logits and states against a
    float64 copy of the model, within 2x the error of the eager bf16 step."""
    from xlstm_kit.generation.generate import GraphedStep

    model = tiny(**{**kw, "vocab_size": 512}).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ref = XLSTMLanguageModel(model.config).double().eval()
    ref.load_state_dict(model.state_dict())
    model = model.cuda().to(torch.bfloat16)
    prompt = torch.randint(0, 512, (3, 37), device="cuda")
    toks = torch.randint(0, 512, (5, 3), device="cuda")
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    with torch.no_grad():
        _, s_ref = ref(prompt.cpu(), return_state=True)
        _, s0 = model(prompt, return_state=True)
        s_eager = s0
        model.compile_step()
        step = GraphedStep(model, toks[0], [type(s)(*(t.clone() for t in s)) for s in s0])
        s_graph = [type(s)(*(t.clone() for t in s)) for s in s0]
        for t in range(toks.shape[0]):
            want, s_ref = ref.step(toks[t].cpu(), s_ref)
            model._compiled_step, compiled = None, model._compiled_step  # the eager bf16 step
            eager, s_eager = model.step(toks[t], s_eager)
            model._compiled_step = compiled
            got, s_graph = step(toks[t], s_graph)
            assert rel(got.cpu(), want) <= 2 * rel(eager.cpu(), want) + 1e-3
        for sg, se, sr in zip(s_graph, s_eager, s_ref):
            for g, e, r in zip(sg, se, sr):
                if r.numel():
                    assert rel(g.cpu(), r) <= 2 * rel(e.cpu(), r) + 1e-4
