"""Inputs that raised raw tracebacks where an XLSTMKitError (one line; exit status 2 on the
command line) is promised: odd output paths, damaged or hostile JSON in every file the library
reads, absurd generation and training arguments, impossible devices and dtypes, configs too large
to allocate. Each case must end in an XLSTMKitError whose message is one line."""
import os

import pytest
import torch

from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.errors import XLSTMKitError


def _one_line_error(call):
    with pytest.raises(XLSTMKitError) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value)
    return str(info.value)


@pytest.fixture(scope="module")
def small():
    torch.manual_seed(0)
    return XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=64, d_model=32, n_blocks=1, n_heads=2))


# ------------------------------------------------------------------------------ output paths
ODD_OUTPUTS = {
    "below a file": lambda t: t / "afile" / "model",
    "a file": lambda t: t / "afile",
    "a name of 300 bytes": lambda t: t / ("x" * 300),
    "a name that leaves no room for the staging copy": lambda t: t / ("w" * 250),
    "a long name above": lambda t: t / ("y" * 256) / "model",
    "a link to nothing": lambda t: t / "dangling",
    "below a link to nothing": lambda t: t / "dangling" / "model",
}


@pytest.mark.parametrize("how", ["save", "save_pretrained", "save_pretrained_ours"])
@pytest.mark.parametrize("where", list(ODD_OUTPUTS))
def test_odd_output_paths(small, tmp_path, how, where):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "deeper")
    path = ODD_OUTPUTS[where](tmp_path)
    if how == "save":
        call = lambda: small.save(path)  # noqa: E731
    else:
        call = lambda: small.save_pretrained(path, format="xlstm_kit" if how.endswith("ours") else "hf")  # noqa: E731
    _one_line_error(call)
    assert (tmp_path / "afile").read_text() == "x"
    assert sorted(os.listdir(tmp_path)) == ["afile", "dangling"]  # no staging folder left behind


# ------------------------------------------------------------------------------ configs too large together
def test_a_config_too_large_to_allocate_is_refused_before_allocating(monkeypatch):
    # each field within its bounds, together ~160 billion parameters
    huge = XLSTMConfig(vocab_size=262144, d_model=16384, n_blocks=48, n_heads=8)
    message = _one_line_error(lambda: XLSTMLanguageModel(huge))
    assert "parameters" in message and "GiB" in message and "free on cpu" in message
    from xlstm_kit.models import meta

    with meta.shapes_only():  # its shapes can still be inspected
        XLSTMLanguageModel(huge)

    monkeypatch.setattr(meta, "available_memory", lambda: 2**20)
    message = _one_line_error(lambda: XLSTMLanguageModel(XLSTMConfig.from_name("tiny")))
    assert "502,040 parameters: 1.9 MiB in float32, more than the 1.0 MiB" in message
    monkeypatch.setattr(meta, "available_memory", lambda: None)  # unknown: no refusal
    XLSTMLanguageModel(XLSTMConfig.from_name("tiny"))


# ------------------------------------------------------------------------------ hostile JSON
HOSTILE = {
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "nested 200 deep": '{"a": ' * 200 + "1" + "}" * 200,
    "an integer of 5,000 digits": '{"d_model": 1' + "0" * 5000 + "}",
    "an integer of 30 digits": '{"d_model": 1' + "0" * 29 + ', "n_blocks": 1' + "0" * 29 + "}",
    "a list": "[1, 2]",
    "a string": '"config"',
    "null": "null",
    "not UTF-8": b'\xff\xfe{"a": 1}',
    "NaN and Infinity": '{"d_model": NaN, "vocab_size": Infinity, "sha256": NaN, "step": NaN}',
    "wrongly typed fields": '{"d_model": "32", "n_blocks": [1], "name": 5, "sha256": [], "weight_map": 3, '
                            '"format": 1, "step": 1, "train_config": [], "data": 7, "model": "x"}',
    "empty": "",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A checkpoint of ours, a training run and a HuggingFace folder in shards, written once."""
    from xlstm_kit import training as T
    from xlstm_kit.io.checkpoint import save_checkpoint

    root = tmp_path_factory.mktemp("json")
    torch.manual_seed(0)
    ours = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    ours.save(root / "ours", tokenizer="byte")
    cfg = T.TrainConfig(steps=2, batch_size=2, seq_len=8)
    save_checkpoint(root / "run", ours, T.make_optimizer(ours, cfg), 1, cfg, meta={"tokenizer": "byte", "data": "x"})
    large = XLSTMLanguageModel(XLSTMConfig(family="large", vocab_size=64, d_model=32, n_blocks=2, n_heads=2))
    large.save_pretrained(root / "hf", max_shard_size="20KB")
    assert (root / "hf" / "model.safetensors.index.json").is_file()
    return root


def _loaders(root):
    from xlstm_kit.io.checkpoint import read_train_meta, resolve_checkpoint

    run_ckpt = resolve_checkpoint(root / "run")
    return {
        "ours/config.json": [lambda: XLSTMLanguageModel.load(root / "ours"),
                             lambda: XLSTMLanguageModel.from_pretrained(root / "ours")],
        "ours/tokenizer.json": [lambda: XLSTMLanguageModel.load(root / "ours"),
                                lambda: XLSTMLanguageModel.from_pretrained(root / "ours")],
        "ours/checksums.json": [lambda: XLSTMLanguageModel.load(root / "ours"),
                                lambda: XLSTMLanguageModel.from_pretrained(root / "ours")],
        f"run/{run_ckpt.relative_to(root / 'run')}/train_meta.json": [lambda: read_train_meta(run_ckpt)],
        "hf/config.json": [lambda: XLSTMLanguageModel.from_pretrained(root / "hf")],
        "hf/model.safetensors.index.json": [lambda: XLSTMLanguageModel.from_pretrained(root / "hf")],
    }


@pytest.mark.parametrize("content", list(HOSTILE))
def test_hostile_json_in_every_file_we_read(folders, content):
    """Deep, huge or mistyped JSON in any file the loaders read: an XLSTMKitError in one line, or
    (where the file says nothing harmful, e.g. a tokenizer.json without a name) a model; never
    another exception. Nesting, huge integers and bytes that are not UTF-8 are always refused."""
    data = HOSTILE[content]
    must_fail = content in ("nested 100,000 deep", "nested 200 deep", "an integer of 5,000 digits",
                            "an integer of 30 digits", "not UTF-8", "empty")
    for name, calls in _loaders(folders).items():
        f = folders / name
        good = f.read_bytes()
        try:
            f.write_bytes(data if isinstance(data, bytes) else data.encode())
            for call in calls:
                try:
                    call()
                except XLSTMKitError as e:
                    assert "\n" not in str(e) and str(e), (name, str(e))
                else:
                    assert not must_fail, (name, content)
        finally:
            f.write_bytes(good)


@pytest.mark.parametrize("factor", ["qk_dim_factor", "v_dim_factor"])
def test_a_huge_large_family_width_is_refused_by_the_config(factor):
    _one_line_error(lambda: XLSTMConfig(family="large", vocab_size=64, d_model=32, n_blocks=1, n_heads=2,
                                        **{factor: 1e19}))


# ------------------------------------------------------------------------------ metrics.jsonl on resume
DAMAGED_METRICS = {
    "not JSON mid-file": b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n',
    "not UTF-8": b'{"step": 1, "loss": 2.0}\n\xff\xfe\n',
    "a list": b'[1, 2]\n',
    "a string step": b'{"step": "1", "loss": 2.0}\n',
    "a boolean step": b'{"step": true, "loss": 2.0}\n',
    "no step": b'{"loss": 2.0}\n',
    "a text loss": b'{"step": 1, "loss": "low"}\n',
    "deep": b'{"step": 1, "loss": ' + b"[" * 50_000 + b"]" * 50_000 + b"}\n",
    "a huge step": b'{"step": 1' + b"0" * 5000 + b"}\n",
    "a line of 2 MB": b'{"step": 1, "note": "' + b"x" * (2 << 20) + b'"}\n',
}


@pytest.mark.parametrize("damage", list(DAMAGED_METRICS))
def test_damaged_metrics_are_refused_in_one_line(tmp_path, damage):
    from xlstm_kit.training.plots import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_bytes(DAMAGED_METRICS[damage])
    message = _one_line_error(lambda: read_metrics(f, 10))
    assert str(f) in message


def test_a_torn_last_metrics_row_is_dropped_and_resume_goes_on(tmp_path, monkeypatch):
    """A kill while a row was appended leaves it without its newline: resume drops it (and the
    rows after its checkpoint); damage anywhere else stops the resume in one line."""
    from xlstm_kit import training as T
    from xlstm_kit.training.data import load_data
    from xlstm_kit.training.plots import read_metrics

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "c.txt").write_text("some words to learn from\n" * 40)
    data = load_data(str(tmp_path / "c.txt"), "byte")
    cfg = T.TrainConfig(steps=2, batch_size=2, seq_len=8, warmup_steps=0, eval_batches=1, eval_interval=0,
                        checkpoint_interval=1, eval_at_start=False)
    model = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    T.train(model, data, cfg, tmp_path / "run", handle_signals=False)
    metrics = tmp_path / "run" / "metrics.jsonl"
    good = metrics.read_bytes()
    metrics.write_bytes(good + b'{"step": 3, "lo')
    assert read_metrics(metrics, None) == read_metrics(metrics, 2)
    T.train(model, data, T.TrainConfig(**{**cfg.to_dict(), "steps": 3}), tmp_path / "run", resume=True,
            handle_signals=False)
    assert [r["step"] for r in read_metrics(metrics, None) if "loss" in r] == [1, 2, 3]
    metrics.write_bytes(b'{"step": 1, "loss": [1]}\n' + metrics.read_bytes())
    _one_line_error(lambda: T.train(model, data, T.TrainConfig(**{**cfg.to_dict(), "steps": 4}), tmp_path / "run",
                                    resume=True, handle_signals=False))


# ------------------------------------------------------------------------------ generation and training arguments
@pytest.mark.parametrize("kwargs", [
    dict(repetition_penalty=1e-40), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300),
    dict(repetition_penalty=float("nan")), dict(seed=2**64), dict(seed=-1), dict(seed=1.5),
    dict(stop="\ud800"),
])
@pytest.mark.parametrize("prompt", ["tokens", "text"])
def test_absurd_generation_arguments(kwargs, prompt):
    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    model.tokenizer_name = "byte"
    if prompt == "tokens" and "stop" in kwargs:
        kwargs = {**kwargs, "tokenizer": model.tokenizer}
    _one_line_error(lambda: model.generate("ab" if prompt == "text" else [torch.tensor([1, 2])], 3, temperature=1.0,
                                           **kwargs))


@pytest.mark.parametrize("text", ["ab\ud800", "\udcff", "x\udfff\ud800y"])
def test_prompts_that_are_not_text(text):
    from xlstm_kit.generation import generate as gen
    from xlstm_kit.io.tokenizers import get_tokenizer

    torch.manual_seed(0)
    model = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    model.tokenizer_name = "byte"
    assert "lone surrogate" in _one_line_error(lambda: model.generate(text, 2))
    _one_line_error(lambda: model.generate(["fine", text], 2))
    _one_line_error(lambda: gen.complete_texts(model, get_tokenizer("byte"), [text], 2))
    assert model.generate("ab", 2, repetition_penalty=1e6, seed=2**64 - 1).startswith("ab")  # the edges work


@pytest.mark.parametrize("kwargs", [dict(seed=2**64), dict(seed=-1), dict(seed="1"), dict(lr=1e308),
                                    dict(lr=1e-3, min_lr=1e-2)])
def test_absurd_training_arguments(kwargs):
    from xlstm_kit.training import TrainConfig

    _one_line_error(lambda: TrainConfig(**kwargs))


# ------------------------------------------------------------------------------ devices and dtypes
@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:99", "xla", "tpu", 3.5, "mps:7"])
def test_impossible_devices(small, tmp_path, device):
    if torch.cuda.is_available() and device == "cuda":
        pytest.skip("this machine has CUDA")
    small.save(tmp_path / "m")
    for load in (XLSTMLanguageModel.load, lambda p, device: XLSTMLanguageModel.from_pretrained(p, device=device)):
        _one_line_error(lambda: load(tmp_path / "m", device=device))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.complex64, "nonsense",
                                   "float8_e4m3fn", 5])
def test_unsupported_dtypes(small, tmp_path, dtype):
    small.save(tmp_path / "m")
    _one_line_error(lambda: XLSTMLanguageModel.from_pretrained(tmp_path / "m", dtype=dtype))


# ------------------------------------------------------------------------------ missing weights, unknown tokenizer
def test_a_folder_without_weights(small, tmp_path):
    small.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").unlink()
    for load in (XLSTMLanguageModel.from_pretrained, XLSTMLanguageModel.load):
        with pytest.raises(XLSTMKitError) as info:
            load(tmp_path / "hf")
        assert isinstance(info.value, FileNotFoundError)  # what it was before it was the library's error
    with pytest.raises(FileNotFoundError):
        XLSTMLanguageModel.from_pretrained(tmp_path / "missing")


def test_a_model_without_tokenizer_has_no_tokenizer_attribute():
    model = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    assert getattr(model, "tokenizer", None) is None and not hasattr(model, "tokenizer")
    assert "does not know its tokenizer" in _one_line_error(lambda: model.tokenizer)
    assert "does not know its tokenizer" in _one_line_error(lambda: model.generate("x", 1))
    model.tokenizer_name = "byte"
    assert model.tokenizer.name == "byte"
    model.embedding  # nn.Module's own attributes still resolve  # noqa: B018


# ------------------------------------------------------------------------------ the command line
@pytest.mark.parametrize("argv", [
    ["bench", "--device", "tpu", "--list"],
    ["bench", "--threads", "0", "--list"],
    ["train", "--lr", "1e308"],
    ["train", "--lr", "1e-4", "--min-lr", "1e-3"],
    ["train", "--batch-size", "6", "--grad-accum", "4"],
    ["train", "--seed", str(2**64)],
    ["generate", "MODEL", "--repetition-penalty", "1e-40"],
    ["generate", "MODEL", "--seed", str(2**64)],
    ["generate", "MODEL", "--prompt", "ab\udcff"],
    ["generate", "MODEL", "--stop", "\ud800"],
    ["train", "--pack", "--data", "TEXT"],
])
def test_cli_refusals_speak_flags(tmp_path, monkeypatch, capsys, argv):
    from xlstm_kit.cli import app

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2)).save(tmp_path / "m", tokenizer="byte")
    (tmp_path / "t.txt").write_text("one text, no documents\n" * 50)
    argv = [str(tmp_path / "m") if a == "MODEL" else str(tmp_path / "t.txt") if a == "TEXT" else a for a in argv]
    if argv[0] == "train":  # small and fast where nothing is wrong; the case's own options come last and win
        argv = ["train", "--out", str(tmp_path / "run"), "--device", "cpu", "--steps", "2", "--batch-size", "2",
                "--seq-len", "8", *argv[1:]]
    try:
        code = app.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, (argv, err)
    assert "TrainConfig" not in err[0] and "pack=True" not in err[0] and "documents=True" not in err[0], err[0]
    assert "_" not in err[0].split("error:")[1].replace(str(tmp_path), ""), err[0]  # no Python names


def test_resume_of_a_run_that_records_no_data(tmp_path, monkeypatch, capsys):
    from xlstm_kit import training as T
    from xlstm_kit.cli import app
    from xlstm_kit.io.checkpoint import save_checkpoint

    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    model = XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2))
    cfg = T.TrainConfig(steps=2, batch_size=2, seq_len=8)
    save_checkpoint(tmp_path / "run", model, T.make_optimizer(model, cfg), 1, cfg, meta={"tokenizer": "byte"})
    assert app.main(["train", "--out", str(tmp_path / "run"), "--resume", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not record the data" in err[0], err


def test_a_subclass_with_its_own_arguments_is_still_sized():
    class Scaled(XLSTMLanguageModel):
        def __init__(self, config, scale):
            super().__init__(config)
            self.scale = scale

    assert Scaled(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2), 2.0).scale == 2.0
