"""The code blocks of README.md and docs/*.md run as pasted, on a CPU.

README's ```python and ```bash blocks run in document order, in one namespace and one temporary
folder, as a user pasting them one after the other would (bash blocks: every command line starts
with `xlstm-kit` and runs as `python -m xlstm_kit ...`). Each docs/*.md file gets its own
namespace and folder. A block preceded by an HTML comment `<!-- skip: REASON -->` (a GPU,
downloaded weights, installing packages) is not run; the reason is shown when pytest lists
skips. Any other block that fails, fails the test.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(?:<!--\s*skip:\s*(?P<skip>.*?)\s*-->\s*\n)?^```(?P<lang>[a-z]*)\n(?P<code>.*?)^```",
                    re.M | re.S)


def blocks(path: Path) -> list[tuple[str, str, str | None, int]]:
    """(language, code, skip reason or None, line) of each fenced python/bash block of `path`."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _BLOCK.finditer(text):
        if m["lang"] in ("python", "bash"):
            out.append((m["lang"], m["code"], m["skip"], text.count("\n", 0, m.start("code")) + 1))
    return out


def _commands(code: str) -> list[str]:
    """The command lines of a bash block (continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", code)
    cmds = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            cmds.append(line)
    return cmds


def _run_bash(code: str, where: str, cwd: Path, env: dict) -> None:
    for cmd in _commands(code):
        args = shlex.split(cmd, comments=True)
        assert args[0] == "xlstm-kit", (f"{where}: a bash block that runs must hold only xlstm-kit commands "
                                        f"(mark others <!-- skip: reason -->): {cmd!r}")
        proc = subprocess.run([sys.executable, "-m", "xlstm_kit", *args[1:]], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{where}: {cmd!r} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"


def _run_python(code: str, where: str, namespace: dict) -> None:
    try:
        exec(compile(code, where, "exec"), namespace)
    except Exception as e:  # noqa: BLE001 — report which block broke
        raise AssertionError(f"{where} failed: {type(e).__name__}: {e}") from e


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    found = blocks(path)
    runnable = [b for b in found if b[2] is None]
    if not runnable:
        pytest.skip(f"{path.name}: no runnable blocks")
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "XLSTM_KIT_CACHE": str(tmp_path / ".cache"), "CUDA_VISIBLE_DEVICES": ""}
    monkeypatch.setenv("XLSTM_KIT_CACHE", env["XLSTM_KIT_CACHE"])
    namespace: dict = {"__name__": "__doc_example__"}
    skipped = []
    for lang, code, skip, line in found:
        where = f"{path.relative_to(ROOT)}:{line}"
        if skip is not None:
            skipped.append(f"{where} ({skip})")
            continue
        if lang == "python":
            _run_python(code, where, namespace)
        else:
            _run_bash(code, where, tmp_path, env)
    if skipped:
        print("skipped blocks:", *skipped, sep="\n  ")


def test_skip_markers_name_a_reason() -> None:
    """Every skip marker gives its reason, and every fenced block has a language."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in re.finditer(r"<!--\s*skip:(.*?)-->", text):
            assert m[1].strip(), f"{path.name}: a skip marker without a reason"
        fences = re.findall(r"^```(\S*)", text, re.M)
        openers = fences[0::2]
        assert all(openers), f"{path.name}: a code block without a language"


def test_docs_cite_only_the_repository() -> None:
    """No pointer to documents outside the repository, no issue or session numbers."""
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for bad in ("DESIGN.md", "seed eq", "../shared", "NOTES-", "NEXT-DEVICE"):
            assert bad not in text, f"{path.name} mentions {bad!r}"
        assert not re.search(r"\b[Ii]ssue #?\d+|\b[Ss]ession \d+", text), f"{path.name}: an issue/session number"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (path.parent / target).exists(), f"{path.name}: link to missing {target}"


def test_readme_stays_short() -> None:
    """The README is for users: what it is, the two commands, install, support, limitations, two
    tours and the headline numbers; guides and design notes live in docs/."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
