"""LoRA adapters (xlstm_kit.lora, injected by PEFT): a model with non-zero adapters computes what
its merged model computes on every path (the PyTorch paths, and under TRITON_INTERPRET=1 the Triton
training and decode kernels that read weights directly) for the paper's mLSTM / sLSTM / DPLR blocks
and the xLSTM-7B blocks; training moves the adapters only and resumes exactly; adapters save
alone, load back onto the base model and export merged; bad settings stop in one line."""
import copy
import importlib.util
import os

import pytest
import torch

from tests.helpers import HOSTILE_FILES, HOSTILE_MESSAGES, in_child, make_hostile, rel_err
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.cli import app as cli
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.lora import (apply_lora, block_linear_names, has_adapters, load_adapters, lora_settings, merge_lora,
                            save_adapters)
from xlstm_kit.training import StepEvent, TrainConfig, train
from xlstm_kit.training.data import load_data

FAMILIES = {
    # one block of each paper type: mLSTM, sLSTM, DPLR
    "paper": dict(vocab_size=64, d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], dplr_at=[2], context_length=64),
    # n_heads 1: head dims of 16 and 32, which the Triton mLSTM kernels take
    "large": dict(family="large", vocab_size=64, d_model=32, n_blocks=2, n_heads=1, qk_dim_factor=0.5,
                  context_length=64),
}
needs_kernels = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


@pytest.fixture(autouse=True)
def _one_thread(single_thread):  # tiny shapes (see tests/conftest.py)
    yield


def _base(cfg: dict, backend: str = "torch", seed: int = 0) -> XLSTMLanguageModel:
    torch.manual_seed(seed)
    model = XLSTMLanguageModel(XLSTMConfig(**cfg, backend=backend))
    with torch.no_grad():  # off the init (zero gate maps, unit norms): every weight matters
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _with_adapters(model: XLSTMLanguageModel) -> XLSTMLanguageModel:
    """Adapters on every linear map of the blocks, B drawn non-zero (it starts at zero): a model
    unlike the base one."""
    apply_lora(model, 4, alpha=6, targets=block_linear_names(model))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.3)
    return model


def _merged(model: XLSTMLanguageModel, cfg: dict) -> XLSTMLanguageModel:
    """The adapters folded into the weights, in a plain model on the PyTorch backend."""
    ref = XLSTMLanguageModel(XLSTMConfig(**cfg, backend="torch"))
    ref.load_state_dict(merge_lora(copy.deepcopy(model)).state_dict())
    return ref


def _states_close(a, b, tol: float) -> None:
    for sa, sb in zip(a, b):
        for name, ta, tb in zip(sa._fields, sa, sb):
            if tb.numel():
                assert rel_err(ta, tb) < tol, name


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_compute_what_the_merged_model_computes(family):
    """PyTorch paths: training forward, forward with its final state, one-token steps, greedy
    generation; the adapters change the model (the base differs), the merge keeps it."""
    cfg = FAMILIES[family]
    base = _base(cfg)
    model = _with_adapters(copy.deepcopy(base))
    merged = _merged(model, cfg)
    x = torch.randint(0, 64, (2, 24))
    want = merged(x)
    assert rel_err(model(x), want) < 1e-5  # gradients recorded: the training paths
    assert rel_err(base(x), want) > 1e-2
    with torch.no_grad():
        got, state = model(x, return_state=True)
        want, want_state = merged(x, return_state=True)
        assert rel_err(got, want) < 1e-5
        _states_close(state, want_state, 1e-5)
        for tok in torch.randint(0, 64, (3, 2)):
            got, state = model.step(tok, state)
            want, want_state = merged.step(tok, want_state)
            assert rel_err(got, want) < 1e-5
        _states_close(state, want_state, 1e-5)
    model.eval(), merged.eval()
    assert torch.equal(model.generate(x[0, :5], 8, temperature=0), merged.generate(x[0, :5], 8, temperature=0))


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_the_triton_kernels_honour_the_adapters(family, monkeypatch):
    """Triton backend: the training forward (paper mLSTM: the fused cell, whose front kernel reads
    the folded gate weights) and its adapter gradients, and the fused one-token block kernels (which
    read every weight directly), against the merged model on the PyTorch backend."""
    # the DPLR block calls its maps as modules (PEFT's own forward): nothing of it reads weights
    cfg = {**FAMILIES[family], "n_blocks": 2, "dplr_at": []} if family == "paper" else FAMILIES[family]
    model = _with_adapters(_base(cfg, "triton"))
    twin = _with_adapters(_base(cfg, "torch"))  # the same weights and adapters on the PyTorch paths
    twin.load_state_dict(model.state_dict())
    merged = _merged(model, cfg)
    calls = []
    from xlstm_kit.layers import mlstm
    from xlstm_kit.ops.blocks import decode, large_decode, slstm_decode
    for mod, name in ((mlstm, "mlstm_cell"), (decode, "mlstm_block_step"), (slstm_decode, "slstm_block_step"),
                      (large_decode, "large_block_step")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, fn=fn, name=name, **k: calls.append(name) or fn(*a, **k))

    x = torch.randint(0, 64, (1, 16))
    logits = model(x)
    assert rel_err(logits, merged(x)) < 1e-4
    lora = [n for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(logits.square().mean(), [p for p in model.parameters() if p.requires_grad])
    twin_grads = torch.autograd.grad(twin(x).square().mean(), [p for p in twin.parameters() if p.requires_grad])
    for name, g, r in zip(lora, grads, twin_grads):
        assert r.abs().sum() > 0 and rel_err(g, r) < 1e-3, name
    with torch.no_grad():
        _, state = merged(x, return_state=True)
        want_state = state
        for tok in torch.randint(0, 64, (2, 1)):
            got, state = model.step(tok, state)
            want, want_state = merged.step(tok, want_state)
            assert rel_err(got, want) < 1e-4
        _states_close(state, want_state, 1e-4)
    expected = {"paper": ["mlstm_cell"] + ["mlstm_block_step", "slstm_block_step"] * 2,
                "large": ["large_block_step"] * 4}[family]
    assert calls == expected


TEXT = "to be, or not to be: that is the question. whether 'tis nobler in the mind to suffer. " * 30


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    return load_data(str(f), "byte")


def _config(**kw):
    base = dict(steps=6, batch_size=4, seq_len=32, lr=2e-2, min_lr=2e-3, warmup_steps=1, eval_interval=0,
                eval_batches=2, checkpoint_interval=2, seed=1, lora=4)
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_training_moves_only_the_adapters(family, data, tmp_path):
    cfg = {**FAMILIES[family], "vocab_size": 256}
    model = _base(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(model, data, _config(), tmp_path / "run", handle_signals=False)
    settings = lora_settings(model)
    assert settings["rank"] == 4 and settings["alpha"] == 8.0 and settings["targets"]
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    after = model.state_dict()
    for key, value in before.items():  # the base weights and biases, wrapped or not, are untouched
        owner, leaf = key.rsplit(".", 1)
        assert torch.equal(after[key] if key in after else after[f"{owner}.base_layer.{leaf}"], value), key
    assert any(not torch.equal(after[n], torch.zeros_like(after[n])) for n in trainable if ".lora_B." in n)
    assert result.evals[-1][1].loss < result.evals[0][1].loss - 0.1


def test_a_lora_run_resumes_exactly(data, tmp_path):
    """A LoRA run stopped at step 2 and resumed onto a fresh base model (the checkpoint's adapters
    are rebuilt and loaded) continues as the uninterrupted run."""
    cfg = {**FAMILIES["paper"], "vocab_size": 256, "n_blocks": 2, "dplr_at": []}
    straight = _base(cfg)
    full = train(straight, data, _config(steps=4), tmp_path / "straight", handle_signals=False)

    def stop_after_2(event):
        if isinstance(event, StepEvent) and event.step == 2:
            raise KeyboardInterrupt

    cut = train(_base(cfg), data, _config(steps=4), tmp_path / "resumed", callback=stop_after_2, handle_signals=False)
    assert cut.interrupted and cut.step == 2
    resumed = _base(cfg, seed=5)  # other base weights: the checkpoint's must come back
    part = train(resumed, data, _config(steps=4), tmp_path / "resumed", resume=True, handle_signals=False)
    assert [loss for _, loss in part.losses] == [loss for _, loss in full.losses[2:]]
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(XLSTMKitError, match="lora"):  # the adapters' shape is part of the run
        train(_base(cfg), data, _config(steps=6, lora=8), tmp_path / "resumed", resume=True, handle_signals=False)


def test_adapters_save_alone_load_back_and_export_merged(tmp_path):
    cfg = FAMILIES["large"]
    base = _base(cfg)
    model = _with_adapters(copy.deepcopy(base)).eval()
    x = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        want = model(x)
    folder = save_adapters(model, tmp_path / "adapters")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert (folder / "adapter_model.safetensors").stat().st_size < base_bytes / 4
    again = load_adapters(copy.deepcopy(base), folder).eval()
    with torch.no_grad():
        assert torch.equal(again(x), want)

    model.save(tmp_path / "ckpt")  # base weights and adapters, resumable
    loaded = XLSTMLanguageModel.load(tmp_path / "ckpt")
    used = XLSTMLanguageModel.from_pretrained(tmp_path / "ckpt")  # to use: merged
    assert lora_settings(loaded) == lora_settings(model) and not has_adapters(used)
    with torch.no_grad():
        assert torch.equal(loaded(x), want) and rel_err(used(x), want) < 1e-5

    with pytest.raises(XLSTMKitError, match="merge_lora"):
        model.save_pretrained(tmp_path / "hf", format="hf")
    merge_lora(model).save_pretrained(tmp_path / "hf", format="hf")
    assert not has_adapters(model) and all(p.requires_grad for p in model.parameters())
    exported = XLSTMLanguageModel.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    with torch.no_grad():
        assert rel_err(exported(x), want) < 1e-5

    wider = _base({**cfg, "d_model": 48})
    with pytest.raises(XLSTMKitError, match="does not fit"):
        load_adapters(wider, folder)
    assert not has_adapters(wider)  # refused without leaving adapters behind


def test_bad_settings_stop_in_one_line(tmp_path, capsys, monkeypatch):
    model = _base(FAMILIES["large"])
    for rank in (0, -1, True, 2.5):
        with pytest.raises(XLSTMKitError, match="rank must be a positive integer"):
            apply_lora(model, rank)
    with pytest.raises(XLSTMKitError, match=r"'nope' is not a linear map of this model's blocks; they have .*proj_up"):
        apply_lora(model, 4, targets=["q", "nope"])
    with pytest.raises(XLSTMKitError, match="alpha"):
        apply_lora(model, 4, alpha=0)
    assert not has_adapters(model)
    apply_lora(model, 4)
    with pytest.raises(XLSTMKitError, match="already has LoRA adapters"):
        apply_lora(model, 4)
    for kw in (dict(lora=-1), dict(lora=True), dict(lora_alpha=2.0), dict(lora=4, lora_targets=[])):
        with pytest.raises(XLSTMKitError, match="lora"):
            TrainConfig(**kw)

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    _base({**FAMILIES["large"], "vocab_size": 256}).save(tmp_path / "base", tokenizer="byte")
    (tmp_path / "text.txt").write_text(TEXT)
    fast = ["--data", str(tmp_path / "text.txt"), "--steps", "2", "--batch-size", "2", "--seq-len", "16",
            "--eval-batches", "1", "--no-progress", "--out", str(tmp_path / "run")]
    for args, needle in ((["--lora", "4"], "add --init-from"),
                         (["--init-from", str(tmp_path / "base"), "--lora", "4", "--lora-targets", "q,nope"], "'nope'"),
                         (["--init-from", str(tmp_path / "base"), "--lora", "0"], "--lora"),
                         (["--init-from", str(tmp_path / "base"), "--lora-alpha", "3"], "add --lora RANK")):
        try:
            code = cli.main(["train", *fast, *args])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()

    assert cli.main(["train", *fast, "--init-from", str(tmp_path / "base"), "--lora", "4"]) == 0
    assert "LoRA adapters of rank 4" in capsys.readouterr().err
    assert cli.main(["train", *fast, "--resume", "--steps", "3"]) == 0
    assert "done: step 3" in capsys.readouterr().err
    assert cli.main(["train", *fast, "--resume", "--steps", "4", "--lora", "8"]) == 2
    assert "--lora cannot change on --resume" in capsys.readouterr().err


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_hostile_adapter_config_is_one_line_at_once(tmp_path, kind):
    """adapter_config.json as a FIFO (passed over before: the model loaded without adapters), an
    oversized file or JSON nested too deeply (a RecursionError traceback): one line, in an adapter
    folder and in a model folder."""
    from xlstm_kit.io.jsonfile import MAX_CONFIG_BYTES
    from xlstm_kit.io.lora import read_adapter_config

    model = _base(FAMILIES["large"])
    model.save(tmp_path / "m")
    (tmp_path / "a").mkdir()
    for folder in (tmp_path / "a", tmp_path / "m"):
        make_hostile(folder / "adapter_config.json", kind, MAX_CONFIG_BYTES)
    calls = [lambda: read_adapter_config(tmp_path / "a"), lambda: load_adapters(copy.deepcopy(model), tmp_path / "a"),
             lambda: XLSTMLanguageModel.load(tmp_path / "m"), lambda: XLSTMLanguageModel.from_pretrained(tmp_path / "m")]
    for call in calls:
        with pytest.raises(XLSTMKitError) as e:
            call()
        assert HOSTILE_MESSAGES[kind] in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", ["fifo", "device", "folder", "swapped"])
def test_adapter_weights_that_are_not_a_file_are_refused_as_such(tmp_path, monkeypatch, kind):
    """adapter_model.safetensors as a FIFO, a device or a folder was reported missing ("not an
    adapter folder"), and the weights were read by name after a check of the name: a FIFO put
    there in between ("swapped") blocked the load for ever."""
    base = _base(FAMILIES["large"])
    folder = save_adapters(_with_adapters(copy.deepcopy(base)), tmp_path / "adapters")
    weights = folder / "adapter_model.safetensors"
    stand_in = tmp_path / "stand-in"
    weights.rename(stand_in)
    if kind == "device":
        weights.symlink_to(os.devnull)
    elif kind == "folder":
        weights.mkdir()
    else:
        os.mkfifo(weights)
    if kind == "swapped":  # a check of the name sees the file the FIFO replaced
        real_stat = os.stat
        monkeypatch.setattr(os, "stat", lambda p, *a, **k: real_stat(stand_in if os.fspath(p) == os.fspath(weights)
                                                                      else p, *a, **k))
    # in a child process: safetensors' open of a FIFO blocks in native code holding the GIL
    error = in_child(lambda: load_adapters(copy.deepcopy(base), folder))
    assert error is not None and error[2], error
    assert "adapter_model.safetensors is not a regular file" in error[1] and "\n" not in error[1], error
