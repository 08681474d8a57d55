"""Seeded fuzz of the command line and the model API: every bad invocation ends with
exit status 2 and one stderr line, every bad model call with an XLSTMKitError; never a traceback.

The cases are drawn from fixed pools with a fixed seed, so a failure reproduces; all run
in-process (cli.main) and refuse before any training starts, so the file takes seconds."""
import random

import pytest
import torch

from xlstm_kit.cli import app as cli
from xlstm_kit.errors import XLSTMKitError
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

SEED = 14
BAD_INTS = ["0", "-1", "ten", "1.5", "", "1e3", "nan", "99999999999999999999999x"]
BAD_FLOATS = ["-1", "nan", "inf", "-inf", "x", "", "1e999"]
BAD_DEVICES = ["meta", "cuda:99", "cpu:7", "xla", "gpu", "nonsense", "cuda:-1", "mps:3"]


@pytest.fixture
def places(tmp_path, monkeypatch):
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("a small corpus of words\n" * 30)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    bindir = tmp_path / "bindir"
    bindir.mkdir()
    (bindir / "blob.bin").write_bytes(bytes(range(256)))
    afile = tmp_path / "afile"
    afile.write_text("x")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    model_dir = tmp_path / "model"
    torch.manual_seed(0)
    XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=1, n_heads=2)).save(model_dir, tokenizer="byte")
    return dict(text=text, binary=binary, bindir=bindir, afile=afile, empty=empty, model=model_dir, tmp=tmp_path)


def _cases(p, rng):
    """(argv, expected exit status 2) invocations: each picks its bad part at random."""
    t, m, tmp = str(p["text"]), str(p["model"]), p["tmp"]
    good_train = ["train", "--data", t, "--steps", "1", "--batch-size", "2", "--seq-len", "8",
                  "--device", "cpu", "--no-progress"]
    cases = []
    for flag in ("--steps", "--batch-size", "--seq-len", "--grad-accum", "--threads"):
        cases.append(good_train + ["--out", str(tmp / "o"), flag, rng.choice(BAD_INTS)])
    for flag in ("--lr", "--min-lr", "--weight-decay", "--grad-clip", "--val-fraction"):
        cases.append(good_train + ["--out", str(tmp / "o"), flag, rng.choice(BAD_FLOATS)])
    cases.append(good_train + ["--out", str(tmp / "o"), "--val-fraction", rng.choice(["1", "2.5", "1e9"])])
    for _ in range(4):
        cases.append(good_train + ["--out", str(tmp / "o"), "--device", rng.choice(BAD_DEVICES)])
    for data in (p["binary"], p["empty"], tmp / "missing.txt", tmp / "nofolder" / "x", p["bindir"]):
        cases.append(["train", "--data", str(data), "--out", str(tmp / "o"), "--device", "cpu", "--steps", "1"])
    for out in (p["afile"], p["afile"] / "below", p["afile"] / "a" / "b"):
        cases.append(good_train + ["--out", str(out)])
        cases.append(["demo", "--out", str(out), "--device", "cpu", "--minutes", "0.01"])
    cases.append(good_train + ["--out", str(tmp / "o"), "--preset", rng.choice(["huge", "", "TINY2"])])
    cases.append(good_train + ["--out", str(tmp / "o"), "--tokenizer", rng.choice(["sp", "", "bytes"])])
    cases.append(good_train + ["--out", str(tmp / "o"), "--resume", "--overwrite"])
    cases.append(good_train + ["--out", str(tmp / "fresh"), "--resume"])
    gen = ["generate", m, "--device", "cpu", "--max-new-tokens", "2"]
    cases.append(gen + ["--temperature", rng.choice(BAD_FLOATS)])
    cases.append(gen + ["--top-p", rng.choice(["0", "1.5", "-0.1", "nan"])])
    cases.append(gen + ["--top-k", rng.choice(BAD_INTS)])
    cases.append(gen + ["--max-new-tokens", rng.choice(["-1", "x", "2.5"])])
    cases.append(gen + ["--device", rng.choice(BAD_DEVICES)])
    for where in (p["afile"], p["binary"], tmp / "missing", tmp):
        cases.append(["generate", str(where), "--device", "cpu"])
        cases.append(["eval", str(where), "--device", "cpu"])
    cases.append(["eval", m, "--device", "cpu", "--data", str(p["binary"])])
    cases.append(["eval", m, "--device", "cpu", "--batch-size", rng.choice(BAD_INTS)])
    cases.append(["experiment", "sweep", "--report-only", "--out", str(tmp / "no-sweep")])
    cases.append(["experiment", "formal", "--task", "parity", "--model", "xlstm[0:1]", "--device", "cpu",
                  "--out", str(rng.choice([p["afile"], p["afile"] / "x"]))])
    cases.append(["experiment", "mqar", "--model", "xlstm[1:0]", "--device", rng.choice(BAD_DEVICES)])
    cases.append(["demo", "--minutes", rng.choice(BAD_FLOATS)])
    cases.append([rng.choice(["trian", "", "--nope"])])
    return cases


def test_fuzz_bad_invocations_exit_2_in_one_line(places, capsys):
    rng = random.Random(SEED)
    cases = _cases(places, rng)
    assert len(cases) >= 40
    for argv in cases:
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert code == 2, (" ".join(argv[-4:]), code, err[-200:])
        assert len(lines) == 1 and "Traceback" not in err and "error" in lines[0], (argv, err)
    assert places["afile"].read_text() == "x"  # nothing it was pointed at was touched


def _api_cases(rng):
    """Model-API calls that must raise XLSTMKitError (and never anything else)."""
    model = XLSTMLanguageModel(XLSTMConfig(vocab_size=200, d_model=32, n_blocks=1, n_heads=2))
    calls = []
    for field, value in (("vocab_size", 2**40), ("vocab_size", 0), ("vocab_size", 1.5), ("d_model", 2**20),
                         ("n_heads", -1), ("n_blocks", True), ("dropout", 1.0), ("chunk_size", 4096),
                         ("backend", "cuda"), ("slstm_at", "x:y")):
        calls.append((f"config {field}={value!r}", lambda f=field, v=value: XLSTMConfig(**{f: v})))
    for _ in range(8):
        dtype = rng.choice([torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8])
        hi = torch.iinfo(dtype).max
        bad = rng.choice([v for v in (-1, -100, 200, 255, 999, hi) if torch.iinfo(dtype).min <= v <= hi and not 0 <= v < 200])
        tokens = torch.tensor([[1, bad]], dtype=dtype)
        calls.append((f"forward {dtype} id {bad}", lambda x=tokens: model(x)))
        calls.append((f"generate {dtype} id {bad}", lambda x=tokens: model.generate(x[0], rng.choice([0, 2]))))
    for dtype in (torch.float32, torch.bool, torch.uint16, torch.uint32, torch.complex64):
        calls.append((f"forward {dtype}", lambda d=dtype: model(torch.ones(1, 2, dtype=d))))
        calls.append((f"generate {dtype}", lambda d=dtype: model.generate(torch.ones(2, dtype=d), 1)))
    bad_kwargs = [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                  dict(top_k=0), dict(top_p=0.0), dict(top_p=1.5), dict(eos_token_id=200), dict(eos_token_id=-1)]
    for kw in bad_kwargs:
        calls.append((f"generate {kw}", lambda kw=kw: model.generate(torch.tensor([1, 2]), 2, **kw)))
    for n in (-1, 1.5, True):
        calls.append((f"generate max_new_tokens={n!r}", lambda n=n: model.generate(torch.tensor([1]), n)))
    calls.append(("generate empty prompt", lambda: model.generate(torch.zeros(0, dtype=torch.long), 1)))
    calls.append(("generate 3-d prompt", lambda: model.generate(torch.zeros(1, 1, 1, dtype=torch.long), 1)))
    calls.append(("step wrong rank", lambda: model.step(torch.tensor([[1]]))))
    return model, calls


def test_fuzz_model_api_raises_the_library_error():
    rng = random.Random(SEED)
    model, calls = _api_cases(rng)
    assert len(calls) >= 40
    for what, call in calls:
        with pytest.raises(XLSTMKitError):
            call()
    # and the good neighbours of those calls work, with ids that never wrap
    out = model.generate(torch.tensor([1, 199], dtype=torch.uint8), 3, temperature=1e-45)
    assert out.dtype == torch.uint8 and int(out.max()) < 200
    assert torch.equal(out, model.generate(torch.tensor([1, 199]), 3, temperature=0).to(torch.uint8))
    out = model.generate(torch.tensor([1, 2], dtype=torch.int8), 3, temperature=0.7,
                         generator=torch.Generator().manual_seed(SEED))
    assert out.dtype == torch.int64 and 0 <= int(out.min()) and int(out.max()) < 200  # int8 cannot hold 199
