"""The paper's protocol: grid expansion, resumability, aggregation and report, CLI."""
import json

import numpy as np
import pytest

from tests.helpers import HOSTILE_FILES, HOSTILE_MESSAGES, make_hostile
from xlstm_kit.cli import main
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.experiments import protocol as pr
from xlstm_kit.experiments.experiment import MAX_RUN_FILE_BYTES


def test_formal_grid_expansion():
    jobs = pr.formal_plan(["parity", "solve_equation"], ["xlstm[1:1]", "lstm-plain"], pr.PROTOCOLS["paper"])
    assert len(jobs) == 2 * 2 * 3 * 2 and len({j.id for j in jobs}) == len(jobs)
    assert {j.lr for j in jobs} == {1e-2, 1e-3, 1e-4} and {j.seed for j in jobs} == {0, 1}
    for j in jobs:
        c = j.config
        assert c["batch_size"] == 256 and tuple(c["betas"]) == (0.9, 0.99) and c["min_lr"] == 1e-5
        assert c["steps"] == (10_000 if j.task == "parity" else 20_000)
        assert c["warmup_steps"] == c["steps"] // 10
        assert c["tasks"] == "paper" and c["teacher_forcing"] is False and c["slstm"] == "paper"
        assert c["lr"] == j.lr and c["seed"] == j.seed
    few = pr.formal_plan(["parity"], ["lstm"], pr.PROTOCOLS["paper"], lrs=[3e-3], seeds=[0, 1, 2],
                         overrides={"steps": 500})
    assert [(j.lr, j.seed, j.config["steps"], j.config["warmup_steps"]) for j in few] == \
        [(3e-3, 0, 500, 50), (3e-3, 1, 500, 50), (3e-3, 2, 500, 50)]
    with pytest.raises(XLSTMKitError):
        pr.formal_plan(["parity"], ["gpt"], pr.PROTOCOLS["paper"])


def test_mqar_grid_expansion():
    jobs = pr.mqar_plan(["xlstm[1:1]"], pr.PROTOCOLS["paper"], "fig5")
    assert len(jobs) == 3 * 5 * 4 * 2
    assert {j.task for j in jobs} == {"T2048-N48", "T2048-N96", "T2048-N256"}
    assert {j.width for j in jobs} == {32, 64, 128, 256, 512}
    np.testing.assert_allclose(sorted({j.lr for j in jobs}), np.logspace(-4, -2, 4), rtol=1e-2)
    c = jobs[0].config
    assert c["mqar_vocab"] == 8192 and c["mqar_spacing"] == "powerlaw" and c["steps"] == 25_000
    assert "slstm" not in c  # MQAR keeps the language-model sLSTM blocks
    assert {j.task for j in pr.mqar_plan(["lstm"], pr.PROTOCOLS["paper"], "zoology")} == {"T64-N4", "T128-N8", "T256-N16"}
    with pytest.raises(XLSTMKitError, match="setting"):
        pr.mqar_plan(["lstm"], pr.PROTOCOLS["paper"], "fig9")
    one = pr.mqar_plan(["lstm"], pr.PROTOCOLS["paper"], "zoology", shapes=[(256, 16)], widths=[128])
    assert {j.task for j in one} == {"T256-N16"} and len(one) == 4 * 2
    assert one[0].config["converged_loss"] == pr.MQAR_CONVERGED_LOSS
    with pytest.raises(XLSTMKitError, match="too short"):
        pr.mqar_plan(["lstm"], pr.PROTOCOLS["paper"], "zoology", shapes=[(32, 16)])


def test_finished_runs_are_skipped(tmp_path, monkeypatch):
    jobs = pr.formal_plan(["parity"], ["lstm"], pr.PROTOCOLS["quick"])
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{jobs[0].id}.json").write_text(json.dumps({"id": jobs[0].id, "scaled_accuracy": 1.0}))
    (runs / f"{jobs[1].id}.json").write_text(json.dumps({"id": jobs[1].id, "error": "boom"}))
    (runs / f"{jobs[2].id}.json").write_text('{"id": "cut sh')  # killed mid-write
    ran = []
    monkeypatch.setattr(pr, "run_job", lambda j, d, dev, stop_at=None, score_paused=False: ran.append(j.id) or {"id": j.id})
    pr.run_plan(jobs, tmp_path)
    assert sorted(ran) == sorted(j.id for j in jobs[1:])
    assert pr.finished(jobs[0], runs) and not pr.finished(jobs[1], runs)


def _fake(kind, task, model, width, lr, seed, score):
    return {"id": f"{kind}{task}{model}{width}{lr}{seed}", "kind": kind, "task": task, "model": model,
            "width": width, "lr": lr, "seed": seed, "scaled_accuracy": score}


def test_aggregate_and_report_on_fake_results(tmp_path):
    res = [_fake("formal", "parity", "xlstm[1:1]", 128, 1e-3, 0, 1.0), _fake("formal", "parity", "xlstm[1:1]", 128, 1e-3, 1, 0.5),
           _fake("formal", "parity", "xlstm[1:1]", 128, 1e-2, 0, 0.9), _fake("formal", "parity", "xlstm[1:1]", 128, 1e-2, 1, 0.2),
           _fake("formal", "reverse_string", "lstm", 128, 1e-3, 0, 0.3),
           {**_fake("formal", "reverse_string", "lstm", 128, 1e-2, 0, 0), "error": "RuntimeError: x"},
           _fake("mqar", "T256-N16", "transformer", 64, 1e-3, 0, 0.9), _fake("mqar", "T256-N16", "transformer", 128, 1e-3, 0, 1.0),
           _fake("mqar", "T64-N4", "transformer", 64, 1e-3, 0, 0.95)]
    rows = {(r["task"], r["model"], r["width"]): r for r in pr.aggregate(res)}
    best = rows[("parity", "xlstm[1:1]", 128)]["best"]
    assert best["lr"] == 1e-3 and best["mean"] == pytest.approx(0.75) and best["std"] == pytest.approx(0.25)
    assert rows[("parity", "xlstm[1:1]", 128)]["per_lr"][1e-2]["mean"] == pytest.approx(0.55)
    assert rows[("reverse_string", "lstm", 128)]["errors"] == 1
    paths = pr.write_protocol_report(res, tmp_path, command="xlstm-kit experiment sweep --protocol paper")
    text = paths["report"].read_text()
    assert "0.75 ± 0.25 (lr 0.001, n=2)" in text
    assert "| parity | xlstm[1:1] | 128 | 0.01 | 0.90, 0.20 | 1/2 |" in text  # every run, not only the mean
    assert "| lstm | 0.17 | 0.30 |" in text  # the paper's Figure 12 value next to ours
    assert "## MQAR T64-N4" in text and text.index("T64-N4") < text.index("T256-N16")
    assert "| transformer | 0.90 ± 0.00 (lr 0.001, n=1) | 1.00 ± 0.00 (lr 0.001, n=1) |" in text
    assert "| T64-N4 | transformer | 64 | 0.001 | 0 | 0.950 | ? | ? | ? |" in text  # every MQAR run too
    assert json.loads(paths["summary"].read_text())
    pytest.importorskip("matplotlib")
    assert paths["figure4"].exists() and paths["mqar"].exists()


def test_cli_protocol_quick_smoke(tmp_path, capsys):
    out = str(tmp_path / "ex")
    args = ["experiment", "formal", "--task", "majority_count", "--model", "lstm-plain", "--protocol", "quick",
            "--steps", "2", "--seeds", "0", "--eval-samples", "3", "--device", "cpu", "--out", out]
    assert main(args) == 0
    runs = sorted((tmp_path / "ex" / "runs").glob("*.json"))
    assert len(runs) == 2  # 2 learning rates x 1 seed
    r = json.loads(runs[0].read_text())
    assert r["config"]["tasks"] == "paper" and r["config"]["teacher_forcing"] is False and r["steps_done"] == 2
    assert r["config"]["eval_samples"] == 3 and r["config"]["betas"] == [0.9, 0.99]
    assert "report:" in capsys.readouterr().out
    assert main(args) == 0
    assert "2 finished before, 0 to run" in capsys.readouterr().err
    assert main(["experiment", "sweep", "--report-only", "--protocol", "quick", "--out", out]) == 0
    assert main(["experiment", "formal", "--task", "parity", "--model", "lstm", "--protocol", "quick", "--lr", "1e-3",
                 "--out", out]) == 2
    assert main(["experiment", "mqar", "--model", "lstm-plain", "--protocol", "quick", "--lrs", "x",
                 "--out", out]) == 2


def test_cli_protocol_sweep_with_mqar(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["experiment", "sweep", "--tasks", "parity", "--models", "lstm-plain", "--protocol", "quick",
                 "--steps", "2", "--seeds", "0", "--lrs", "1e-3", "--widths", "16", "--setting", "zoology",
                 "--device", "cpu", "--out", str(out)]) == 0
    ids = sorted(p.stem for p in (out / "runs").glob("*.json"))
    assert ids == ["formal__parity__lstm-plain__d32__lr0.001__s0", "mqar__T64-N4__lstm-plain__d16__lr0.001__s0"]
    mq = json.loads((out / "runs" / f"{ids[1]}.json").read_text())
    assert mq["config"]["mqar_spacing"] == "powerlaw" and mq["config"]["mqar_train_mix"] is False
    text = (out / "report.md").read_text()
    assert "## MQAR T64-N4" in text and "| model | width | parity |" in text and "Produced by:" in text


def test_workers_per_gpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert pr.plan_devices("cuda") == ["cuda:0", "cuda:1", "cuda:2"]
    assert pr.worker_devices("cuda", 2) == ["cuda:0", "cuda:0", "cuda:1", "cuda:1", "cuda:2", "cuda:2"]
    assert pr.plan_devices("cuda:1") == ["cuda:1"] and pr.plan_devices("cpu") == ["cpu"]
    with pytest.raises(XLSTMKitError, match="jobs_per_device"):
        pr.run_plan([], "unused", jobs_per_device=0)


@pytest.mark.parametrize("kind", ["formal", "mqar"])
def test_a_paused_grid_point_continues_to_the_uninterrupted_result(tmp_path, monkeypatch, kind, single_thread):
    """--stop-after: a run stopped mid-way (checkpoint) and continued gives exactly the result of
    an uninterrupted run: same losses, same accuracy; the checkpoint is gone when it is done. One
    CPU thread throughout: the "auto" thread policy follows the machine's load, and two thread
    counts sum in different orders (the resumed run once differed in the 7th digit)."""
    import itertools

    from xlstm_kit.experiments import experiment as ex

    proto = pr.PROTOCOLS["quick"]
    plan = (pr.formal_plan(["parity"], ["xlstm[1:1]"], proto, lrs=[1e-2], seeds=[0]) if kind == "formal"
            else pr.mqar_plan(["xlstm[1:0]"], proto, "zoology", widths=[16], lrs=[1e-2], seeds=[0]))
    job = plan[0]
    whole = pr.run_job(job, tmp_path / "a", "cpu")
    assert "error" not in whole
    # the clock (read once by run_job, then once per step) says "past stop_at" from its 12th
    # reading on: the run saves and pauses after step 11
    ticks = itertools.count()
    monkeypatch.setattr(ex.time, "time", lambda: 100.0 + (next(ticks) >= 11) * 1e6)
    first = pr.run_job(job, tmp_path / "b", "cpu", stop_at=1e5)
    assert first["paused"] and "after step 11 of 30" in first["message"]
    assert f", loss {dict(whole['losses'])[10]:.4f};" in first["message"]  # the last logged (every 5 steps)
    assert (tmp_path / "b" / f"{job.id}.ckpt").exists() and not (tmp_path / "b" / f"{job.id}.json").exists()
    assert not pr.finished(job, tmp_path / "b")
    # the curve so far is in a small file of its own (the checkpoint may never come back)
    progress = json.loads((tmp_path / "b" / f"{job.id}.progress").read_text())
    assert progress["steps_done"] == 11 and progress["planned_steps"] == 30
    assert [tuple(x) for x in progress["losses"]] == [tuple(x) for x in whole["losses"] if x[0] <= 11]
    monkeypatch.undo()
    rest = pr.run_job(job, tmp_path / "b", "cpu")
    assert not (tmp_path / "b" / f"{job.id}.ckpt").exists() and pr.finished(job, tmp_path / "b")
    assert not (tmp_path / "b" / f"{job.id}.progress").exists()
    assert rest["losses"] == whole["losses"] and rest["steps_done"] == whole["steps_done"] == 30
    assert rest["scaled_accuracy"] == whole["scaled_accuracy"]


def test_grid_points_not_started_by_the_stop_time_wait(tmp_path):
    jobs = pr.formal_plan(["parity"], ["lstm-plain"], pr.PROTOCOLS["quick"])
    out = pr.run_plan(jobs, tmp_path, stop_after_s=-1.0)
    assert len(out) == len(jobs) and all(r["paused"] for r in out)
    assert not list((tmp_path / "runs").glob("*"))


def test_cli_stop_after_needs_the_protocol(tmp_path, capsys):
    args = ["experiment", "formal", "--task", "parity", "--model", "lstm", "--quick", "--stop-after", "10",
            "--out", str(tmp_path / "x")]
    assert main(args) == 2
    assert "--stop-after needs --protocol" in capsys.readouterr().err


def test_cli_protocol_one_mqar_shape(tmp_path, capsys):
    base = ["experiment", "mqar", "--model", "lstm-plain", "--protocol", "quick", "--steps", "2", "--seeds", "0",
            "--lrs", "1e-3", "--widths", "16", "--device", "cpu"]
    out = tmp_path / "one"
    assert main(base + ["--seq-len", "48", "--pairs", "6", "--out", str(out)]) == 0
    assert [p.stem for p in (out / "runs").glob("*.json")] == ["mqar__T48-N6__lstm-plain__d16__lr0.001__s0"]
    assert main(base + ["--pairs", "6", "--out", str(tmp_path / "x")]) == 2
    assert "--seq-len and --pairs go together" in capsys.readouterr().err


def test_cli_protocol_sweep_mqar_only(tmp_path):
    out = tmp_path / "mq"
    assert main(["experiment", "sweep", "--tasks", "none", "--models", "lstm-plain", "--protocol", "quick",
                 "--steps", "2", "--seeds", "0", "--lrs", "1e-3", "--widths", "16", "--device", "cpu",
                 "--out", str(out)]) == 0
    assert [p.stem for p in (out / "runs").glob("*.json")] == ["mqar__T64-N4__lstm-plain__d16__lr0.001__s0"]


def test_cli_protocol_sweep_mqar_options_reach_the_mqar_runs_only(tmp_path, capsys):
    # --mqar-steps / --mqar-time-limit were once dropped silently under --protocol
    out = tmp_path / "mix"
    assert main(["experiment", "sweep", "--tasks", "parity", "--models", "lstm-plain", "--protocol", "quick",
                 "--steps", "3", "--mqar-steps", "2", "--mqar-time-limit", "500", "--seeds", "0", "--lrs", "1e-3",
                 "--widths", "16", "--device", "cpu", "--out", str(out)]) == 0
    runs = {p.stem.split("__")[0]: json.loads(p.read_text()) for p in (out / "runs").glob("*.json")}
    assert runs["mqar"]["steps_done"] == 2 and runs["mqar"]["config"]["time_limit_s"] == 500
    assert runs["formal"]["steps_done"] == 3 and runs["formal"]["config"]["time_limit_s"] is None
    for extra in (["--mqar-lr", "1e-3"], ["--steps-for", "parity=5"]):
        assert main(["experiment", "sweep", "--protocol", "quick", "--out", str(tmp_path / "x"), *extra]) == 2
        assert f"{extra[0]} do not apply with --protocol" in capsys.readouterr().err


@pytest.mark.parametrize("fields, ended", [
    ({"converged_at": 900, "steps_done": 900, "planned_steps": 25000}, "converged"),
    ({"steps_done": 25000, "planned_steps": 25000}, "step budget"),
    ({"steps_done": 1619, "planned_steps": 1619}, "time limit"),
    ({"steps_done": 4519, "planned_steps": 4812}, "time limit, 293 steps short of the fitted schedule")])
def test_report_says_how_each_mqar_run_ended(tmp_path, fields, ended):
    r = {**_fake("mqar", "T2048-N48", "transformer", 128, 2.15e-3, 1, 0.0168),
         "config": {"steps": 25000, "mqar_pairs": 48}, "losses": [[1, 8.4], [25, 7.1]], **fields}
    text = pr.write_protocol_report([r], tmp_path)["report"].read_text()
    steps = f"{fields['steps_done']:,} / {fields['planned_steps']:,}"
    assert f"| T2048-N48 | transformer | 128 | 0.00215 | 1 | 0.017 | {steps} | {ended} | — |" in text


def test_plateau_end_is_the_first_step_below_ln_pairs(tmp_path):
    curve = [[1, 9.1], [100, 4.0], [125, 3.8], [150, 2.5], [175, 3.9]]
    assert pr.plateau_end(curve, 48) == 125  # ln 48 = 3.87
    assert pr.plateau_end(curve, 16) == 150  # ln 16 = 2.77
    assert pr.plateau_end(curve, 4) is None and pr.plateau_end([], 48) is None
    r = {**_fake("mqar", "T256-N16", "xlstm[1:1]", 128, 1e-2, 0, 1.0), "steps_done": 175, "planned_steps": 25000,
         "converged_at": 175, "config": {"steps": 25000, "mqar_pairs": 16}, "losses": curve}
    text = pr.write_protocol_report([r], tmp_path)["report"].read_text()
    assert "| T256-N16 | xlstm[1:1] | 128 | 0.01 | 0 | 1.000 | 175 / 25,000 | converged | 150 |" in text


def test_a_time_limited_mqar_grid_point_is_its_own(tmp_path):
    # a run cut by a time limit means another budget: it must not stand in for the step-budget run
    proto = pr.PROTOCOLS["quick"]
    plain, = pr.mqar_plan(["lstm-plain"], proto, "zoology", widths=[16], lrs=[1e-3], seeds=[0])
    timed, = pr.mqar_plan(["lstm-plain"], proto, "zoology", widths=[16], lrs=[1e-3], seeds=[0],
                          overrides={"time_limit_s": 1050.0})
    assert (plain.task, timed.task) == ("T64-N4", "T64-N4-t1050") and plain.id != timed.id
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / f"{timed.id}.json").write_text(json.dumps({"id": timed.id}))
    assert pr.finished(timed, runs) and not pr.finished(plain, runs)


def test_report_lists_unfinished_runs_from_their_progress_files(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    curve = {"steps_done": 16650, "planned_steps": 25000, "seconds": 1012.4, "losses": [[1, 9.1], [16650, 6.9465]]}
    (runs / "mqar__T2048-N48__transformer__d128__lr0.00215__s0.progress").write_text(json.dumps(curve))
    (runs / "done.progress").write_text(json.dumps(curve))  # a stale one next to its finished result
    (runs / "done.json").write_text(json.dumps({"id": "done"}))
    r = _fake("mqar", "T256-N16", "transformer", 128, 1e-3, 0, 1.0)
    text = pr.write_protocol_report([r], tmp_path)["report"].read_text()
    assert "| mqar__T2048-N48__transformer__d128__lr0.00215__s0 | 16,650 / 25,000 | 6.9465 | — | — | 1012 |" in text
    curve["losses"].append([16675, 3.1])  # below ln 48: the plateau's end, read from a paused run's curve too
    (runs / "mqar__T2048-N48__transformer__d128__lr0.00215__s0.progress").write_text(json.dumps(curve))
    text = pr.write_protocol_report([r], tmp_path)["report"].read_text()
    assert "| 16,650 / 25,000 | 3.1000 | — | 16,675 | 1012 |" in text
    assert "| done |" not in text


def test_a_paused_run_scored_as_it_stands(tmp_path, monkeypatch, capsys):
    """--score-paused: the paused run's model is evaluated as the checkpoint holds it (the same
    score as evaluating the checkpoint afresh), into its progress file, message and report."""
    import itertools

    from xlstm_kit.experiments import experiment as ex
    from xlstm_kit.io.checkpoint import load_weights_into, resolve_checkpoint

    job = pr.formal_plan(["parity"], ["lstm-plain"], pr.PROTOCOLS["quick"], lrs=[1e-2], seeds=[0])[0]
    ticks = itertools.count()
    monkeypatch.setattr(ex.time, "time", lambda: 100.0 + (next(ticks) >= 11) * 1e6)
    r = pr.run_job(job, tmp_path / "runs", "cpu", stop_at=1e5, score_paused=True)
    monkeypatch.undo()
    curve = json.loads((tmp_path / "runs" / f"{job.id}.progress").read_text())
    assert r["paused"] and f"scored {curve['at_pause']['scaled_accuracy']:.3f} as it stands" in r["message"]
    cfg = ex.RunConfig(**job.config)
    task = ex.get_task("parity", cfg.tasks)
    model = ex.build_model("lstm-plain", task.vocab_size, d_model=cfg.d_model, n_heads=cfg.n_heads,
                           n_blocks=cfg.n_blocks, slstm=cfg.slstm)
    load_weights_into(model, resolve_checkpoint(tmp_path / "runs" / f"{job.id}.ckpt"))
    again = ex.evaluate_formal(model, task, cfg.test_lengths, cfg.eval_samples, seed=cfg.seed + 1,
                               batch_size=cfg.eval_batch_size, precision=cfg.precision,
                               teacher_forcing=cfg.teacher_forcing)
    assert 0 < curve["at_pause"]["accuracy"] == again["accuracy"]
    report = pr.write_protocol_report([], tmp_path)["report"].read_text()
    assert f"| {job.id} | 11 / 30 | " in report and f"| {curve['at_pause']['scaled_accuracy']:.3f} |" in report
    args = ["experiment", "sweep", "--protocol", "quick", "--score-paused", "--out", str(tmp_path / "x")]
    assert main(args) == 2 and "--score-paused needs --stop-after" in capsys.readouterr().err


def test_cli_protocol_mqar_shapes(tmp_path, capsys):
    # several shapes of one sweep, each a grid point of its own (a run per shape)
    base = ["experiment", "sweep", "--tasks", "none", "--models", "lstm-plain", "--protocol", "quick", "--steps", "2",
            "--seeds", "0", "--lrs", "1e-3", "--widths", "16", "--device", "cpu"]
    out = tmp_path / "two"
    assert main(base + ["--shapes", "48x6, 64X4", "--out", str(out)]) == 0
    assert sorted(p.stem for p in (out / "runs").glob("*.json")) == [
        "mqar__T48-N6__lstm-plain__d16__lr0.001__s0", "mqar__T64-N4__lstm-plain__d16__lr0.001__s0"]
    runs = {json.loads(p.read_text())["task"]: json.loads(p.read_text())["config"] for p in (out / "runs").glob("*.json")}
    assert (runs["T48-N6"]["mqar_seq_len"], runs["T48-N6"]["mqar_pairs"]) == (48, 6)
    for bad, said in ((["--shapes", "48x6", "--seq-len", "48", "--pairs", "6"], "give one of them"),
                      (["--shapes", "48-6"], "sequence length x pairs"), (["--shapes", "0x6"], "sequence length x pairs"),
                      (["--shapes", ","], "at least one shape")):
        assert main(base + bad + ["--out", str(tmp_path / "x")]) == 2
        assert said in capsys.readouterr().err
    assert main(["experiment", "mqar", "--model", "lstm", "--quick", "--shapes", "48x6", "--device", "cpu",
                 "--out", str(tmp_path / "y")]) == 2
    assert "--shapes needs --protocol" in capsys.readouterr().err


def test_cli_protocol_mqar_heads(tmp_path, capsys):
    # another head count is another experiment: its own task label, the heads reaching the model
    jobs = pr.mqar_plan(["transformer"], pr.PROTOCOLS["paper"], "zoology", shapes=[(256, 48)], widths=[128],
                        lrs=[2.15e-3], seeds=[0], overrides={"n_heads": 1, "time_limit_s": 60})
    assert [(j.task, j.config["n_heads"]) for j in jobs] == [("T256-N48-t60-h1", 1)]
    default = pr.mqar_plan(["transformer"], pr.PROTOCOLS["paper"], "zoology", shapes=[(256, 48)], widths=[128],
                           lrs=[2.15e-3], seeds=[0], overrides={"n_heads": pr.DEFAULT_HEADS})
    assert [j.task for j in default] == ["T256-N48"]
    base = ["experiment", "sweep", "--models", "transformer", "--protocol", "quick", "--steps", "2", "--seeds", "0",
            "--lrs", "1e-3", "--widths", "16", "--shapes", "48x6", "--heads", "2", "--device", "cpu"]
    out = tmp_path / "h2"
    assert main(base + ["--tasks", "none", "--out", str(out)]) == 0
    (run,) = (out / "runs").glob("*.json")
    assert run.stem == "mqar__T48-N6-h2__transformer__d16__lr0.001__s0"
    assert json.loads(run.read_text())["config"]["n_heads"] == 2
    assert main(base + ["--tasks", "parity", "--out", str(tmp_path / "x")]) == 2
    assert "--heads with --protocol applies to MQAR runs only" in capsys.readouterr().err
    assert main(["experiment", "mqar", "--model", "transformer", "--quick", "--heads", "2", "--device", "cpu",
                 "--out", str(tmp_path / "y")]) == 0
    (one,) = (tmp_path / "y" / "runs").glob("*.json")
    assert json.loads(one.read_text())["config"]["n_heads"] == 2


def _one_line(call, needle):
    with pytest.raises(XLSTMKitError) as e:
        call()
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.timeout(60)  # the failure a FIFO would cause is a hang
@pytest.mark.parametrize("kind", HOSTILE_FILES)
def test_hostile_results_and_progress_files(tmp_path, kind, capsys):
    """A FIFO or an oversized file is none that a run writes: a one-line error at once, from the
    resume check, the report and --report-only. JSON nested too deeply is damaged content, like
    a file cut short: the grid point is not finished and the report leaves it out."""
    job = pr.formal_plan(["parity"], ["lstm"], pr.PROTOCOLS["quick"])[0]
    runs = tmp_path / "runs"
    runs.mkdir()
    result = runs / f"{job.id}.json"
    make_hostile(result, kind, MAX_RUN_FILE_BYTES)
    report_only = ["experiment", "sweep", "--protocol", "quick", "--report-only", "--out", str(tmp_path)]
    if kind == "nested":
        assert not pr.finished(job, runs) and pr.load_protocol_results(runs) == []
    else:
        _one_line(lambda: pr.finished(job, runs), HOSTILE_MESSAGES[kind])
        _one_line(lambda: pr.load_protocol_results(runs), HOSTILE_MESSAGES[kind])
        _one_line(lambda: pr.run_plan([job], tmp_path), HOSTILE_MESSAGES[kind])  # before any run starts
        capsys.readouterr()
        assert main(report_only) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and HOSTILE_MESSAGES[kind] in err, err
    result.unlink()
    progress = runs / f"{job.id}.progress"
    make_hostile(progress, kind, MAX_RUN_FILE_BYTES)
    done = _fake("formal", "parity", "lstm", 32, 1e-3, 0, 1.0)
    if kind == "nested":
        assert pr._unfinished(runs) == []
    else:
        _one_line(lambda: pr._unfinished(runs), HOSTILE_MESSAGES[kind])
        _one_line(lambda: pr.write_protocol_report([done], tmp_path), HOSTILE_MESSAGES[kind])


def test_a_progress_file_with_missing_or_mistyped_fields_is_left_out_of_the_report(tmp_path):
    good = {"steps_done": 10, "planned_steps": 20, "seconds": 3.0, "losses": [[5, 2.0]]}
    for name, curve in {"a": {}, "b": {**good, "losses": [[5]]}, "c": {**good, "steps_done": "ten"},
                        "d": {**good, "losses": 3}, "ok": good}.items():
        (tmp_path / f"{name}.progress").write_text(json.dumps(curve))
    rows = [r for r in pr._unfinished(tmp_path) if r.startswith("| ") and "---" not in r and "| run |" not in r]
    assert [r.split(" | ")[0] for r in rows] == ["| ok"]
