"""The command line on the resources of a machine: CPU threads (--threads and a load-aware
default), a memory estimate that refuses runs that cannot fit in one line, corpus files that are
skipped and listed, a clean Ctrl-C, and --help without importing torch."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from xlstm_kit.cli import app as cli
from xlstm_kit.training import resources
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("XLSTM_KIT_CACHE", str(d))
    return d


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    path = tmp_path / "model"
    XLSTMLanguageModel(XLSTMConfig.from_name("tiny")).save(path)
    return path


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    (d / "a.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    (d / "b.txt").write_text("Whether 'tis nobler in the mind to suffer.\n" * 40)
    (d / "legacy.txt").write_bytes("Ophelia, nymph, in thy orisons caf\xe9\n".encode("latin-1") * 20)
    return d


# ------------------------------------------------------------------------------------ threads


@pytest.mark.parametrize(
    "cpus,load,torch_default,expected",
    [
        (2, 0.1, 2, 2),    # idle: torch's choice
        (2, 1.0, 2, 1),    # one core busy elsewhere: the case that ran 10x slower with 2 threads
        (2, 3.7, 2, 1),    # overloaded: never below 1
        (16, 4.2, 16, 12),
        (16, 0.0, 8, 8),   # never above torch's choice (affinity, physical cores)
    ],
)
def test_auto_threads(cpus, load, torch_default, expected):
    assert resources.auto_threads(cpus, load, torch_default) == expected


def test_default_threads_follows_load_and_keeps_omp_num_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(os, "getloadavg", lambda: (3.2, 1.0, 1.0))
    assert resources.default_threads(4) == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (0.3, 1.0, 1.0))
    assert resources.default_threads(4) == 4
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert resources.default_threads(4) is None


def test_threads_option_and_busy_default_in_generate_and_eval(model_dir, corpus, cache, monkeypatch,
                                                              keep_threads, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    gen = ["generate", str(model_dir), "--prompt", "To be", "--max-new-tokens", "3", "--device", "cpu", "--seed", "0"]
    assert cli.main(gen + ["--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.9, 1.0, 1.0))  # another process on one core
    assert cli.main(gen) == 0
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cli.main(["eval", str(model_dir), "--data", str(corpus), "--seq-len", "16", "--batch-size", "2",
                     "--eval-batches", "1", "--device", "cpu", "--threads", "1"]) == 0
    assert torch.get_num_threads() == 1
    err = capsys.readouterr().err
    # The folder's latin-1 file is left out, and said so.
    assert "skipped 1 file that is not UTF-8 text:" in err and "legacy.txt" in err


def test_train_states_threads_and_skipped_files(corpus, cache, tmp_path, monkeypatch, keep_threads, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    torch.set_num_threads(2)
    code = cli.main(["train", "--data", str(corpus), "--steps", "1", "--batch-size", "2", "--seq-len", "16",
                     "--eval-batches", "1", "--no-progress", "--device", "cpu", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "1 thread (other processes keep the cores busy" in err
    assert re.search(r"skipped 1 file that is not UTF-8 text: \S*legacy\.txt", err)
    assert torch.get_num_threads() == 1


# ------------------------------------------------------------------------------------- memory


def test_largest_batch():
    assert resources.largest_batch(lambda b: 10 * b, 35, 32) == 3
    assert resources.largest_batch(lambda b: 10 * b, 5, 32) == 0
    assert resources.largest_batch(lambda b: 10 * b, 10**9, 32) == 31


def test_memory_estimate_against_a_measured_training_step(tmp_path):
    """The estimate of a small CPU training step, weights to logits, is within a factor of two
    of the memory the step really adds to the process: the peak resident memory (VmHWM, reset
    after the imports) minus the resident memory after the imports. The whole process's peak
    varied from 0.6 to 1.6 GiB with the runner's environment, so the fixed base is left out.
    Linux only (/proc), as CI is."""
    b, t = 16, 128
    script = textwrap.dedent(f"""
        import torch
        from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
        from xlstm_kit.training import TrainConfig, make_optimizer, lm_loss
        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
        torch.set_num_threads(1)
        with open("/proc/self/clear_refs", "w") as fh:  # "5": the peak (VmHWM) restarts from here
            fh.write("5")
        base = status("VmRSS")
        cfg = XLSTMConfig.from_name("tiny", vocab_size=2048)
        model = XLSTMLanguageModel(cfg)
        opt = make_optimizer(model, TrainConfig(steps=2))
        x = torch.randint(0, 2048, ({b}, {t + 1}))
        for _ in range(2):
            lm_loss(model(x[:, :-1]), x[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        print(status("VmHWM") - base)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    measured = int(proc.stdout.split()[-1])
    cfg = XLSTMConfig.from_name("tiny", vocab_size=2048)
    estimate = resources.training_bytes(cfg, resources.count_parameters(cfg), b, t) - resources._BASE_BYTES
    assert measured / 2 < estimate < 2 * measured, (estimate / GIB, measured / GIB)


def test_count_parameters_matches_the_model():
    cfg = XLSTMConfig.from_name("tiny", vocab_size=300)
    assert resources.count_parameters(cfg) == sum(p.numel() for p in XLSTMLanguageModel(cfg).parameters())


def test_train_that_cannot_fit_is_refused_in_one_line(tmp_path, cache, monkeypatch, capsys):
    monkeypatch.setattr(resources, "available_memory", lambda: 16 * GIB)
    out = tmp_path / "run"
    code = cli.main(["train", "--preset", "125M", "--steps", "5", "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "memory" in err and "16.0 GiB is available" in err and "GPU" in err
    assert not out.exists()  # refused before any data, model or folder
    # The batch it suggests fits; one more would not.
    suggested = int(re.search(r"--batch-size (\d+)", err).group(1))
    accum = int(re.search(r"--grad-accum (\d+)", err).group(1))
    cfg = XLSTMConfig.from_name("125M", vocab_size=256)
    n = resources.count_parameters(cfg)
    assert resources.training_bytes(cfg, n, suggested, 2048) <= 16 * GIB < resources.training_bytes(cfg, n, suggested + 1, 2048)
    assert 32 % accum == 0 and 32 // accum <= suggested


def test_eval_that_cannot_fit_is_refused_in_one_line(model_dir, corpus, cache, monkeypatch, capsys):
    monkeypatch.setattr(resources, "available_memory", lambda: GIB // 4)  # below the fixed overhead
    code = cli.main(["eval", str(model_dir), "--data", str(corpus), "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "--seq-len" in err, err


# ------------------------------------------------------------------------ Ctrl-C and --help


def test_cli_module_is_light_and_help_lists_threads():
    """Importing xlstm_kit.cli imports no torch, so that a Ctrl-C while torch is being imported
    later is inside main()'s handler; --help of each command lists --threads."""
    script = ("import sys\nfrom xlstm_kit import cli\nprint('torch' in sys.modules)\n"
              "for argv in ([], ['train'], ['eval'], ['generate']):\n"
              "    try:\n        cli.main(argv + ['--help'])\n    except SystemExit as e:\n        assert e.code == 0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == "False"
    for command in ("train", "eval", "generate"):
        assert "--threads" in proc.stdout.split(f"usage: xlstm-kit {command}")[1].split("usage:")[0]


@pytest.mark.parametrize("module", ["xlstm_kit.cli", "torch"])  # in __main__'s import, in main()'s
def test_early_ctrl_c_is_one_line(model_dir, tmp_path, module):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XLSTM_KIT_CACHE": str(tmp_path / "cache")}
    # Ctrl-C while `python -m xlstm_kit` imports `module`: the child signals itself from an
    # import hook (a fixed sleep raced with interpreter start-up on a loaded machine)
    interrupt_at_torch = (
        "import os, runpy, signal, sys\n"
        # as in a terminal: tests run as a background job (nohup, `cmd &` in a script) inherit
        # SIGINT ignored, and an ignored signal stays ignored across exec
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "class Hook:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name == {module!r}:\n"
        "            sys.meta_path.remove(self)\n"
        "            os.kill(os.getpid(), signal.SIGINT)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Hook())\n"
        "sys.argv = ['xlstm-kit'] + sys.argv[1:]\n"
        "runpy.run_module('xlstm_kit', run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", interrupt_at_torch, "eval", str(model_dir), "--device", "cpu"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    # (the command is named once the parser is built; building it may import torch)
    assert re.fullmatch(r"xlstm-kit( eval)?: interrupted\n", err) and out == "", err
