"""How fast the command line answers: a mistyped argument, name or path is refused before torch is
imported (it cost 3-7 s), and loading a model for `generate` imports neither torch._dynamo nor
sympy (2.8 s and 1.4 s of its 5 s of imports)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xlstm_kit.cli import args as cli_args
from xlstm_kit.io.tokenizers import TOKENIZERS
from xlstm_kit import XLSTMConfig, XLSTMLanguageModel
from xlstm_kit.models import PRESETS
from xlstm_kit.models.meta import shapes_only
from xlstm_kit.ops import backend

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_mistakes_are_answered_before_torch_is_imported(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    t = str(tmp_path)
    cases = [
        ["train", "--bogus"],
        ["train", "--preset", "tyni"],
        ["train", "--tokenizer", "gtp2"],
        ["train", "--device", "cdua"],
        ["train", "--device", "meta"],
        ["train", "--data", f"{t}/missing.txt"],
        ["train", "--init-from", f"{t}/missing"],
        ["train", "--out", f"{t}/afile/run"],
        ["train", "--out", f"{t}/dangling"],
        ["train", "--out", f"{t}/{'x' * 300}"],
        ["generate", f"{t}/missing", "--prompt", "x"],
        ["generate", t, "--prompts", f"{t}/missing.txt"],
        ["generate", t, "--prompts", f"{t}/afile", "--output", f"{t}/dangling"],
        ["eval", f"{t}/missing"],
        ["demo", "--out", f"{t}/afile"],
        ["bench", "--out", f"{t}/afile"],
        ["experiment", "mqar", "--model", "lstm", "--device", "tpu"],
    ]
    proc = _python(f"""
import contextlib, io, sys
from xlstm_kit.cli import main
for argv in {cases!r}:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "error" in lines[0], (argv, code, lines)
    print(lines[0])
assert "torch" not in sys.modules, "torch was imported"
""")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "unknown preset 'tyni'" in out and "unknown device 'cdua'" in out and "unknown tokenizer 'gtp2'" in out
    assert f"{t}/afile is a file, not a folder" in out and "is a symbolic link to" in out
    assert "300 bytes long" in out and f"the folder {t}/missing does not exist" in out


def test_the_cli_knows_the_library_names():
    assert set(cli_args.PRESET_KEYS) == set(PRESETS)
    assert tuple(cli_args.TOKENIZER_NAMES) == tuple(TOKENIZERS)
    for key in PRESETS:  # each name the parser accepts is one the library reads
        assert cli_args.preset_name(key.upper()) == key.upper()
        XLSTMConfig.from_name(key.upper())
    assert cli_args.preset_name("xlstm-7b") == "xlstm-7b"
    from xlstm_kit.cli import parsers
    from xlstm_kit.generation import sampling

    assert parsers.MAX_REPETITION_PENALTY == sampling.MAX_REPETITION_PENALTY


def test_loading_and_generating_import_neither_dynamo_nor_sympy(tmp_path):
    torch.manual_seed(0)
    XLSTMLanguageModel(XLSTMConfig(d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], dplr_at=[2])).save(
        tmp_path / "m", tokenizer="byte")
    proc = _python(f"""
import sys
from xlstm_kit.cli import main
assert main(["generate", {str(tmp_path / "m")!r}, "--device", "cpu", "--max-new-tokens", "3", "--prompt", "hi"]) == 0
heavy = [m for m in ("torch._dynamo", "sympy") if m in sys.modules]
assert not heavy, heavy
""")
    assert proc.returncode == 0, proc.stderr


def test_the_constant_mark_is_dynamos():
    """ops.backend marks a function as torch.compiler.assume_constant_result does, without
    importing torch._dynamo; this holds the two equal as torch changes."""
    import torch._dynamo  # noqa: F401

    def ours():
        return 1

    def theirs():
        return 1

    saved = sys.modules.pop("torch._dynamo")
    try:
        backend.assume_constant_result(ours)
    finally:
        sys.modules["torch._dynamo"] = saved
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours)


@pytest.mark.parametrize("config", [
    XLSTMConfig.from_name("tiny"),
    XLSTMConfig(d_model=32, n_blocks=3, n_heads=2, slstm_at=[1], dplr_at=[2], tie_embeddings=True),
    XLSTMConfig(family="large", vocab_size=64, d_model=64, n_blocks=2, n_heads=2),
])
def test_shapes_only_builds_the_model_without_values(config):
    with shapes_only():
        meta = XLSTMLanguageModel(config)
    real = XLSTMLanguageModel(config)
    assert all(t.is_meta for t in meta.state_dict().values())
    assert {k: t.shape for k, t in meta.state_dict().items()} == {k: t.shape for k, t in real.state_dict().items()}
    assert torch.linspace(0, 1, 3).device.type == "cpu"  # nothing of the mode is left behind
