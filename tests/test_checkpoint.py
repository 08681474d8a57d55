"""Checkpoints: config.json + model.safetensors round-trip exactly, are written atomically and
fail clearly when missing or corrupt."""
import json

import pytest
import torch
from safetensors.torch import load_file

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel


pytestmark = pytest.mark.usefixtures("single_thread")  # tiny shapes (see tests/conftest.py)


def model(**kw):
    cfg = XLSTMConfig(**{**dict(vocab_size=30, d_model=32, n_blocks=2, n_heads=2, slstm_at="1:1"), **kw})
    m = XLSTMLanguageModel(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


@pytest.mark.parametrize("kw", [dict(), dict(tie_embeddings=True, bias=True, slstm_at=[0])])
def test_round_trip_is_exact(tmp_path, kw):
    m = model(**kw)
    m.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [".xlstm-kit-files.json", "checksums.json",
                                                                      "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left
    loaded = XLSTMLanguageModel.load(tmp_path / "ckpt")
    assert loaded.config == m.config
    for (name, a), b in zip(m.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    if m.config.tie_embeddings:
        assert loaded.lm_head.weight is loaded.embedding.weight
    tokens = torch.randint(0, 30, (2, 9))
    assert torch.equal(m(tokens), loaded(tokens))
    # plain formats: JSON config and safetensors weights, no pickle
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["slstm_at"] == m.config.slstm_at
    assert set(load_file(str(tmp_path / "ckpt" / "model.safetensors"))) <= set(m.state_dict())


def test_bfloat16_round_trip(tmp_path):
    m = model().to(torch.bfloat16)
    m.save(tmp_path / "bf16")
    loaded = XLSTMLanguageModel.load(tmp_path / "bf16")
    assert loaded.embedding.weight.dtype == torch.bfloat16
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), loaded.state_dict().values()))


def test_saving_over_a_checkpoint_keeps_other_files(tmp_path):
    first, second = model(), model()
    first.save(tmp_path / "c")
    (tmp_path / "c" / "train_state.pt").write_bytes(b"optimizer")
    second.save(tmp_path / "c")
    assert (tmp_path / "c" / "train_state.pt").read_bytes() == b"optimizer"
    loaded = XLSTMLanguageModel.load(tmp_path / "c")
    assert torch.equal(loaded.embedding.weight, second.embedding.weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_missing_checkpoints_raise_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        XLSTMLanguageModel.load(tmp_path / "nope")
    model().save(tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        XLSTMLanguageModel.load(tmp_path / "c")


def test_corrupt_checkpoints_raise_value_error(tmp_path):
    model().save(tmp_path / "c")
    cfg_file, weights = tmp_path / "c" / "config.json", tmp_path / "c" / "model.safetensors"
    good_cfg, good_weights = cfg_file.read_text(), weights.read_bytes()

    cfg_file.write_text(good_cfg[:-10])
    with pytest.raises(ValueError, match="not valid JSON"):
        XLSTMLanguageModel.load(tmp_path / "c")
    cfg_file.write_text(json.dumps({**json.loads(good_cfg), "d_model": 31}))
    with pytest.raises(ValueError, match="does not describe a valid XLSTMConfig"):
        XLSTMLanguageModel.load(tmp_path / "c")
    cfg_file.write_text(json.dumps({**json.loads(good_cfg), "d_model": 64}))
    with pytest.raises(ValueError, match="has shape"):
        XLSTMLanguageModel.load(tmp_path / "c")
    cfg_file.write_text(json.dumps({**json.loads(good_cfg), "slstm_at": [0]}))
    with pytest.raises(ValueError, match="does not match its config.json"):
        XLSTMLanguageModel.load(tmp_path / "c")

    cfg_file.write_text(good_cfg)
    weights.write_bytes(good_weights[: len(good_weights) // 2])
    with pytest.raises(ValueError, match="SHA-256"):
        XLSTMLanguageModel.load(tmp_path / "c")
    (tmp_path / "c" / "checksums.json").unlink()  # as written before checksums: safetensors' own checks
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        XLSTMLanguageModel.load(tmp_path / "c")
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt"):
        XLSTMLanguageModel.load(tmp_path / "c")


def test_cannot_save_onto_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        model().save(tmp_path / "f")


def _byte_model():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(vocab_size=256, d_model=32, n_blocks=2, n_heads=2, slstm_at=[1],
                                          chunk_size=8))


def test_load_follows_run_folders_and_returns_eval_mode(tmp_path):
    from xlstm_kit.io.checkpoint import save_checkpoint
    from xlstm_kit.training import TrainConfig, make_optimizer

    m = _byte_model()
    save_checkpoint(tmp_path / "run", m, make_optimizer(m, TrainConfig()), 3, TrainConfig(),
                    meta={"tokenizer": "byte"})
    for path in (tmp_path / "run", tmp_path / "run" / "checkpoints" / "step-00000003"):
        loaded = XLSTMLanguageModel.load(path)
        assert not loaded.training and not any(mod.training for mod in loaded.modules())
        assert loaded.tokenizer_name == "byte"
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), loaded.state_dict().values()))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        XLSTMLanguageModel.load(tmp_path / "empty")


def test_generate_accepts_text_when_the_checkpoint_knows_its_tokenizer(tmp_path):
    m = _byte_model()
    m.save(tmp_path / "plain")
    plain = XLSTMLanguageModel.load(tmp_path / "plain")
    assert plain.tokenizer_name is None and not (tmp_path / "plain" / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="tokenizer"):
        plain.generate("ROMEO:", 4)
    m.save(tmp_path / "tok", tokenizer="byte")
    loaded = XLSTMLanguageModel.load(tmp_path / "tok")
    text = loaded.generate("ROMEO:", 12, temperature=0)
    ids = loaded.generate(torch.tensor(list(b"ROMEO:")), 12, temperature=0)  # tokens in, tokens out
    assert isinstance(text, str) and isinstance(ids, torch.Tensor) and ids.shape == (6 + 12,)
    assert text == "ROMEO:" + bytes(ids[6:].tolist()).decode("utf-8", errors="replace")
    assert loaded.generate("ROMEO:", 0) == "ROMEO:"


def test_checkpoint_module_does_not_import_the_model():
    # model.py imports checkpoint.py; the reverse would be an import cycle.
    import ast
    import inspect

    import xlstm_kit.io.checkpoint as ck

    tree = ast.parse(inspect.getsource(ck))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name.split(".")[-1] in ("model", "train") for name in imported), imported


# ------------------------------------------------------------------------------------------
# Reliability: checksums, refused weights, bounded configs, confined `latest`,
# temporaries of killed saves, file modes.


def _rewrite_weights(folder, change):
    """Replace the weights with change(tensors) and drop checksums.json (as a checkpoint from
    before checksums, or one whose checksum was rewritten too): the tensor checks must act."""
    from safetensors.torch import save_file

    tensors = load_file(str(folder / "model.safetensors"))
    save_file(change(tensors), str(folder / "model.safetensors"))
    (folder / "checksums.json").unlink(missing_ok=True)


def test_a_flipped_byte_in_the_weights_is_refused(tmp_path):
    from xlstm_kit.io.checkpoint import CheckpointError

    model().save(tmp_path / "c")
    weights = tmp_path / "c" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-7] ^= 0x10  # inside the last tensor: still a valid safetensors file, another value
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256") as e:
        XLSTMLanguageModel.load(tmp_path / "c")
    assert "\n" not in str(e.value)


@pytest.mark.timeout(60)  # the failure this guards against is a hang
@pytest.mark.parametrize("special", ["dev-zero", "fifo", "folder"])
def test_weights_that_are_not_a_regular_file_are_refused_at_once(tmp_path, special):
    """Weights replaced by a link to /dev/zero or by a FIFO made the checksum read spin or
    block forever (it ran before any check of the file); now one line, at once."""
    import os

    from xlstm_kit.io.checkpoint import CheckpointError

    model().save(tmp_path / "c")
    weights = tmp_path / "c" / "model.safetensors"
    weights.unlink()
    if special == "dev-zero":
        weights.symlink_to("/dev/zero")
    elif special == "fifo":
        os.mkfifo(weights)
    else:
        weights.mkdir()
    for load in (XLSTMLanguageModel.load, XLSTMLanguageModel.from_pretrained):
        with pytest.raises(CheckpointError, match="not a regular file") as e:
            load(tmp_path / "c")
        assert "\n" not in str(e.value)


def test_an_oversized_checksums_file_is_refused(tmp_path):
    from xlstm_kit.io.checkpoint import MAX_CHECKSUMS_BYTES, CheckpointError

    model().save(tmp_path / "c")
    (tmp_path / "c" / "checksums.json").write_text(" " * (MAX_CHECKSUMS_BYTES + 1))
    with pytest.raises(CheckpointError, match="checksums.json is corrupt"):
        XLSTMLanguageModel.load(tmp_path / "c")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_or_boolean_weights_are_refused_not_cast(tmp_path, dtype):
    from xlstm_kit.io.checkpoint import CheckpointError

    model().save(tmp_path / "c")
    _rewrite_weights(tmp_path / "c", lambda ts: {k: (v * 10).to(dtype) for k, v in ts.items()})
    with pytest.raises(CheckpointError, match="dtype"):
        XLSTMLanguageModel.load(tmp_path / "c")
    _rewrite_weights(tmp_path / "c", lambda ts: {k: (v.to(dtype) if k == "norm.weight" else v.float())
                                                 for k, v in ts.items()})  # one tensor only
    with pytest.raises(CheckpointError, match="norm.weight has dtype"):
        XLSTMLanguageModel.load(tmp_path / "c")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(tmp_path, bad):
    from xlstm_kit.io.checkpoint import CheckpointError

    model().save(tmp_path / "c")

    def poison(ts):
        ts["embedding.weight"][3, 5] = bad
        return ts

    _rewrite_weights(tmp_path / "c", poison)
    with pytest.raises(CheckpointError, match="embedding.weight holds NaN or infinite"):
        XLSTMLanguageModel.load(tmp_path / "c")


@pytest.mark.parametrize("field,value", [("vocab_size", 10**9), ("d_model", 2**20), ("n_blocks", 10**8)])
def test_a_config_naming_a_huge_model_is_refused_before_allocating(tmp_path, field, value):
    import resource

    model().save(tmp_path / "c")
    cfg_file = tmp_path / "c" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), field: value}))
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ValueError, match="shape|does not match|blocks|at most") as e:
        XLSTMLanguageModel.load(tmp_path / "c")
    assert "\n" not in str(e.value)
    # the weights of such a model need >= 1e9 * 4 bytes; nothing near that was touched
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 200_000  # KiB


def test_a_triton_checkpoint_loads_on_the_cpu_with_the_automatic_backend(tmp_path):
    m = model()
    m.save(tmp_path / "c")
    cfg_file = tmp_path / "c" / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "backend": "triton"}))
    with pytest.warns(UserWarning, match="backend='triton'"):
        loaded = XLSTMLanguageModel.load(tmp_path / "c", device="cpu")
    assert loaded.config.backend is None
    tokens = torch.randint(0, 30, (2, 9))
    assert torch.equal(loaded(tokens), m.eval()(tokens))


@pytest.mark.parametrize("target", ["/etc", "../", "../../etc", "checkpoints/../../outside",
                                    "checkpoints/step-00000003/../../..", "checkpoints"])
def test_latest_is_not_followed_outside_the_run(tmp_path, target):
    from xlstm_kit.io.checkpoint import CheckpointError, resolve_checkpoint, save_checkpoint
    from xlstm_kit.training import TrainConfig, make_optimizer

    m = _byte_model()
    save_checkpoint(tmp_path / "run", m, make_optimizer(m, TrainConfig()), 3, TrainConfig())
    outside = tmp_path / "outside"  # a model checkpoint a hostile `latest` could point at
    m.save(outside)
    (tmp_path / "run" / "latest").write_text(target + "\n")
    for load in (resolve_checkpoint, XLSTMLanguageModel.load):
        with pytest.raises(CheckpointError, match="not a checkpoint folder of this run") as e:
            load(tmp_path / "run")
        assert "\n" not in str(e.value)


def test_stale_temporaries_are_removed_and_nothing_else(tmp_path):
    from xlstm_kit.io.checkpoint import remove_stale_staging

    run = tmp_path / "run"
    ck = run / "checkpoints"
    ours = [ck / ".tmp-step-00000003-k2_x9q1a", ck / "..tmp-step-00000003-k2_x9q1a.tmp-ab3_de",
            ck / ".tmp-step-00000012-0123456789ab"]
    for p in ours:
        p.mkdir(parents=True)
        (p / "model.safetensors").write_bytes(b"partial")
    stale_files = [run / ".latest.4242.0123456789ab.tmp", run / ".metrics.jsonl.17.a1b2c3d4e5f6.tmp"]
    theirs = [ck / ".tmp-notes", ck / "step-00000003", ck / ".tmp-step-x", run / ".latest.txt",
              run / "notes.tmp", run / ".latest.4242.tmp", run / "latest"]
    for p in stale_files:
        p.write_text("checkpoints/step-00000003\n")
    for p in theirs:
        if p.name.startswith("step-") or p.name == ".tmp-notes":
            p.mkdir()
        else:
            p.write_text("keep")
    remove_stale_staging(run)
    assert not any(p.exists() for p in ours + stale_files)
    assert all(p.exists() for p in theirs)


_KILLED_SAVE = """
import os, sys, torch
import safetensors.torch as st
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.io.checkpoint import save_checkpoint
from xlstm_kit.training import TrainConfig, make_optimizer
m = XLSTMLanguageModel(XLSTMConfig(vocab_size=30, d_model=32, n_blocks=1, n_heads=2))
real = st.save_file
def die(tensors, path, *a, **k):
    real(tensors, path, *a, **k)
    os._exit(9)  # a kill -9 right after the weights are written
st.save_file = die
save_checkpoint(sys.argv[1], m, make_optimizer(m, TrainConfig()), 5, TrainConfig())
"""


def test_a_kill_during_a_training_save_leaves_only_what_the_next_run_removes(tmp_path):
    import subprocess
    import sys

    from xlstm_kit.io.checkpoint import remove_stale_staging

    env = {**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-c", _KILLED_SAVE, str(tmp_path / "run")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 9, r.stderr
    left = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert len(left) == 1 and left[0].startswith(".tmp-step-00000005-")  # no nested temporary folder
    remove_stale_staging(tmp_path / "run")
    assert not list((tmp_path / "run" / "checkpoints").iterdir())


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_checkpoints_honour_the_umask(tmp_path, umask):
    import os
    import stat

    from xlstm_kit.io.checkpoint import save_checkpoint
    from xlstm_kit.training import TrainConfig, make_optimizer

    old = os.umask(umask)
    try:
        m = model()
        m.save(tmp_path / "plain")
        final = save_checkpoint(tmp_path / "run", m, make_optimizer(m, TrainConfig()), 1, TrainConfig())
    finally:
        os.umask(old)
    for folder in (tmp_path / "plain", final, tmp_path / "run" / "checkpoints"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder
    for f in [*(tmp_path / "plain").iterdir(), *final.iterdir(), tmp_path / "run" / "latest"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask, f


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["fifo", "oversized"])
def test_a_hostile_latest_is_one_line(tmp_path, kind):
    from xlstm_kit.io.checkpoint import CheckpointError, resolve_checkpoint, save_checkpoint
    from xlstm_kit.training import TrainConfig, make_optimizer

    from .helpers import make_hostile

    m = _byte_model()
    save_checkpoint(tmp_path / "run", m, make_optimizer(m, TrainConfig()), 3, TrainConfig())
    make_hostile(tmp_path / "run" / "latest", kind, 4096)
    with pytest.raises(CheckpointError, match="not a regular file" if kind == "fifo" else "more than the") as e:
        resolve_checkpoint(tmp_path / "run")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("kind", ["oversized", "nested"])
def test_a_hostile_train_meta_makes_a_folder_not_ours(tmp_path, kind):
    from xlstm_kit.io.checkpoint import TRAIN_META_FILE, is_our_checkpoint
    from xlstm_kit.io.jsonfile import MAX_META_BYTES

    from .helpers import make_hostile

    folder = tmp_path / "step-00000003"
    folder.mkdir()
    make_hostile(folder / TRAIN_META_FILE, kind, MAX_META_BYTES)
    assert not is_our_checkpoint(folder)  # no RecursionError, no read of the whole file
    assert (folder / TRAIN_META_FILE).exists()
