"""The xlstm-kit command line: end to end through real processes (train, then generate), the
other commands in-process, and one-line errors with exit status 2 for bad input."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xlstm_kit.cli import app as cli
from xlstm_kit.cli import train as cli_train
from xlstm_kit.training import TRAIN_META_FILE, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
# Tiny sizes: the "tiny" preset on a few short sequences, so a run takes seconds.
FAST = ["--batch-size", "2", "--seq-len", "32", "--eval-batches", "1", "--no-progress"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(d))
    return d


def run_cli(*args, cache_dir):
    env = {**os.environ, "XLSTM_KIT_CACHE": str(cache_dir), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "xlstm_kit", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short training run through the real command line, shared by the tests below."""
    base = tmp_path_factory.mktemp("cli")
    out = base / "run"
    proc = run_cli("train", "--steps", "3", "--out", str(out), *FAST, cache_dir=base / "cache")
    assert proc.returncode == 0, proc.stderr
    return out, proc


def test_train_then_generate_prints_text(trained, tmp_path):
    out, proc = trained
    assert "val loss" in proc.stderr and "done: step 3" in proc.stderr
    assert "1 of " in proc.stderr and "validation batches" in proc.stderr  # the log says how much it validated
    assert "Traceback" not in proc.stderr
    assert resolve_checkpoint(out).name == "step-00000003"
    meta = json.loads((resolve_checkpoint(out) / TRAIN_META_FILE).read_text())
    assert meta["preset"] == "tiny" and meta["tokenizer"] == "byte" and meta["data"] == "builtin:shakespeare"
    gen = run_cli("generate", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "40", "--seed", "0",
                  cache_dir=tmp_path)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:")
    assert len(gen.stdout.rstrip("\n").encode()) >= len("ROMEO:") + 30  # ~40 new bytes (a few may merge)


def test_generate_is_seeded_and_eval_prints_metrics(trained, cache, capsys):
    out, _ = trained
    texts = []
    for _ in range(2):
        assert cli.main(["generate", str(out), "--prompt", "JULIET:", "--max-new-tokens", "20",
                         "--seed", "3", "--top-k", "5"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("JULIET:")
    greedy = cli.main(["generate", str(out), "--prompt", "JULIET:", "--max-new-tokens", "20", "--temperature", "0"])
    assert greedy == 0 and capsys.readouterr().out.startswith("JULIET:")
    assert cli.main(["eval", str(out), "--eval-batches", "1", "--batch-size", "2"]) == 0
    line = capsys.readouterr().out
    assert "val loss" in line and "bits/byte" in line and "perplexity" in line
    assert "1 of " in line and "validation batches, 64 tokens" in line


def test_eval_default_is_the_whole_split_when_small(trained, cache, tmp_path, capsys, monkeypatch):
    out, _ = trained
    small = tmp_path / "small.txt"
    small.write_text("To be, or not to be, that is the question.\n" * 60)  # 2,640 bytes: val split 264
    assert cli.main(["eval", str(out), "--data", str(small), "--batch-size", "2"]) == 0
    assert "(all 4 validation batches, 256 tokens" in capsys.readouterr().out  # 8 windows of 32
    monkeypatch.setattr(cli_train, "EVAL_WHOLE_SPLIT_UP_TO", 3)  # a larger split: the first batches only
    assert cli.main(["eval", str(out), "--data", str(small), "--batch-size", "1"]) == 0
    assert "(3 of 8 validation batches" in capsys.readouterr().out


def test_train_without_matplotlib_ends_with_a_note(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["train", "--steps", "1", "--out", str(tmp_path / "r"), *FAST]) == 0
    err = capsys.readouterr().err
    assert "loss plot skipped: matplotlib is not installed" in err and "Traceback" not in err
    assert resolve_checkpoint(tmp_path / "r").name == "step-00000001"


def test_resume_continues_and_refuses_clobbering(trained, cache, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    # Without --resume an existing run is not overwritten.
    assert cli.main(["train", "--steps", "5", "--out", str(out), *FAST]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main(["train", "--steps", "5", "--out", str(out), "--resume", "--no-progress"]) == 0
    assert "schedule continues" in capsys.readouterr().err
    assert resolve_checkpoint(out).name == "step-00000005"
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))  # the 3-step run had decayed: no jump back up
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--seq-len", "64"]) == 2
    assert "cannot change" in capsys.readouterr().err
    # the command line refuses what the library refuses (RESUME_FROZEN), before loading anything
    for flag in (["--grad-accum", "2"], ["--no-pack"], ["--seed", "7"]):
        assert cli.main(["train", "--out", str(out), "--resume", *flag]) == 2
        assert f"{flag[0].replace('no-', '')} cannot change on --resume" in capsys.readouterr().err


def _assert_one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err and "error" in lines[0]
    for n in needles:
        assert n in lines[0], lines[0]


def _main_code(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse errors exit through SystemExit
        return e.code


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["train", "--preset", "gigantic"], "unknown preset"),
        (["train", "--tokenizer", "sentencepiece"], "unknown tokenizer"),
        (["train", "--data", "/nonexistent/corpus.txt"], "does not exist"),
        (["train", "--steps", "0"], "positive integer"),
        (["train", "--steps", "ten"], "positive integer"),
        (["train", "--lr", "-1"], "--lr"),
        (["generate"], "required"),
        (["generate", "/nonexistent/run", "--prompt", "x"], "does not exist"),
        (["eval", "/nonexistent/run"], "does not exist"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_input_one_line_exit_2(argv, needle, cache, tmp_path, capsys):
    argv = [a.replace("/nonexistent", str(tmp_path / "nonexistent")) for a in argv]
    if argv[0] == "train":
        argv += ["--out", str(tmp_path / "out")]
    _assert_one_line_error(capsys, _main_code(argv), needle)
    assert not (tmp_path / "out" / "latest").exists()


def test_empty_corpus_and_empty_folder(cache, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    _assert_one_line_error(capsys, cli.main(["train", "--data", str(empty), "--out", str(tmp_path / "o")]), "empty")
    (tmp_path / "nothing").mkdir()
    _assert_one_line_error(capsys, cli.main(["train", "--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]),
                           "no text files")


def test_resume_without_checkpoint(cache, tmp_path, capsys):
    _assert_one_line_error(capsys, cli.main(["train", "--resume", "--out", str(tmp_path / "fresh")]), "does not exist")


def test_checkpoint_from_another_version(trained, cache, tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained[0], out)
    ckpt = resolve_checkpoint(out)
    meta = json.loads((ckpt / TRAIN_META_FILE).read_text())
    meta["format"] = 99
    (ckpt / TRAIN_META_FILE).write_text(json.dumps(meta))
    for argv in (["generate", str(out)], ["eval", str(out)], ["train", "--out", str(out), "--resume", "--steps", "9"]):
        _assert_one_line_error(capsys, cli.main(argv), "format 99")
    # A model config with fields this version does not know (a newer model format).
    shutil.rmtree(out)
    shutil.copytree(trained[0], out)
    cfg_file = resolve_checkpoint(out) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["rotary_embedding"] = True
    cfg_file.write_text(json.dumps(cfg))
    _assert_one_line_error(capsys, cli.main(["generate", str(out)]), "rotary_embedding")


def test_bad_input_in_a_real_process(tmp_path):
    proc = run_cli("train", "--preset", "gigantic", "--out", str(tmp_path / "o"), cache_dir=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown preset" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_help_lists_commands_and_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for word in ("train", "generate", "eval", "demo", "torchrun"):
        assert word in text
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    text = capsys.readouterr().out
    for opt in ("--preset", "--data", "--tokenizer", "--steps", "--out", "--resume", "--grad-accum"):
        assert opt in text


def test_ctrl_c_saves_a_resumable_checkpoint(cache, tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    env = {**os.environ, "XLSTM_KIT_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "xlstm_kit", "train", "--steps", "100000", "--out", str(out),
                             "--checkpoint-interval", "0", "--eval-interval", "0", *FAST],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        metrics = out / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and '"loss"' in metrics.read_text():
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted at step" in err and "--resume" in err and "Traceback" not in err
    ckpt = resolve_checkpoint(out)
    step = json.loads((ckpt / TRAIN_META_FILE).read_text())["step"]
    assert step >= 1
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", str(step + 1), "--no-progress"]) == 0
    assert resolve_checkpoint(out).name == f"step-{step + 1:08d}"


def test_a_closed_pipe_ends_the_output_quietly():
    """`xlstm-kit bench --list | head -1` ended in a BrokenPipeError traceback."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "xlstm_kit", "bench", "--list", "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 141) and first
    assert "Traceback" not in err and "BrokenPipe" not in err, err
