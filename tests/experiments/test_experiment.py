"""Experiment runner: model names, a quick end-to-end run, the sweep report and the CLI."""
import json
import os

import pytest
import torch

from tests.helpers import HOSTILE_FILES, HOSTILE_MESSAGES, make_hostile
from xlstm_kit.cli import main
from xlstm_kit.experiments.config import quick_config
from xlstm_kit.experiments.experiment import run_formal, run_mqar, run_sweep
from xlstm_kit.experiments.models import MODEL_NAMES, build_model, check_model_name


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_every_model_builds_and_gives_logits(name):
    model = build_model(name, 11, d_model=32, n_heads=4)
    tokens = torch.randint(0, 11, (2, 13))
    logits = model(tokens)
    assert logits.shape == (2, 13, 11) and torch.isfinite(logits).all()
    # causal: changing the last token leaves earlier outputs alone
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % 11
    assert torch.allclose(model(t2)[:, :-1], logits[:, :-1], atol=1e-5)
    assert not torch.allclose(model(t2)[:, -1], logits[:, -1])


def test_model_families_are_what_the_names_say():
    kinds = lambda m: "".join(type(b).__name__[0] for b in m.blocks)  # noqa: E731
    assert kinds(build_model("xlstm[0:1]", 8, d_model=32)) == "SS"
    assert kinds(build_model("xlstm[1:0]", 8, d_model=32)) == "MM"
    assert kinds(build_model(" XLSTM[1:1] ", 8, d_model=32)) == "MS"
    with pytest.raises(ValueError, match="unknown model"):
        check_model_name("xlstm[2:1]")


def test_quick_formal_run_trains_and_writes_results(tmp_path):
    r = run_formal("parity", "xlstm[1:1]", quick_config(steps=40), tmp_path)
    data = json.loads((tmp_path / "formal__parity__xlstm-1-1.json").read_text())
    assert data["steps_done"] == 40 and data["task"] == "parity" and data["model"] == "xlstm[1:1]"
    assert set(map(int, data["per_length"])) == {9, 12}
    assert -1.0 <= data["scaled_accuracy"] <= 1.0
    # from ~ln(vocab) to ~ln(2): the model at least learns which tokens answer
    assert r["loss_last"] < 0.8 * r["loss_first"]


def test_quick_mqar_run_writes_results(tmp_path):
    r = run_mqar("transformer", quick_config(steps=5), tmp_path)
    assert (tmp_path / "mqar__T64-N4__transformer.json").exists()
    assert 0.0 <= r["accuracy"] <= 1.0 and r["steps_done"] == 5


def test_time_limit_shortens_the_run(tmp_path):
    r = run_formal("majority", "transformer", quick_config(steps=100000, time_limit_s=3.0), None)
    assert 1 <= r["steps_done"] < 100000 and r["total_seconds"] < 10


def test_sweep_writes_table_and_heatmap(tmp_path):
    results = run_sweep(["parity", "majority"], ["lstm", "transformer"], quick_config(steps=3), tmp_path, mqar=False)
    assert len(results) == 4 and not any("error" in r for r in results)
    table = (tmp_path / "table.md").read_text()
    assert "| lstm |" in table and "| transformer |" in table and "majority" in table
    assert (tmp_path / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads((tmp_path / "results.json").read_text())) == 4


def test_cli_experiment(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["experiment", "formal", "--task", "even_pairs", "--model", "lstm", "--quick", "--steps", "3",
                 "--device", "cpu", "--out", out]) == 0
    assert "scaled accuracy" in capsys.readouterr().out
    assert (tmp_path / "runs" / "formal__even_pairs__lstm.json").exists()
    assert main(["experiment", "sweep", "--report-only", "--out", out]) == 0
    assert "even_pairs" in (tmp_path / "table.md").read_text()
    assert main(["experiment", "formal", "--task", "nope", "--model", "lstm", "--quick"]) == 2
    assert main(["experiment", "mqar", "--model", "gpt", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown formal task 'nope'" in err and "unknown model 'gpt'" in err and len(err.strip().splitlines()) == 2


def test_failed_run_is_reported_not_fatal(tmp_path):
    from xlstm_kit.experiments.experiment import _run_one, load_results, write_report

    cfg = quick_config(steps=2, d_model=30).to_dict()  # 30 does not split into 4 attention heads
    bad = _run_one(("formal", "parity", "transformer", cfg, str(tmp_path / "runs"), 0))
    assert "error" in bad and "heads" in bad["error"]
    write_report(load_results(tmp_path / "runs"), tmp_path)
    assert "| transformer | error |" in (tmp_path / "table.md").read_text()


def test_sweep_steps_per_task_and_longest_first(tmp_path, monkeypatch):
    import xlstm_kit.experiments.experiment as ex

    seen = []
    monkeypatch.setattr(ex, "_run_one", lambda job, progress=None: seen.append(job) or {"kind": job[0], "task": job[1],
                                                                           "model": job[2], "error": "not run"})
    ex.run_sweep(["majority", "parity"], ["lstm"], quick_config(steps=3), tmp_path, steps_for={"parity": 7})
    order = [(j[0], j[1], j[3]["steps"]) for j in seen]
    # MQAR first (the longest runs), then the formal runs by falling step count
    assert order == [("mqar", "T64-N4", 3), ("formal", "parity", 7), ("formal", "majority", 3)]
    with pytest.raises(ValueError, match="steps_for"):
        ex.run_sweep(["parity"], ["lstm"], quick_config(steps=3), tmp_path, steps_for={"parity": 0})
    with pytest.raises(ValueError, match="unknown formal task"):
        ex.run_sweep(["parity"], ["lstm"], quick_config(steps=3), tmp_path, steps_for={"parityy": 5})


def test_sweep_deals_runs_over_all_gpus(tmp_path, monkeypatch):
    import xlstm_kit.experiments.experiment as ex

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert ex.sweep_devices("cuda") == ["cuda:0", "cuda:1"]
    assert ex.sweep_devices("cuda:1") == ["cuda:1"] and ex.sweep_devices("cpu") == ["cpu"]
    seen = []
    monkeypatch.setattr(ex, "_run_one", lambda job, progress=None: seen.append(job[3]["device"]) or {"kind": job[0], "task": job[1],
                                                                                      "model": job[2], "error": "x"})
    ex.run_sweep(["parity", "majority"], ["lstm", "transformer"], quick_config(steps=3, device="cuda"), tmp_path)
    assert seen == ["cuda:0", "cuda:1"] * 3


def test_cli_sweep_options_and_mqar_default_lr(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["experiment", "sweep", "--tasks", "parity", "--models", "lstm", "--quick", "--device", "cpu",
                 "--steps", "2", "--steps-for", "parity=3", "--mqar-steps", "4", "--mqar-lr", "2e-3",
                 "--out", out]) == 0
    runs = {p.name.split("__")[0]: json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*.json")}
    assert runs["formal"]["steps_done"] == 3 and runs["mqar"]["steps_done"] == 4
    assert runs["formal"]["config"]["lr"] == pytest.approx(3e-3) and runs["mqar"]["config"]["lr"] == pytest.approx(2e-3)
    assert main(["experiment", "sweep", "--quick", "--steps-for", "parity=x", "--out", out]) == 2
    assert "--steps-for" in capsys.readouterr().err
    assert main(["experiment", "sweep", "--quick", "--mqar-lr", "1e-3,-1", "--out", out]) == 2
    assert "--mqar-lr" in capsys.readouterr().err
    # several MQAR learning rates: one run (and one table column) per rate
    sub = tmp_path / "two"
    assert main(["experiment", "sweep", "--tasks", "parity", "--models", "lstm", "--quick", "--device", "cpu",
                 "--steps", "2", "--mqar-lr", "1e-3,3e-3", "--out", str(sub)]) == 0
    names = sorted(p.name for p in (sub / "runs").glob("mqar__*.json"))
    assert names == ["mqar__T64-N4-lr0.001__lstm.json", "mqar__T64-N4-lr0.003__lstm.json"]
    assert "MQAR T64-N4-lr0.003" in (sub / "table.md").read_text()
    # a full-size MQAR run (not --quick) takes MQAR_LR unless --lr says otherwise
    assert main(["experiment", "mqar", "--model", "lstm", "--steps", "1", "--d-model", "16", "--batch-size", "2",
                 "--seq-len", "64", "--pairs", "4", "--device", "cpu", "--out", out]) == 0
    data = json.loads((tmp_path / "runs" / "mqar__T64-N4__lstm.json").read_text())
    assert data["config"]["lr"] == pytest.approx(1e-3) and data["config"]["min_lr"] == pytest.approx(1e-4)


def test_cli_experiment_defaults_to_runs_and_shows_progress(tmp_path, capsys, monkeypatch):
    from xlstm_kit.cli import build_parser

    args = build_parser().parse_args(["experiment", "formal", "--task", "parity", "--model", "lstm"])
    assert args.out == "runs/experiments"  # gitignored, not the committed results/ folder
    monkeypatch.chdir(tmp_path)
    assert main(["experiment", "formal", "--task", "parity", "--model", "lstm", "--quick", "--steps", "3",
                 "--device", "cpu"]) == 0
    assert (tmp_path / "runs" / "experiments" / "runs" / "formal__parity__lstm.json").exists()
    err = capsys.readouterr().err
    assert "formal parity lstm: up to 3 steps" in err
    assert "step 1/3" in err and "step 3/3" in err  # first and last step, whatever the interval
    assert main(["experiment", "sweep", "--tasks", "parity,majority", "--models", "lstm", "--no-mqar", "--quick",
                 "--steps", "2", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "sweep: 2 runs" in err and "[1/2] formal" in err and "[2/2] formal" in err


def test_progress_lines_are_throttled():
    import io

    import pickle

    from xlstm_kit.cli.experiment import ProgressLines

    now, stream = [0.0], io.StringIO()
    report = ProgressLines("formal parity lstm", stream, every_s=10.0, clock=lambda: now[0])
    for step in range(1, 101):
        now[0] = step * 0.5  # 2 steps per second: a line per 20 steps
        report(step, 100, 1.0 / step)
    lines = stream.getvalue().splitlines()
    assert lines[0].strip().startswith("formal parity lstm: step 1/100") and "step 100/100" in lines[-1]
    assert 5 <= len(lines) <= 7
    assert pickle.loads(pickle.dumps(ProgressLines("x"))).label == "x"  # goes to a sweep's worker processes


def test_experiment_training_uses_the_library_step(monkeypatch):
    import xlstm_kit.experiments.task_loop as ex

    calls = []
    real = ex.train_step
    monkeypatch.setattr(ex, "train_step", lambda *a, **k: calls.append(k["lr"]) or real(*a, **k))
    r = run_formal("parity", "lstm", quick_config(steps=4, warmup_steps=1), None)
    assert r["steps_done"] == 4 and len(calls) == 4
    from xlstm_kit.training import TrainConfig, lr_at

    sched = TrainConfig(steps=4, lr=3e-3, min_lr=3e-4, warmup_steps=0)  # warmup: at most a fifth of the run
    assert calls == pytest.approx([lr_at(s, sched) for s in range(4)])


def test_sweep_report_without_matplotlib(tmp_path, monkeypatch):
    import sys

    from xlstm_kit.experiments.experiment import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    paths = write_report([{"kind": "formal", "task": "parity", "model": "lstm", "error": "x"}], tmp_path)
    assert paths["plot"] is None and paths["table"].exists() and not (tmp_path / "heatmap.png").exists()


def test_mqar_run_stops_once_converged():
    from xlstm_kit.experiments.config import RunConfig
    from xlstm_kit.experiments.task_loop import CONVERGED_LOGS

    # the loss starts near ln(256) = 5.5 and falls below ln(128) = 4.85 once the model predicts
    # values from the upper half only: 5.0 is crossed early, 1e-6 never
    cfg = quick_config(steps=400, lr=1e-2, converged_loss=5.0)
    r = run_mqar("transformer", cfg)
    losses = [v for _, v in r["losses"]]
    assert r["converged_at"] == r["steps_done"] < 400 and r["planned_steps"] == 400
    assert all(v < 5.0 for v in losses[-CONVERGED_LOGS:]) and max(losses) >= 5.0
    assert not all(v < 5.0 for v in losses[-CONVERGED_LOGS - 1:])  # it stopped at the first chance
    r = run_mqar("transformer", quick_config(steps=30, lr=1e-2, converged_loss=1e-6))
    assert r["steps_done"] == 30 and "converged_at" not in r
    with pytest.raises(ValueError, match="converged_loss"):
        RunConfig(converged_loss=0.0)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_mqar_head_at_the_query_positions_only_equals_the_masked_loss(name):
    import numpy as np

    from xlstm_kit.experiments.task_loop import _AtPositions, masked_loss, positions_loss
    from xlstm_kit.experiments.mqar import mqar_batch

    batch = mqar_batch(np.random.default_rng(3), 3, 32, 4, vocab_size=64, spacing="powerlaw")
    assert batch.positions.shape == (3, 4) and bool(batch.mask.gather(1, batch.positions).all())
    assert int(batch.mask.sum()) == 12 and bool((batch.positions.diff(dim=1) > 0).all())
    torch.manual_seed(0)
    model = build_model(name, 64, d_model=32, n_heads=4).double()
    full = model(batch.inputs)
    at = _AtPositions(model)((batch.inputs, batch.positions))
    assert at.shape == (3, 4, 64)
    torch.testing.assert_close(at, full.gather(1, batch.positions[..., None].expand(-1, -1, 64)))
    ref = masked_loss(full, batch)
    grads_ref = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    loss = positions_loss(at, batch)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, ref)
    for g, r in zip(grads, grads_ref):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r)


def test_a_schedule_fitted_to_the_time_limit_keeps_the_warmup_share(monkeypatch):
    # 10 % warmup of a nominal 1000 steps, fitted to 40: 4 warmup steps (was a fifth of the run)
    from xlstm_kit.experiments import task_loop as ex
    from xlstm_kit.training import loop

    class Budget(ex.TimeBudget):
        def steps_that_fit(self, done, **kw):
            return 40

    scheds, real = [], loop.lr_at
    monkeypatch.setattr(ex, "TimeBudget", Budget)
    monkeypatch.setattr(loop, "lr_at", lambda step, sched: scheds.append(sched) or real(step, sched))
    r = run_formal("parity", "lstm-plain", quick_config(steps=1000, warmup_steps=100, time_limit_s=600.0), None)
    assert r["planned_steps"] == r["steps_done"] == 40
    assert (scheds[0].steps, scheds[0].warmup_steps) == (1000, 100)
    assert (scheds[-1].steps, scheds[-1].warmup_steps) == (40, 4)


def test_a_run_with_a_checkpoint_locks_its_folder(tmp_path):
    from xlstm_kit.io.locking import RunLocked, run_lock

    with run_lock(tmp_path / "run.ckpt"):  # another process training into it
        with pytest.raises(RunLocked, match="being written by another run"):
            run_formal("parity", "lstm-plain", quick_config(steps=2), checkpoint=tmp_path / "run.ckpt")
    assert not (tmp_path / "run.ckpt" / "latest").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["fifo", "folder"])
def test_a_run_whose_latest_is_not_a_file_is_refused_in_one_line(tmp_path, what):
    """Not taken for a run that never saved (it would start over and write past it)."""
    from xlstm_kit.io.checkpoint import CheckpointError

    (tmp_path / "run.ckpt").mkdir()
    latest = tmp_path / "run.ckpt" / "latest"
    os.mkfifo(latest) if what == "fifo" else latest.mkdir()
    with pytest.raises(CheckpointError, match="latest is not a regular file") as e:
        run_formal("parity", "lstm-plain", quick_config(steps=2), checkpoint=tmp_path / "run.ckpt")
    assert "\n" not in str(e.value)


def test_an_interrupted_run_saves_and_continues_exactly(tmp_path, single_thread):
    """Ctrl-C in a run with a checkpoint saves its last step (the training loop's rule); the
    same call then continues to the uninterrupted run's losses and accuracy (on one thread: the
    "auto" policy follows the machine's load, and thread counts change the sums' order)."""
    cfg = quick_config(steps=8, log_every=1)
    whole = run_formal("parity", "xlstm[1:1]", cfg)

    def interrupt(step, planned, loss):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_formal("parity", "xlstm[1:1]", cfg, checkpoint=tmp_path / "run.ckpt", progress=interrupt)
    assert (tmp_path / "run.ckpt" / "latest").read_text().strip() == "checkpoints/step-00000003"
    rest = run_formal("parity", "xlstm[1:1]", cfg, checkpoint=tmp_path / "run.ckpt")
    assert rest["losses"] == whole["losses"] and rest["steps_done"] == 8
    assert rest["scaled_accuracy"] == whole["scaled_accuracy"]


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_a_hostile_results_file_is_one_line_at_once(tmp_path, kind, capsys):
    from xlstm_kit.errors import XLSTMKitError
    from xlstm_kit.experiments.experiment import MAX_RUN_FILE_BYTES, load_results

    (tmp_path / "runs").mkdir()
    make_hostile(tmp_path / "runs" / "formal__parity__lstm.json", kind, MAX_RUN_FILE_BYTES)
    with pytest.raises(XLSTMKitError) as e:
        load_results(tmp_path / "runs")
    assert HOSTILE_MESSAGES[kind] in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert main(["experiment", "sweep", "--report-only", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--report-only" in err and HOSTILE_MESSAGES[kind] in err, err


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", ["fifo", "oversized", "not UTF-8"])
@pytest.mark.parametrize("protocol", [False, True])
def test_a_hostile_command_file_is_one_line(tmp_path, capsys, kind, protocol):
    """The sweep's command.txt, read again for --report-only (either report) and by write_report:
    a FIFO (a plain read blocks for ever), an oversized file or bytes that are not UTF-8 give a
    one-line error at once, not a hang or a traceback."""
    import xlstm_kit.experiments.experiment as ex

    runs = tmp_path / "runs"
    runs.mkdir()
    result = {"id": "r", "kind": "formal", "task": "parity", "model": "lstm", "width": 32, "lr": 1e-3, "seed": 0,
              "error": "not run"}
    (runs / "r.json").write_text(json.dumps(result))
    command = tmp_path / ex.COMMAND_FILE
    if kind == "not UTF-8":
        command.write_bytes(b"xlstm-kit experiment sweep \xff\n")
        needle = "not UTF-8"
    else:
        make_hostile(command, kind, ex.MAX_COMMAND_BYTES)
        needle = HOSTILE_MESSAGES[kind]
    capsys.readouterr()
    argv = ["experiment", "sweep", "--report-only", "--out", str(tmp_path)] + (["--protocol", "quick"] if protocol else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and ex.COMMAND_FILE in err and "Traceback" not in err, err
    if not protocol:
        with pytest.raises(ex.XLSTMKitError) as e:
            ex.write_report([result], tmp_path)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_command_file_heads_the_report(tmp_path):
    import xlstm_kit.experiments.experiment as ex

    result = {"kind": "formal", "task": "parity", "model": "lstm", "error": "not run"}
    (tmp_path / ex.COMMAND_FILE).write_text("xlstm-kit experiment sweep --tasks parity\n")
    ex.write_report([result], tmp_path)
    assert "xlstm-kit experiment sweep --tasks parity" in (tmp_path / ex.RESULTS_TABLE).read_text()
