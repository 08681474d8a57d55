"""Checkpoints: config.json + model.safetensors round-trip exactly, are written atomically and
fail clearly when missing or corrupt."""
import json

import pytest
import torch
from safetensors.torch import load_file

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel


@pytest.fixture(autouse=True)
def _single_thread():
    # tiny shapes: a second OpenMP thread only adds barrier waits (10-20x on a busy 2-core box)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


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
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["checksums.json", "config.json", "model.safetensors"]
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
    from xlstm_kit.checkpoint import save_checkpoint
    from xlstm_kit.train import TrainConfig, make_optimizer

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

    import xlstm_kit.checkpoint as ck

    tree = ast.parse(inspect.getsource(ck))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(name.split(".")[-1] in ("model", "train") for name in imported), imported
