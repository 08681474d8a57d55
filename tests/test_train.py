"""The training loop (xlstm_kit.training): schedule, weight-decay groups, evaluation, exact resume,
interrupts and atomic checkpoints. A small XLSTMLanguageModel keeps every run to a few steps."""
import dataclasses
import json
import math
import os
import signal

import numpy as np
import pytest
import torch

from xlstm_kit import training as T
from xlstm_kit.training.data import load_data
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

TEXT = (
    "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east, and Juliet is the sun.\n\n"
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and refuse thy name.\n\n"
) * 40


def small_model(seed=0):
    torch.manual_seed(seed)
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                          context_length=16, chunk_size=8))


def small_config(**kw):
    base = dict(steps=6, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_interval=3,
                eval_batches=2, checkpoint_interval=3, seed=1)
    return T.TrainConfig(**{**base, **kw})


@pytest.fixture
def data(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    f = tmp_path / "corpus.txt"
    f.write_text(TEXT)
    return load_data(str(f), "byte")


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------


def test_schedule_values():
    cfg = T.TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [T.lr_at(s, cfg) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert T.lr_at(9, cfg) == pytest.approx(1.0)  # warmup ends at the peak
    assert T.lr_at(10, cfg) == pytest.approx(1.0)
    assert T.lr_at(60, cfg) == pytest.approx(0.55)  # half way down the cosine: (1 + 0.1) / 2
    assert T.lr_at(35, cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert T.lr_at(110, cfg) == pytest.approx(0.1) and T.lr_at(500, cfg) == pytest.approx(0.1)
    after = [T.lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert T.lr_at(0, T.TrainConfig(warmup_steps=0, lr=0.5, min_lr=0.0, steps=10)) == pytest.approx(0.5)


def test_config_validation_of_numbers():
    for kw, needle in ((dict(lr=1e308), r"lr must be in \(0, 100\]"), (dict(lr=1e-3, min_lr=1e-2), r"min_lr must be in \[0, lr\]"), (dict(lr=float("inf")), "finite"),
                       (dict(eps=float("nan")), "finite"), (dict(betas=(0.9, 1.5)), "betas"),
                       (dict(weight_decay=True), "finite number")):
        with pytest.raises(ValueError, match=needle):
            small_config(**kw)
    with pytest.raises(ValueError, match="no field bogus"):
        T.TrainConfig.from_dict({**small_config().to_dict(), "bogus": 1})


def test_config_validation():
    with pytest.raises(ValueError, match="steps"):
        T.TrainConfig(steps=0)
    with pytest.raises(ValueError, match="divisible"):
        T.TrainConfig(batch_size=6, grad_accum=4)
    with pytest.raises(ValueError, match="precision"):
        T.TrainConfig(precision="fp8")
    cfg = small_config(betas=(0.8, 0.9))
    assert T.TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_weight_decay_groups():
    model = small_model()
    model.lm_head.weight = model.embedding.weight  # a tied head must not be decayed either
    groups = T.param_groups(model, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    no_decay = {id(p) for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert not decay & no_decay
    assert decay | no_decay == {id(p) for p in model.parameters()}  # every parameter exactly once
    names = {id(p): n for n, p in model.named_parameters()}
    for module_name, module in model.named_modules():
        for n, p in module.named_parameters(recurse=False):
            if isinstance(module, (torch.nn.Embedding, torch.nn.LayerNorm)) or p.ndim < 2:
                assert id(p) in no_decay, f"{module_name}.{n} must not be decayed"
    assert id(model.embedding.weight) in no_decay
    decayed = [names[i] for i in decay]
    assert decayed and all(model.get_parameter(n).ndim >= 2 for n in decayed)


def test_evaluate_matches_manual_cross_entropy(data):
    model = small_model()
    tb = data.tokenizer.token_byte_lengths()
    m = T.evaluate(model, data.val, seq_len=16, batch_size=4, max_batches=2, token_bytes=tb)
    # 2 batches of 4 consecutive, non-overlapping windows from the start of the split.
    x = torch.from_numpy(np.stack([np.asarray(data.val[i * 16:(i + 1) * 16], dtype=np.int64) for i in range(8)]))
    y = torch.from_numpy(np.stack([np.asarray(data.val[i * 16 + 1:(i + 1) * 16 + 1], dtype=np.int64) for i in range(8)]))
    with torch.no_grad():
        ref = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert m.tokens == 128
    assert m.loss == pytest.approx(ref, rel=1e-5)
    assert m.bits_per_byte == pytest.approx(ref / math.log(2), rel=1e-5)  # one byte per token
    assert m.perplexity == pytest.approx(math.exp(ref), rel=1e-5)
    assert model.training  # restored


def test_training_lowers_loss_and_writes_outputs(data, tmp_path):
    events = []
    model = small_model()
    out = tmp_path / "run"
    res = T.train(model, data, small_config(steps=12, eval_interval=6, checkpoint_interval=4, keep_checkpoints=2),
                  out, callback=events.append, device="cpu")
    assert not res.interrupted and res.step == 12
    assert [s for s, _ in res.evals] == [0, 6, 12]
    assert res.evals[-1][1].loss < res.evals[0][1].loss - 0.3
    steps = [e for e in events if isinstance(e, T.StepEvent)]
    assert [e.step for e in steps] == list(range(1, 13))
    assert all(e.tokens_per_s > 0 and math.isfinite(e.loss) for e in steps)
    assert [e.lr for e in steps] == pytest.approx([T.lr_at(s, small_config(steps=12)) for s in range(12)])
    # Checkpoints every 4 steps, the two newest kept, `latest` naming the last.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000008", "step-00000012"]
    assert (out / "latest").read_text().strip() == "checkpoints/step-00000012"
    assert res.checkpoint == out / "checkpoints" / "step-00000012"
    loaded = XLSTMLanguageModel.load(T.resolve_checkpoint(out))
    assert loaded.tokenizer_name == "byte"  # from the data's tokenizer: generate(text) works after load
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    meta = T.read_train_meta(res.checkpoint)
    assert meta["step"] == 12 and meta["train_config"]["seq_len"] == 16
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 13))
    assert res.plot == out / "loss.png" and res.plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grad_accumulation_matches_full_batch(data):
    # eps=1e-6: the sLSTM input-gate bias has a mathematically zero gradient (c/n does not
    # depend on it), so its gradient is rounding noise that Adam with eps=1e-8 would blow up to
    # updates of ~lr; with 1e-6 the comparison measures the accumulation, not that noise.
    cfg = dict(steps=3, lr=3e-3, eps=1e-6, eval_at_start=False, eval_interval=0)
    a, b = small_model(), small_model()
    T.train(a, data, small_config(**cfg), device="cpu")
    T.train(b, data, small_config(grad_accum=2, **cfg), device="cpu")
    moved = 0.0
    for (k, x), y, x0 in zip(a.state_dict().items(), b.state_dict().values(), small_model().state_dict().values()):
        torch.testing.assert_close(y, x, rtol=0, atol=1e-5, msg=k)
        moved = max(moved, (x - x0).abs().max().item())
    assert moved > 5e-3  # the runs did train


def _stop_at(step, how):
    def callback(event):
        if isinstance(event, T.StepEvent) and event.step == step:
            if how == "keyboard":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)
    return callback


@pytest.mark.parametrize("how,stop_step", [("keyboard", 3), ("sigterm", 3)])
def test_interrupt_then_resume_is_exact(data, tmp_path, how, stop_step, single_thread):
    # one thread: the "auto" thread policy follows the machine's load, and two thread counts sum
    # in different orders
    cfg = small_config(steps=6, checkpoint_interval=0)
    full_model = small_model()
    full = T.train(full_model, data, cfg, tmp_path / "full", device="cpu")

    cut = T.train(small_model(), data, cfg, tmp_path / "cut", device="cpu",
                  callback=_stop_at(2 if how == "sigterm" else stop_step, how))
    # KeyboardInterrupt stops at once; SIGTERM sets a flag honoured after the next step.
    assert cut.interrupted and cut.step == stop_step
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored
    assert T.read_train_meta(T.resolve_checkpoint(tmp_path / "cut"))["step"] == stop_step

    resumed_model = small_model(seed=123)  # different init: everything must come from the checkpoint
    resumed = T.train(resumed_model, data, cfg, tmp_path / "cut", resume=True, device="cpu")
    assert resumed.step == 6 and not resumed.interrupted
    expected = dict(full.losses)
    assert [s for s, _ in resumed.losses] == list(range(stop_step + 1, 7))
    for s, loss in resumed.losses:
        assert loss == expected[s], f"step {s}: resumed {loss} != uninterrupted {expected[s]}"
    for (k, x), y in zip(full_model.state_dict().items(), resumed_model.state_dict().values()):
        assert torch.equal(x, y), k
    assert resumed.evals[-1][1].loss == full.evals[-1][1].loss
    # The metrics log continues without duplicates.
    rows = [json.loads(l) for l in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))


@pytest.mark.parametrize("change", [dict(grad_accum=2), dict(pack=False), dict(seed=2)])
def test_resume_keeps_the_frozen_settings(data, tmp_path, change):
    """One rule for the library and the command line (RESUME_FROZEN): a resumed run reads the
    same tokens per step and sums its gradient the same way, or it is refused."""
    assert set(change) <= set(T.RESUME_FROZEN)
    T.train(small_model(), data, small_config(steps=2), tmp_path / "r", device="cpu")
    with pytest.raises(T.CheckpointError, match=f"cannot resume with {next(iter(change))}="):
        T.train(small_model(), data, small_config(steps=4, **change), tmp_path / "r", resume=True, device="cpu")


def test_resume_refuses_changed_batch(data, tmp_path):
    T.train(small_model(), data, small_config(steps=2), tmp_path / "r", device="cpu")
    with pytest.raises(T.CheckpointError, match="batch_size"):
        T.train(small_model(), data, small_config(steps=4, batch_size=8), tmp_path / "r", resume=True, device="cpu")
    with pytest.raises(T.CheckpointError, match="no checkpoint|does not exist"):
        T.train(small_model(), data, small_config(), tmp_path / "nothing", resume=True, device="cpu")


@pytest.mark.parametrize("where", ["model", "state"])
def test_crash_mid_save_keeps_previous_latest(data, tmp_path, monkeypatch, where):
    out = tmp_path / "run"
    model = small_model()
    T.train(model, data, small_config(steps=3, checkpoint_interval=3), out, device="cpu")
    before = T.resolve_checkpoint(out)
    assert before.name == "step-00000003"
    saved_weights = params(XLSTMLanguageModel.load(before))

    import safetensors.torch

    real_save_file, real_torch_save = safetensors.torch.save_file, torch.save

    def half_then_crash(obj, path, *a, **k):
        with open(path, "wb") as f:
            f.write(b"\x00" * 17)  # a torn, partial file
        raise OSError("simulated crash: disk full")

    if where == "model":
        monkeypatch.setattr(safetensors.torch, "save_file", half_then_crash)
    else:
        monkeypatch.setattr(torch, "save", half_then_crash)
    with pytest.raises(OSError, match="simulated crash"):
        T.train(model, data, small_config(steps=6, checkpoint_interval=3), out, resume=True, device="cpu")
    monkeypatch.setattr(safetensors.torch, "save_file", real_save_file)
    monkeypatch.setattr(torch, "save", real_torch_save)

    # `latest` still names the complete step-3 checkpoint, which still loads and resumes.
    assert T.resolve_checkpoint(out) == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if not p.name.startswith(".")) == ["step-00000003"]
    for k, v in params(XLSTMLanguageModel.load(before)).items():
        assert torch.equal(v, saved_weights[k])
    res = T.train(small_model(), data, small_config(steps=6, checkpoint_interval=3), out, resume=True, device="cpu")
    assert res.step == 6 and T.resolve_checkpoint(out).name == "step-00000006"
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]  # staging cleaned


def test_foreign_checkpoint_format_refused(data, tmp_path):
    out = tmp_path / "run"
    T.train(small_model(), data, small_config(steps=2), out, device="cpu")
    meta_file = T.resolve_checkpoint(out) / T.TRAIN_META_FILE
    meta = json.loads(meta_file.read_text())
    meta["format"] = 999
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(T.CheckpointError, match="format 999"):
        T.train(small_model(), data, small_config(steps=4), out, resume=True, device="cpu")


def test_time_limit_stops_with_checkpoint_and_validation(data, tmp_path):
    res = T.train(small_model(), data, small_config(steps=50, eval_interval=0, checkpoint_interval=0),
                  tmp_path / "run", time_limit_s=0.0, device="cpu")
    assert res.time_limited and not res.interrupted and res.step == 1
    assert [s for s, _ in res.evals] == [0, 1]
    assert T.resolve_checkpoint(tmp_path / "run").name == "step-00000001"
    # The run can go on from there.
    more = T.train(small_model(), data, small_config(steps=50, eval_interval=0, checkpoint_interval=0),
                   tmp_path / "run", time_limit_s=0.0, resume=True, device="cpu")
    assert more.step == 2 and more.time_limited


def test_bf16_autocast_training_runs(data):
    # precision="bf16" is what GPUs use by default ("auto"); on CPU it runs the same autocast
    # through the torch backends of every op, which must accept the bf16 activations autocast
    # hands them.
    fp32, bf16 = small_model(), small_model()
    a = T.train(fp32, data, small_config(steps=3, eval_interval=0, eval_at_start=False), device="cpu")
    b = T.train(bf16, data, small_config(steps=3, eval_interval=0, eval_at_start=False, precision="bf16"),
                device="cpu")
    assert all(math.isfinite(l) for _, l in b.losses)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())  # weights stay float32
    for (_, la), (_, lb) in zip(a.losses, b.losses):
        assert lb == pytest.approx(la, rel=0.05)
    assert b.evals[-1][1].loss == pytest.approx(a.evals[-1][1].loss, rel=0.05)


# ------------------------------------------------------------------------------------------
# The step function, the time budget, the schedule on resume, the plot without matplotlib


class _TinyLM(torch.nn.Module):
    def __init__(self, vocab=11, width=8):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.proj = torch.nn.Linear(width, vocab)

    def forward(self, x):
        return self.proj(torch.tanh(self.emb(x)))


@pytest.mark.parametrize("n_micro,clip", [(1, 0.0), (2, 0.05)])
def test_train_step_is_forward_backward_clip_update(n_micro, clip):
    torch.manual_seed(0)
    model, ref = _TinyLM(), _TinyLM()
    ref.load_state_dict(model.state_dict())
    x, y = torch.randint(0, 11, (4, 5)), torch.randint(0, 11, (4, 5))
    cfg = T.TrainConfig(weight_decay=0.1, eps=1e-6)
    opt, ref_opt = T.make_optimizer(model, cfg), T.make_optimizer(ref, cfg)
    parts = list(zip(x.chunk(n_micro), y.chunk(n_micro)))
    out = T.train_step(model, opt, parts, T.lm_loss, lr=0.03, n_micro=n_micro, precision="fp32", grad_clip=clip)
    # by hand: the mean loss over the whole batch, its gradient, the norm, clipping, AdamW
    loss = T.lm_loss(ref(x), y)
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    if clip:
        assert norm > clip  # the test exercises clipping
        for p in ref.parameters():
            p.grad.mul_(clip / (norm + 1e-6))
    for g in ref_opt.param_groups:
        g["lr"] = 0.03
    ref_opt.step()
    assert float(out.loss) == pytest.approx(loss.item(), rel=1e-5)
    assert float(out.grad_norm) == pytest.approx(float(norm), rel=1e-4)
    assert all(g["lr"] == 0.03 for g in opt.param_groups)
    assert all(p.grad is None for p in model.parameters())  # cleared for the next step
    for (k, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=k)
    with pytest.raises(ValueError, match="micro-batches"):
        T.train_step(model, opt, parts[:1], T.lm_loss, lr=0.1, n_micro=2)


def test_train_step_autocast_bf16_on_cpu():
    seen = []
    model = _TinyLM()
    model.proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    opt = T.make_optimizer(model, T.TrainConfig())
    batch = [(torch.randint(0, 11, (2, 3)), torch.randint(0, 11, (2, 3)))]
    T.train_step(model, opt, batch, T.lm_loss, lr=0.01, precision="bf16")
    T.train_step(model, opt, batch, T.lm_loss, lr=0.01, precision="fp32")
    assert seen == [torch.bfloat16, torch.float32]


def test_time_budget_measures_and_fits_steps():
    now = [100.0]
    b = T.TimeBudget(10.0, skip_steps=2, clock=lambda: now[0])
    assert b.seconds_per_step() is None and b.steps_that_fit(0) is None and not b.spent()
    for step, t in [(1, 103.0), (2, 103.5), (3, 104.0), (4, 104.5)]:  # step 1 carries a 3 s start-up
        now[0] = t
        b.step_done(step)
    assert b.seconds_per_step() == pytest.approx(0.5)  # steps 3 and 4 only
    assert b.remaining() == pytest.approx(5.5)
    assert b.steps_that_fit(4) == 4 + 11 and b.steps_that_fit(4, reserve=0.1) == 4 + 9
    assert b.steps_that_fit(4, most=7) == 7
    now[0] = 110.0
    assert b.spent() and b.steps_that_fit(4) == 4
    assert not T.TimeBudget(None).spent() and T.TimeBudget(None).remaining() == math.inf


def test_schedule_continues_smoothly_when_steps_grow():
    saved = T.TrainConfig(steps=30, lr=3e-3, min_lr=3e-4, warmup_steps=6)
    for at in (6, 18, 29):  # resumed mid-decay: the learning rate goes on from where it was
        longer = T.continue_schedule(saved, dataclasses.replace(saved, steps=60), at)
        lrs = [T.lr_at(s, saved) for s in range(at)] + [T.lr_at(s, longer) for s in range(at, 60)]
        steps = [abs(a - b) for a, b in zip(lrs, lrs[1:])]
        assert T.lr_at(at, longer) == pytest.approx(T.lr_at(at, saved))
        assert max(steps) <= max(abs(a - b) for a, b in zip(lrs[:at], lrs[1:at])) + 1e-12
        assert all(a >= b for a, b in zip(lrs[6:], lrs[7:]))
        assert lrs[-1] == pytest.approx(3e-4, rel=1e-2)
    done = T.continue_schedule(saved, dataclasses.replace(saved, steps=60), 30)  # a finished run stays at min_lr
    assert [T.lr_at(s, done) for s in (30, 45, 59)] == pytest.approx([3e-4] * 3)
    early = T.continue_schedule(saved, dataclasses.replace(saved, steps=60), 3)  # in warmup: a fresh run
    assert [T.lr_at(s, early) for s in range(60)] == [T.lr_at(s, dataclasses.replace(saved, steps=60)) for s in range(60)]
    # chained resumes keep it continuous, and the anchor survives the checkpoint's JSON
    twice = T.continue_schedule(longer, dataclasses.replace(longer, steps=90), 45)
    assert T.lr_at(45, twice) == pytest.approx(T.lr_at(45, longer))
    assert T.TrainConfig.from_dict(json.loads(json.dumps(twice.to_dict()))) == twice


def test_resume_with_more_steps_continues_the_learning_rate(data, tmp_path):
    cfg = small_config(steps=6, eval_interval=0, checkpoint_interval=0, eval_at_start=False)
    T.train(small_model(), data, cfg, tmp_path / "r", device="cpu", callback=_stop_at(3, "keyboard"))
    T.train(small_model(), data, dataclasses.replace(cfg, steps=9), tmp_path / "r", resume=True, device="cpu")
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert len(lrs) == 9
    # no jump at the resume: the first resumed step falls less than the 6-step schedule would have
    assert 0 <= lrs[2] - lrs[3] <= T.lr_at(2, cfg) - T.lr_at(3, cfg)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] < 1.5e-3  # near min_lr (1e-3) at the end
    meta = T.read_train_meta(T.resolve_checkpoint(tmp_path / "r"))
    assert meta["train_config"]["steps"] == 9 and meta["train_config"]["decay_anchor"][0] == 3


def test_old_checkpoints_without_new_fields_still_resume(data, tmp_path):
    # Checkpoints written before tokenizer.json, checksums.json and TrainConfig.decay_anchor existed.
    out = tmp_path / "old"
    T.train(small_model(), data, small_config(steps=3), out, device="cpu", meta={"tokenizer": "byte"})
    ckpt = T.resolve_checkpoint(out)
    (ckpt / "tokenizer.json").unlink()
    (ckpt / "checksums.json").unlink()  # nor checksums
    state = torch.load(ckpt / T.TRAIN_STATE_FILE, weights_only=True)
    del state["train_config"]["decay_anchor"]
    torch.save(state, ckpt / T.TRAIN_STATE_FILE)
    meta = json.loads((ckpt / T.TRAIN_META_FILE).read_text())
    del meta["train_config"]["decay_anchor"]
    (ckpt / T.TRAIN_META_FILE).write_text(json.dumps(meta))
    assert XLSTMLanguageModel.load(out).tokenizer_name == "byte"  # from train_meta.json
    res = T.train(small_model(), data, small_config(steps=6), out, resume=True, device="cpu")
    assert res.step == 6


def test_missing_matplotlib_skips_the_plot_with_a_note(data, tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import matplotlib -> ImportError
    res = T.train(small_model(), data, small_config(steps=2), tmp_path / "r", device="cpu")
    assert res.plot is None and "matplotlib" in res.plot_note and len(res.plot_note.splitlines()) == 1
    assert res.checkpoint is not None and not (tmp_path / "r" / "loss.png").exists()


def test_evaluate_counts_its_batches(data):
    model = small_model()
    tb = data.tokenizer.token_byte_lengths()
    part = T.evaluate(model, data.val, seq_len=16, batch_size=4, max_batches=2, token_bytes=tb)
    whole = T.evaluate(model, data.val, seq_len=16, batch_size=4, max_batches=None, token_bytes=tb)
    n_windows = (len(data.val) - 1) // 16
    assert whole.split_batches == part.split_batches == -(-n_windows // 4) > 2
    assert part.batches == 2 and whole.batches == whole.split_batches and whole.tokens == n_windows * 16
    assert part.describe().startswith(f"2 of {part.split_batches} ") and whole.describe().startswith("all ")


def test_training_log_records_validation_size(data, tmp_path):
    T.train(small_model(), data, small_config(steps=2, eval_batches=3), tmp_path / "r", device="cpu")
    rows = [json.loads(l) for l in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val_loss" in r]
    assert vals and all(r["val_batches"] == 3 and r["val_tokens"] == 3 * 4 * 16 for r in vals)


# ------------------------------------------------------------------------------------------
# Reliability: corrupt training states, failed runs, leaked temporaries.


def _corrupt(state, how):
    opt = state["optimizer"]
    first = sorted(opt["state"])[0]
    if how in ("optimizer", "rng", "train_config"):
        del state[how]
    elif how == "exp_avg":
        opt["state"][first]["exp_avg"] = opt["state"][first]["exp_avg"].flatten()[:-1]
    elif how == "exp_avg_sq":
        opt["state"][first]["exp_avg_sq"] = torch.zeros(5, 5)
    elif how == "rng_size":
        state["rng"]["torch"] = state["rng"]["torch"][:100]
    elif how == "rng_dtype":
        state["rng"]["torch"] = state["rng"]["torch"].float()
    elif how == "step":
        state["step"] = -5
    elif how == "batch_size":
        del state["train_config"]["batch_size"]
    elif how == "huge_step":
        state["step"] = 10**12
    elif how == "negative_eps":
        for g in opt["param_groups"]:
            g["eps"] = -1e-8
    elif how == "huge_lr":
        state["train_config"]["lr"] = 1e30
    elif how == "unknown_key":
        state["train_config"]["no_such_setting"] = 1


@pytest.mark.parametrize("how", ["optimizer", "rng", "train_config", "exp_avg", "exp_avg_sq", "rng_size",
                                 "rng_dtype", "step", "batch_size", "huge_step", "negative_eps", "huge_lr",
                                 "unknown_key"])
def test_corrupt_training_states_are_refused_in_one_line(data, tmp_path, how):
    out = tmp_path / "r"
    T.train(small_model(), data, small_config(steps=1, eval_at_start=False), out, device="cpu")
    f = T.resolve_checkpoint(out) / T.TRAIN_STATE_FILE
    state = torch.load(f, weights_only=True)
    _corrupt(state, how)
    torch.save(state, f)
    with pytest.raises(T.CheckpointError, match="SHA-256"):  # the checksum notices first
        T.train(small_model(), data, small_config(steps=3), out, resume=True, device="cpu")
    (f.parent / "checksums.json").unlink()  # a checkpoint from before checksums: the state checks act
    rng_before = torch.get_rng_state()
    with pytest.raises(T.CheckpointError) as e:
        T.train(small_model(), data, small_config(steps=3), out, resume=True, device="cpu")
    assert "\n" not in str(e.value) and str(f.parent) in str(e.value)
    assert torch.equal(torch.get_rng_state(), rng_before)


def test_a_failed_run_leaves_metrics_consistent_with_its_checkpoints(data, tmp_path):
    def fail_at(step):
        def callback(event):
            if isinstance(event, T.StepEvent) and event.step == step:
                raise RuntimeError("simulated failure")
        return callback

    # no checkpoint written: no metrics.jsonl either (nothing to resume, nothing to describe)
    with pytest.raises(RuntimeError, match="simulated"):
        T.train(small_model(), data, small_config(steps=6, checkpoint_interval=0), tmp_path / "a",
                device="cpu", callback=fail_at(2))
    assert not (tmp_path / "a" / "metrics.jsonl").exists()
    # a checkpoint at step 3, a failure at step 5: the log stops at the checkpoint
    with pytest.raises(RuntimeError, match="simulated"):
        T.train(small_model(), data, small_config(steps=6, checkpoint_interval=3), tmp_path / "b",
                device="cpu", callback=fail_at(5))
    rows = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert T.resolve_checkpoint(tmp_path / "b").name == "step-00000003"


def test_resume_removes_the_temporaries_of_a_killed_save(data, tmp_path):
    out = tmp_path / "r"
    T.train(small_model(), data, small_config(steps=2), out, device="cpu")
    leaked = [out / "checkpoints" / "..tmp-step-00000004-ab12cd.tmp-ef34gh", out / "checkpoints" / ".tmp-step-00000004-x1"]
    for p in leaked:
        p.mkdir()
    (out / ".latest.999.0123456789ab.tmp").write_text("checkpoints/step-00000004\n")
    (out / "notes.tmp").write_text("mine")
    T.train(small_model(), data, small_config(steps=3), out, resume=True, device="cpu")
    assert not any(p.exists() for p in leaked) and not (out / ".latest.999.0123456789ab.tmp").exists()
    assert (out / "notes.tmp").read_text() == "mine"


def test_a_diverged_run_stops_and_keeps_its_last_finite_checkpoint(data, tmp_path):
    """A step whose loss turns NaN stops the run with one line before its update (the run
    printed "done" before, with NaN checkpoints pruning the finite one); the newest checkpoint
    stays finite and a resume starts from it."""
    out = tmp_path / "run"
    model = small_model()

    def poison(event):  # after step 5's checkpoint: step 6's loss is NaN
        if isinstance(event, T.CheckpointEvent) and event.step == 5:
            with torch.no_grad():
                model.embedding.weight[:, 0] = float("nan")

    with pytest.raises(T.TrainingDiverged) as e:
        T.train(model, data, small_config(steps=9, checkpoint_interval=1, keep_checkpoints=1), out,
                device="cpu", callback=poison)
    msg = str(e.value)
    assert "\n" not in msg and "diverged at step 6: loss nan" in msg and "last checkpoint (step 5) is kept" in msg
    ckpt = T.resolve_checkpoint(out)
    assert ckpt.name == "step-00000005"
    loaded = XLSTMLanguageModel.load(ckpt)
    assert all(torch.isfinite(p).all() for p in loaded.parameters())
    res = T.train(small_model(), data, small_config(steps=7, checkpoint_interval=1, keep_checkpoints=1), out,
                  resume=True, device="cpu")
    assert res.step == 7 and all(math.isfinite(l) for _, l in res.losses)


def test_train_step_refuses_a_non_finite_gradient_before_the_update():
    """check_finite: an infinite gradient (finite loss) leaves the weights untouched."""
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.tensor([[1.0, 2.0, 3.0]])

    class InfiniteGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.clone()

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    loss = lambda y, t: InfiniteGrad.apply(y).sum()  # noqa: E731
    with pytest.raises(T.NonFiniteStep) as e:
        T.train_step(model, opt, [(x, None)], loss, lr=0.1, precision="fp32", check_finite=True)
    assert math.isfinite(e.value.loss) and not math.isfinite(e.value.grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_a_run_folder_is_locked_while_a_run_writes_it(data, tmp_path):
    """A second run into a folder another run is writing stops in one line before touching it
    (two runs interleaved metrics.jsonl and deleted each other's staging folders); the lock goes
    with the run, also when the run fails."""
    from xlstm_kit.io.checkpoint import RunLocked, run_lock

    out = tmp_path / "run"
    with run_lock(out):  # stands for another process's run (flock: per open file, so this conflicts)
        (out / "theirs.txt").write_text("x")
        with pytest.raises(RunLocked, match="another run") as e:
            T.train(small_model(), data, small_config(steps=2), out, device="cpu")
        assert "\n" not in str(e.value)
        assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == ["theirs.txt"]
    with pytest.raises(ValueError):  # a failing run releases the lock
        T.train(small_model(), data, small_config(steps=2, batch_size=3), out, device="cpu",
                dist=T.DistInfo(rank=0, world_size=2, local_rank=0))
    res = T.train(small_model(), data, small_config(steps=2), out, device="cpu")
    assert res.step == 2


class Regression(T.Workload):
    """A workload of its own: batches from a generator whose state a resume must restore (the
    synthetic experiments' kind), a mean-squared-error loss, no validation."""

    def __init__(self, seed=0, end_at=None):
        self.rng, self.end_at = np.random.default_rng(seed), end_at

    def batches(self, step):
        x = torch.from_numpy(self.rng.standard_normal((8, 3))).float()
        return [(x, x.sum(-1, keepdim=True))]

    def step(self, model, optimizer, micro_batches, **kw):
        return T.train_step(model, optimizer, micro_batches, torch.nn.functional.mse_loss, **kw)

    def after_step(self, run):
        return "end" if run.step == self.end_at else None

    def state_dict(self):
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state["rng"]


def linear(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 1)


def test_a_workload_of_its_own_trains_logs_and_resumes_exactly(tmp_path, single_thread):
    cfg = T.TrainConfig(steps=8, batch_size=8, lr=0.1, min_lr=0.01, warmup_steps=0, weight_decay=0.0,
                        eval_interval=0, checkpoint_interval=0, log_interval=3)
    whole_model = linear()
    whole = T.train(whole_model, Regression(), cfg, tmp_path / "a", device="cpu")
    assert [s for s, _ in whole.losses] == [1, 3, 6, 8]  # the first, every third, the last
    distance = lambda m: float((m.weight.detach() - 1).abs().sum())  # noqa: E731 (the target is the sum of the inputs)
    assert whole.evals == [] and distance(whole_model) < 0.8 * distance(linear())
    cut = T.train(linear(), Regression(), cfg, tmp_path / "b", device="cpu", callback=_stop_at(3, "keyboard"))
    assert cut.interrupted and cut.step == 3
    # another init and another generator seed: the weights and the batches' state come from the checkpoint
    resumed_model = linear(seed=5)
    resumed = T.train(resumed_model, Regression(seed=99), cfg, tmp_path / "b", resume=True, device="cpu")
    assert resumed.losses == whole.losses[2:] and resumed.history == whole.history
    assert torch.equal(resumed_model.weight, whole_model.weight)
    # the run's training time counts both sessions
    before = T.load_training_state(tmp_path / "b" / "checkpoints" / "step-00000003")["extra"]["seconds"]
    assert resumed.seconds > before > 0


def test_a_workload_ends_the_run_early_and_checkpoints_by_time(tmp_path):
    cfg = T.TrainConfig(steps=8, batch_size=8, warmup_steps=0, eval_interval=0, checkpoint_interval=0,
                        checkpoint_every_s=1e-9, keep_checkpoints=10, log_interval=4)
    r = T.train(linear(), Regression(end_at=5), cfg, tmp_path / "r", device="cpu")
    assert r.step == 5 and r.config.steps == 8 and not r.interrupted
    assert [s for s, _ in r.losses] == [1, 4, 5]  # the step it ended at closes the curve
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == [f"step-0000000{s}" for s in range(1, 6)]
    with pytest.raises(ValueError, match="checkpoint_every_s"):
        T.TrainConfig(checkpoint_every_s=-1.0)
