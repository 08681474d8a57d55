"""The training loop (xlstm_kit.train): schedule, weight-decay groups, evaluation, exact resume,
interrupts and atomic checkpoints. A small XLSTMLanguageModel keeps every run to a few steps."""
import json
import math
import os
import signal

import numpy as np
import pytest
import torch

from xlstm_kit import train as T
from xlstm_kit.data import load_data
from xlstm_kit.model import XLSTMConfig, XLSTMLanguageModel

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
def test_interrupt_then_resume_is_exact(data, tmp_path, how, stop_step):
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
