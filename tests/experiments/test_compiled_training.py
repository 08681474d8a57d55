"""RunConfig.compile: the experiments' training step compiled (xlstm_kit.training.compiling.CompiledLoss).

On this CPU the compiled runs use backend="aot_eager" (Dynamo and AOTAutograd build the graphs
Inductor would get and run them eagerly; Inductor's C++ builds take minutes on 2 cores): the
tests check what compiling changes around the maths — one graph of forward and loss, the
training loop, checkpoints, the fallback — not Inductor's kernels."""
import json
import time

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import xlstm_kit.training.compiling as compiling
from xlstm_kit.cli import main
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit.experiments import experiment as ex
from xlstm_kit.experiments import protocol as pr
from xlstm_kit.experiments import task_loop
from xlstm_kit.experiments.config import RunConfig, quick_config
from xlstm_kit.experiments.experiment import run_formal
from xlstm_kit.experiments.registry import get_task
from xlstm_kit.io.checkpoint import load_weights_into, resolve_checkpoint


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setitem(compiling.TRAINING_COMPILE_TRIES, "cpu", ({"backend": "aot_eager"},))
    yield
    torch._dynamo.reset()


def tiny(**kw):
    # the paper's task format at its smallest: parity inputs of 2-3 symbols, width 16
    base = dict(steps=6, d_model=16, n_heads=2, batch_size=4, tasks="paper", teacher_forcing=False, slstm="paper",
                train_lengths=(2, 3), test_lengths=(4,), eval_samples=2, log_every=1, warmup_steps=2)
    return quick_config(**{**base, **kw})


def losses(r):
    return [loss for _, loss in r["losses"]]


@pytest.mark.parametrize("model,precision", [("xlstm[1:1]", "fp32"), ("dplr", "fp32"), ("transformer", "fp32"),
                                             ("transformer", "bf16")])
def test_compiled_training_equals_eager(model, precision, single_thread):
    eager = run_formal("parity", model, tiny(precision=precision))
    assert "compiled" not in eager and not counters["stats"]
    compiled = run_formal("parity", model, tiny(precision=precision, compile=True))
    assert compiled["compiled"]["options"] == "aot_eager" and compiled["compiled"]["fallbacks"] == []
    assert compiled["compiled"]["compile_s"] > 0 and compiled["config"]["compile"] is True
    # one graph: forward and loss together, no break (the token check reads nothing back)
    assert counters["stats"]["unique_graphs"] == 1 or model != "transformer"  # (the CPU sLSTM loop breaks)
    rel = 1e-4 if precision == "fp32" else 2e-2
    assert losses(compiled) == pytest.approx(losses(eager), rel=rel)
    assert len(losses(eager)) == 6 and losses(eager)[-1] < losses(eager)[0]  # it trained


def test_checkpoint_resume_with_compile_equals_the_uninterrupted_run(tmp_path, monkeypatch, single_thread):
    """A compiled run paused after step 4 (checkpoint) and continued gives the uninterrupted
    compiled run's losses and accuracy; the checkpoint holds the plain model's keys."""
    cfg = tiny(steps=8, compile=True)
    whole = run_formal("parity", "transformer", cfg)
    pause, ckpt = {"now": False}, tmp_path / "run.ckpt"
    real_time = time.time
    monkeypatch.setattr(ex.time, "time", lambda: 1e12 if pause["now"] else real_time())

    def progress(step, planned, loss):
        pause["now"] = step >= 4  # the clock passes stop_at from step 4 on

    with pytest.raises(ex.RunPaused, match="after step 4 of 8"):
        run_formal("parity", "transformer", cfg, checkpoint=ckpt, stop_at=1e11, progress=progress)
    plain = ex.build_model("transformer", get_task("parity", "paper").vocab_size, d_model=16, n_heads=2)
    load_weights_into(plain, resolve_checkpoint(ckpt))  # strict: no "_orig_mod." prefixes
    pause["now"] = False
    rest = run_formal("parity", "transformer", cfg, checkpoint=ckpt)
    assert rest["steps_done"] == whole["steps_done"] == 8 and rest["compiled"]["options"] == "aot_eager"
    assert losses(rest) == pytest.approx(losses(whole), rel=1e-6)
    assert rest["scaled_accuracy"] == whole["scaled_accuracy"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run with -m gpu on the GPU machine)")
def test_a_paused_cuda_run_continues(tmp_path, monkeypatch):
    """The CUDA form of the resume: earlier MQAR runs on CUDA could not continue ("RNG state must be
    a torch.ByteTensor": the checkpoint was loaded onto the GPU, the torch RNG state with it)."""
    cfg = tiny(steps=8, device="cuda")
    whole = run_formal("parity", "lstm-plain", cfg)
    pause, ckpt = {"now": False}, tmp_path / "run.ckpt"
    real_time = time.time
    monkeypatch.setattr(ex.time, "time", lambda: 1e12 if pause["now"] else real_time())

    def progress(step, planned, loss):
        pause["now"] = step >= 4

    with pytest.raises(ex.RunPaused, match="after step 4 of 8"):
        run_formal("parity", "lstm-plain", cfg, checkpoint=ckpt, stop_at=1e11, progress=progress)
    pause["now"] = False
    rest = run_formal("parity", "lstm-plain", cfg, checkpoint=ckpt)
    assert rest["steps_done"] == 8
    assert losses(rest) == pytest.approx(losses(whole), rel=1e-4)


def test_the_compile_field():
    assert RunConfig().compile is False and not RunConfig().compiles
    assert RunConfig(compile=True).compiles
    assert not RunConfig(compile="auto").compiles and RunConfig(compile="auto", device="cuda").compiles
    assert RunConfig(**RunConfig(compile="auto").to_dict()).compile == "auto"
    for bad in ("yes", 1, None, "AUTO"):
        with pytest.raises(XLSTMKitError, match="RunConfig.compile must be True, False or 'auto'"):
            RunConfig(compile=bad)
    # the paper protocol compiles its CUDA runs only; the CPU smoke protocol never
    for job in pr.formal_plan(["parity"], ["lstm"], pr.PROTOCOLS["paper"]) + \
            pr.mqar_plan(["lstm"], pr.PROTOCOLS["paper"], "zoology"):
        assert job.config["compile"] == "auto"
        assert RunConfig(**{**job.config, "device": "cuda:0"}).compiles
        assert not RunConfig(**{**job.config, "device": "cpu"}).compiles
    assert "compile" not in pr.PROTOCOLS["quick"].formal
    off = pr.formal_plan(["parity"], ["lstm"], pr.PROTOCOLS["paper"], overrides={"compile": False})
    assert not RunConfig(**{**off[0].config, "device": "cuda"}).compiles


def test_a_failing_compile_falls_back_then_errors_clearly(monkeypatch, single_thread):
    def broken(gm, example_inputs):
        raise RuntimeError("backend exploded")

    monkeypatch.setitem(compiling.TRAINING_COMPILE_TRIES, "cpu", ({"backend": broken}, {"backend": "aot_eager"}))
    r = run_formal("parity", "lstm-plain", tiny(steps=3, compile=True))
    assert r["compiled"]["options"] == "aot_eager" and r["steps_done"] == 3
    assert len(r["compiled"]["fallbacks"]) == 1 and "backend exploded" in r["compiled"]["fallbacks"][0]
    assert losses(r) == pytest.approx(losses(run_formal("parity", "lstm-plain", tiny(steps=3))), rel=1e-5)

    monkeypatch.setitem(compiling.TRAINING_COMPILE_TRIES, "cpu", ({"backend": broken},))
    with pytest.raises(XLSTMKitError, match=r"torch.compile failed \(broken: .*backend exploded.*--no-compile"):
        run_formal("parity", "lstm-plain", tiny(steps=3, compile=True))


def test_compile_time_is_not_step_time(monkeypatch, single_thread):
    """The time budget times steps 6..20: a compilation of 3 s in the first step counts against
    the budget (it is spent) but not as time per step."""
    def slow(gm, example_inputs):
        time.sleep(3.0)
        return gm.forward

    monkeypatch.setitem(compiling.TRAINING_COMPILE_TRIES, "cpu", ({"backend": slow},))
    per_step = []

    class Budget(task_loop.TimeBudget):
        def steps_that_fit(self, done, **kw):
            per_step.append(self.seconds_per_step())
            return super().steps_that_fit(done, **kw)

    monkeypatch.setattr(task_loop, "TimeBudget", Budget)
    r = run_formal("parity", "transformer", tiny(steps=25, compile=True, time_limit_s=60.0))
    assert r["steps_done"] == 25 and r["compiled"]["compile_s"] >= 2.5
    assert per_step and per_step[0] < 0.1  # a step of this model takes milliseconds


def test_cli_compile_flag(tmp_path, capsys):
    out = str(tmp_path)
    assert main(["experiment", "formal", "--task", "parity", "--model", "lstm-plain", "--quick", "--steps", "2",
                 "--compile", "--device", "cpu", "--out", out]) == 0
    r = json.loads((tmp_path / "runs" / "formal__parity__lstm-plain.json").read_text())
    assert r["config"]["compile"] is True and r["compiled"]["options"] == "aot_eager"
    captured = capsys.readouterr()
    assert "up to 2 steps on cpu, compiled" in captured.err and "of it compiling" in captured.out
    assert main(["experiment", "formal", "--task", "parity", "--model", "lstm-plain", "--quick", "--steps", "2",
                 "--no-compile", "--device", "cpu", "--out", out]) == 0
    r = json.loads((tmp_path / "runs" / "formal__parity__lstm-plain.json").read_text())
    assert r["config"]["compile"] is False and "compiled" not in r


def test_static_masked_loss_is_the_masked_mean():
    logits = torch.randn(3, 5, 7)
    batch = ex.TaskBatch(torch.zeros(3, 5, dtype=torch.long), torch.randint(0, 7, (3, 5)),
                         torch.rand(3, 5) < 0.4, torch.zeros(3, dtype=torch.long))
    batch.mask[0, 0] = True
    torch.testing.assert_close(task_loop.masked_loss_static(logits, batch), task_loop.masked_loss(logits, batch))


def test_cudagraph_skips_are_collected_while_the_run_lasts():
    # Inductor runs a graph without CUDA graphs when it cannot record it, and only logs why
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    c = compiling.CompiledLoss(torch.nn.Linear(2, 2), lambda out, target: out.sum(), "cpu")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a test")
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to a test")
    assert c.summary() == {"options": "aot_eager", "fallbacks": [],
                           "cudagraph_skips": ["skipping cudagraphs due to a test"]}
    c.close()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to another test")
    assert c.cudagraph_skips == ["skipping cudagraphs due to a test"]


def test_protocol_workers_share_the_cores_for_compiling_too():
    import queue

    import torch._inductor.config as inductor_config

    q = queue.Queue()
    q.put("cuda:3")
    threads, compile_threads = torch.get_num_threads(), inductor_config.compile_threads
    try:
        pr._claim_device(q, 1)
        assert pr._DEVICE == "cuda:3" and torch.get_num_threads() == 1 and inductor_config.compile_threads == 1
    finally:
        torch.set_num_threads(threads)
        inductor_config.compile_threads = compile_threads
        pr._DEVICE = None
