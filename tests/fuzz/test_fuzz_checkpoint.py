"""Seeded fuzzing of checkpoints and training states.

One small run folder is saved once; every case copies it, corrupts one thing (truncation, a byte
flip, a wrong dtype or shape, a missing or extra key, odd config values, a hostile `latest`,
a broken train_state.pt) and loads it. The outcome must be an XLSTMKitError with a one-line
message, or a model equal to what the files hold (and, where the checksums are intact, equal
to the saved model); never another exception. Resumed training states must also survive one
optimizer step.
"""
import json
import random
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit import training as T
from xlstm_kit.training.loop import RunState
from xlstm_kit.training.workload import LanguageModelling
from xlstm_kit.io.checkpoint import CHECKSUMS_FILE, save_checkpoint
from xlstm_kit.errors import XLSTMKitError

SEED = 14
N_MODEL_CASES = 160
N_STATE_CASES = 90
TEXT = "ROMEO:\nBut, soft! what light through yonder window breaks?\nIt is the east.\n" * 30


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("fuzz_ckpt")
    mp.setenv("XLSTM_KIT_CACHE", str(root / "cache"))
    (root / "corpus.txt").write_text(TEXT)
    from xlstm_kit.training.data import load_data

    data = load_data(str(root / "corpus.txt"), "byte")
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                           chunk_size=8))
    cfg = T.TrainConfig(steps=4, batch_size=2, seq_len=8, warmup_steps=1, eval_batches=1)
    opt = T.make_optimizer(model, cfg)
    x = torch.randint(0, 256, (2, 9))
    T.train_step(model, opt, [(x[:, :-1], x[:, 1:])], T.lm_loss, lr=1e-3)  # moments in the state
    ckpt = save_checkpoint(root / "run", model, opt, 1, cfg, meta={"tokenizer": "byte"})
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    yield root, ckpt.relative_to(root / "run"), saved, cfg, data
    mp.undo()
    torch.set_num_threads(n)


def _copy(root, name):
    dst = root / name
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(root / "run", dst)
    return dst


def _one_line(e):
    assert isinstance(e, XLSTMKitError), repr(e)
    assert str(e) and "\n" not in str(e), repr(str(e))


# ------------------------------------------------------------------------------------------ model


def _flip(rng, f):
    b = bytearray(f.read_bytes())
    i = rng.randrange(len(b))
    b[i] ^= rng.randrange(1, 256)
    f.write_bytes(bytes(b))


def _truncate(rng, f):
    b = f.read_bytes()
    f.write_bytes(b[: rng.randrange(len(b))])


def _tensor_change(rng, f):
    ts = load_file(str(f))
    key = rng.choice(sorted(ts))
    kind = rng.choice(["dtype", "dtype_all", "shape", "missing", "extra", "nonfinite", "empty"])
    if kind == "dtype":
        ts[key] = ts[key].to(rng.choice([torch.int32, torch.int64, torch.bool, torch.uint8, torch.float16]))
    elif kind == "dtype_all":
        dt = rng.choice([torch.int32, torch.bool, torch.float64, torch.bfloat16])
        ts = {k: v.to(dt) for k, v in ts.items()}
    elif kind == "shape":
        t = ts[key]
        ts[key] = rng.choice([t.flatten(), t[..., :-1] if t.shape[-1] > 1 else t.unsqueeze(0), t.unsqueeze(-1)])
    elif kind == "missing":
        del ts[key]
    elif kind == "extra":
        ts["blocks.9.extra"] = torch.zeros(3)
    elif kind == "nonfinite":
        t = ts[key].clone()
        t.view(-1)[rng.randrange(t.numel())] = rng.choice([float("nan"), float("inf"), -float("inf")])
        ts[key] = t
    else:
        ts[key] = ts[key][:0]
    save_file({k: v.contiguous() for k, v in ts.items()}, str(f))


_ODD_VALUES = [0, -1, 10**9, 2**20, 2**40, 1e9, 0.5, float("nan"), "x", None, [], {}, True, "triton", [0, 0]]


def _config_change(rng, f):
    cfg = json.loads(f.read_text())
    kind = rng.choice(["value", "value", "delete", "unknown", "garbage", "backend", "not_object"])
    if kind == "value":
        cfg[rng.choice(sorted(cfg))] = rng.choice(_ODD_VALUES)
    elif kind == "delete":
        del cfg[rng.choice(sorted(cfg))]
    elif kind == "unknown":
        cfg["surprise"] = 1
    elif kind == "backend":
        cfg["backend"] = rng.choice(["triton", "cuda", 3])
    elif kind == "not_object":
        cfg = rng.choice([[1, 2], "config", 7, None])
    if kind == "garbage":
        f.write_bytes(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))))
    else:
        f.write_text(json.dumps(cfg))


def _checksums_change(rng, f):
    kind = rng.choice(["garbage", "structure", "digest"])
    if kind == "garbage":
        f.write_bytes(b"{\"sha256\": " + bytes(rng.randrange(256) for _ in range(10)))
    elif kind == "structure":
        f.write_text(json.dumps(rng.choice([[], {"sha256": []}, {"sha256": {"model.safetensors": 5}}, {}])))
    else:
        d = json.loads(f.read_text())
        d["sha256"]["model.safetensors"] = "%064x" % rng.getrandbits(256)
        f.write_text(json.dumps(d))


_LATEST = ["/etc", "../", "../../etc", "checkpoints/../../x", "checkpoints/step-00000001/..", "/",
           "checkpoints/step-99999999", "checkpoints/step-1/../step-1", "", "\x00", "checkpoints\\step-1",
           "checkpoints/step-00000001\nrm -rf", "checkpoints/.tmp-step-00000001-abc"]


def _latest_change(rng, f):
    if rng.random() < 0.2:
        f.write_bytes(bytes(rng.randrange(256) for _ in range(8)))
    else:
        f.write_text(rng.choice(_LATEST) + "\n")


def _equal_to_files(model, ckpt):
    """The loaded model holds exactly the weights in the folder's files."""
    ts = load_file(str(ckpt / "model.safetensors"))
    for k, v in model.state_dict().items():
        if k not in ts and k == "lm_head.weight":
            continue
        assert torch.equal(v, ts[k].to(v.dtype)), k
        assert torch.isfinite(v).all(), k


def test_fuzz_model_checkpoints(run):
    root, rel, saved, _, _ = run
    rng = random.Random(SEED)
    outcomes = {"error": 0, "loaded": 0}
    for case in range(N_MODEL_CASES):
        run_dir = _copy(root, "case")
        ckpt = run_dir / rel
        target = rng.choice(["weights_flip", "weights_truncate", "tensors", "config", "checksums", "latest"])
        keep_sums = rng.random() < 0.5 and target in ("weights_flip", "weights_truncate")
        if target == "weights_flip":
            _flip(rng, ckpt / "model.safetensors")
        elif target == "weights_truncate":
            _truncate(rng, ckpt / "model.safetensors")
        elif target == "tensors":
            _tensor_change(rng, ckpt / "model.safetensors")
        elif target == "config":
            _config_change(rng, ckpt / "config.json")
        elif target == "checksums":
            _checksums_change(rng, ckpt / CHECKSUMS_FILE)
        else:
            _latest_change(rng, run_dir / "latest")
        if target in ("weights_flip", "weights_truncate", "tensors") and not keep_sums:
            (ckpt / CHECKSUMS_FILE).unlink()  # as if the digest was rewritten too: the tensor checks act
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model = XLSTMLanguageModel.load(run_dir if target == "latest" else ckpt)
        except Exception as e:  # noqa: BLE001 - the point: only the library's error may escape
            _one_line(e)
            outcomes["error"] += 1
            continue
        outcomes["loaded"] += 1
        _equal_to_files(model, ckpt)
        if keep_sums or target in ("checksums", "latest"):
            # with a valid checksum (or the weights untouched) the model is the saved one
            assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items()), (case, target)
            assert model(torch.randint(0, model.config.vocab_size, (1, 5))).isfinite().all()
        # (weights changed behind a rewritten checksum may be finite yet huge, e.g. a flipped
        # exponent bit giving 1e38: loading them as they are is right; their outputs may overflow)
    assert outcomes["error"] > N_MODEL_CASES // 2 and outcomes["loaded"] > 0, outcomes


# ------------------------------------------------------------------------------ training state


def _state_change(rng, state, params):
    kind = rng.choice(["drop_top", "step", "opt_drop", "exp_avg_shape", "exp_avg_dtype", "exp_avg_nan",
                       "groups", "group_params", "state_key", "hyper", "rng", "rng_cuda", "train_config"])
    opt = state["optimizer"]
    pid = rng.choice(sorted(opt["state"]))
    if kind == "drop_top":
        del state[rng.choice(["format", "step", "optimizer", "train_config", "rng"])]
    elif kind == "step":
        state["step"] = rng.choice([-5, -1, "3", 1.5, True, None, torch.tensor(1)])
    elif kind == "opt_drop":
        del opt[rng.choice(["state", "param_groups"])]
    elif kind == "exp_avg_shape":
        t = opt["state"][pid][rng.choice(["exp_avg", "exp_avg_sq"])]
        opt["state"][pid]["exp_avg"] = rng.choice([t.flatten()[:-1], t.unsqueeze(0), torch.zeros(7, 3)])
    elif kind == "exp_avg_dtype":
        opt["state"][pid]["exp_avg_sq"] = opt["state"][pid]["exp_avg_sq"].to(rng.choice([torch.int32, torch.bool]))
    elif kind == "exp_avg_nan":
        opt["state"][pid]["exp_avg"] = opt["state"][pid]["exp_avg"] * float("nan")
    elif kind == "groups":
        opt["param_groups"] = opt["param_groups"][:1] if rng.random() < 0.5 else opt["param_groups"] * 2
    elif kind == "group_params":
        g = opt["param_groups"][0]
        g["params"] = g["params"][1:] if rng.random() < 0.5 else list(reversed(g["params"]))
    elif kind == "state_key":
        opt["state"][rng.choice(["x", 999, -1])] = opt["state"].pop(pid)
    elif kind == "hyper":
        g = opt["param_groups"][rng.randrange(len(opt["param_groups"]))]
        g[rng.choice(["eps", "betas", "weight_decay", "lr"])] = rng.choice(["x", None, float("nan"), (0.9,), [1, 2, 3]])
    elif kind == "rng":
        t = state["rng"]["torch"]
        state["rng"]["torch"] = rng.choice([t[:-8], t.float(), torch.zeros(3, dtype=torch.uint8), "seed",
                                            torch.randint(0, 256, t.shape, dtype=torch.uint8)])
    elif kind == "rng_cuda":
        state["rng"]["cuda"] = rng.choice(["x", [torch.zeros(2)], None])
    else:
        tc = state["train_config"]
        key = rng.choice(["batch_size", "seq_len", "steps", "seed", "grad_accum", "lr", "betas", "precision"])
        if rng.random() < 0.4:
            del tc[key]
        else:
            tc[key] = rng.choice([0, -5, "x", None, 2.5, [1]])
    return kind


def test_fuzz_training_states(run):
    root, rel, saved, cfg, data = run
    rng = random.Random(SEED + 1)
    outcomes = {"error": 0, "restored": 0}
    rng_before = torch.get_rng_state()
    for case in range(N_STATE_CASES):
        run_dir = _copy(root, "state_case")
        f = run_dir / rel / T.TRAIN_STATE_FILE
        how = rng.choice(["flip", "truncate", "structure", "structure", "structure", "meta"])
        if how == "meta":
            m = run_dir / rel / T.TRAIN_META_FILE
            meta = json.loads(m.read_text())
            meta["step"] = rng.choice([-5, "1", None, 1.0, True])
            m.write_bytes(rng.choice([b"[1, 2]", b"\xff\xfe{", b"{"]) if rng.random() < 0.3
                          else json.dumps(meta).encode())
        elif how == "flip":
            _flip(rng, f)
        elif how == "truncate":
            _truncate(rng, f)
        if how != "structure" and rng.random() < 0.5:
            (run_dir / rel / CHECKSUMS_FILE).unlink()
        if how == "structure":
            state = torch.load(f, weights_only=True)
            how = _state_change(rng, state, None)
            torch.save(state, f)
            (run_dir / rel / CHECKSUMS_FILE).unlink()
        torch.manual_seed(123)
        model = XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                               chunk_size=8))
        cpu = torch.device("cpu")
        r = RunState(model, LanguageModelling(model, data, cfg, T.DistInfo(), cpu), cfg, run_dir, T.DistInfo(), cpu,
                     {}, None)
        try:
            r.restore()
            x = torch.randint(0, 256, (2, 9))
            T.train_step(model, r.optimizer, [(x[:, :-1], x[:, 1:])], T.lm_loss, lr=1e-3)
        except Exception as e:  # noqa: BLE001
            _one_line(e)
            outcomes["error"] += 1
            continue
        finally:
            torch.set_rng_state(rng_before)
        outcomes["restored"] += 1
        assert r.step >= 0, (case, how)
    assert outcomes["error"] > N_STATE_CASES // 2, outcomes
