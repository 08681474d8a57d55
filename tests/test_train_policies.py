"""train()'s policies beyond the loop itself: the CPU thread count the command line uses (it was
the command line's only: 20x slower from Python on a busy 2-core machine), the warning that
compiling for the CPU costs minutes, and skipping the update of a step with a non-finite loss."""
import json
import warnings

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.training import compiling, loop, resources, workload
from xlstm_kit.training.config import MAX_SKIPPED_IN_A_ROW
from xlstm_kit.training.data import load_data


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("policies")
    mp = pytest.MonkeyPatch()
    mp.setenv("XLSTM_KIT_CACHE", str(root / "cache"))
    (root / "c.txt").write_text("some words to learn from, again and again\n" * 40)
    yield load_data(str(root / "c.txt"), "byte")
    mp.undo()


def _model():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))


def _config(**kw):
    return T.TrainConfig(**{**dict(steps=2, batch_size=2, seq_len=8, warmup_steps=0, eval_batches=1, eval_interval=0,
                                   eval_at_start=False, checkpoint_interval=0), **kw})


# ------------------------------------------------------------------------------ threads
@pytest.fixture
def default_threads():
    """torch's own thread setting (the intra-op count equal to the inter-op default), restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(torch.get_num_interop_threads())
    yield torch.get_num_threads()
    torch.set_num_threads(before)


def _threads_during(data, monkeypatch, **kw):
    seen = []
    T.train(_model(), data, _config(), callback=lambda e: seen.append(torch.get_num_threads()), device="cpu",
            handle_signals=False, **kw)
    return set(seen)


def test_train_uses_fewer_threads_on_busy_cores_unless_told(data, monkeypatch, default_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    calls = []
    monkeypatch.setattr(resources, "default_threads", lambda n: calls.append(n) or 1)  # "the cores are busy"
    if default_threads > 1:
        assert _threads_during(data, monkeypatch) == {1}
        assert torch.get_num_threads() == default_threads  # restored afterwards
    assert calls == [default_threads] or default_threads == 1
    # your own torch.set_num_threads is kept, and so are OMP_NUM_THREADS, threads=None and threads=n
    torch.set_num_threads(default_threads + 1)
    assert _threads_during(data, monkeypatch) == {default_threads + 1}
    torch.set_num_threads(default_threads)
    assert _threads_during(data, monkeypatch, threads=None) == {default_threads}
    assert _threads_during(data, monkeypatch, threads=3) == {3}
    monkeypatch.setenv("OMP_NUM_THREADS", str(default_threads))
    assert _threads_during(data, monkeypatch) == {default_threads}
    assert torch.get_num_threads() == default_threads
    with pytest.raises(XLSTMKitError, match="threads must be"):
        T.train(_model(), data, _config(), device="cpu", threads=0)


# ------------------------------------------------------------------------------ compiling on the CPU
def test_compiling_for_the_cpu_warns_of_its_cost(monkeypatch):
    monkeypatch.setattr(compiling, "compile_unavailable", lambda device: None)
    model = _model()
    monkeypatch.setattr(model, "compile_blocks", lambda: None)  # what it costs is the point, not paid here
    with pytest.warns(compiling.SlowCompileWarning, match="minutes"):
        compiling.prepare_model(model, _config(compile=True), "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiling.prepare_model(_model(), _config(), "cpu")  # no compile, no warning


def test_cli_train_compile_on_cpu_says_the_cost_in_one_line(tmp_path, monkeypatch, capsys):
    from xlstm_kit.cli import app, train as cli_train

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("words " * 400)
    monkeypatch.setattr(cli_train, "train", lambda *a, **k: T.TrainResult(step=2, interrupted=False))
    assert app.main(["train", "--compile", "--data", str(tmp_path / "c.txt"), "--steps", "2", "--device", "cpu",
                     "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "--compile" in warned[0] and "minutes" in warned[0], warned
    assert "minutes" in " ".join(app.build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())


# ------------------------------------------------------------------------------ non-finite steps
def _nan_at(monkeypatch, steps):
    """The loss of the given 1-based optimizer steps is NaN (one micro-batch per step)."""
    calls = {"n": 0}
    real = workload.lm_loss

    def loss(logits, target, *a, **k):
        calls["n"] += 1
        out = real(logits, target, *a, **k)
        return out * float("nan") if calls["n"] in steps else out

    monkeypatch.setattr(workload, "lm_loss", loss)


def test_skip_leaves_weights_and_optimizer_alone_and_counts(data, monkeypatch, tmp_path):
    _nan_at(monkeypatch, {2, 3})
    model = _model()
    snapshots = {}

    def record(event):
        if isinstance(event, T.StepEvent):
            opt = run_optimizer[0]
            moments = [s["exp_avg"].clone() for s in opt.state.values()] if opt is not None else []
            snapshots[event.step] = ({k: v.clone() for k, v in model.state_dict().items()}, moments)

    run_optimizer = [None]
    real_make = loop.make_optimizer

    def make(model, config):
        run_optimizer[0] = real_make(model, config)
        return run_optimizer[0]

    monkeypatch.setattr(loop, "make_optimizer", make)
    result = T.train(model, data, _config(steps=5, on_nonfinite="skip"), tmp_path / "run", callback=record,
                     device="cpu", handle_signals=False, threads=None)
    assert result.step == 5 and result.skipped_steps == 2
    for skipped in (2, 3):  # weights and Adam moments as after step 1
        w0, m0 = snapshots[1]
        w, m = snapshots[skipped]
        assert all(torch.equal(w0[k], w[k]) for k in w0) and all(torch.equal(a, b) for a, b in zip(m0, m))
    assert not torch.equal(snapshots[4][0]["embedding.weight"], snapshots[3][0]["embedding.weight"])
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in rows if "skipped_steps" in r] == [1, 2]
    assert T.read_train_meta(T.resolve_checkpoint(tmp_path / "run"))["train_config"]["on_nonfinite"] == "skip"


def test_skip_still_stops_after_too_many_in_a_row(data, monkeypatch):
    _nan_at(monkeypatch, set(range(1, 100)))
    with pytest.raises(T.TrainingDiverged, match=f"{MAX_SKIPPED_IN_A_ROW + 1} steps in a row"):
        T.train(_model(), data, _config(steps=50, on_nonfinite="skip"), device="cpu", handle_signals=False,
                threads=None)


def test_stop_is_the_default_and_the_option_is_checked(data, monkeypatch):
    _nan_at(monkeypatch, {2})
    with pytest.raises(T.TrainingDiverged, match="at step 2"):
        T.train(_model(), data, _config(steps=3), device="cpu", handle_signals=False, threads=None)
    with pytest.raises(XLSTMKitError, match="on_nonfinite"):
        _config(on_nonfinite="ignore")


def test_cli_on_nonfinite_reaches_the_config(tmp_path, monkeypatch, capsys):
    from xlstm_kit.cli import app, train as cli_train

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("words " * 400)
    seen = {}

    def fake(model, data, config, out, **kw):
        seen.update(config=config, threads=kw.get("threads", "auto"))
        return T.TrainResult(step=2, interrupted=False, skipped_steps=1)

    monkeypatch.setattr(cli_train, "train", fake)
    assert app.main(["train", "--on-nonfinite", "skip", "--data", str(tmp_path / "c.txt"), "--steps", "2",
                     "--device", "cpu", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert seen["config"].on_nonfinite == "skip"
    assert seen["threads"] is None  # the command line applied its own thread choice already
    assert "skipped the update of 1 step with a non-finite loss" in capsys.readouterr().err
