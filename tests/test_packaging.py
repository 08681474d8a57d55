"""`pip install xlstm-kit` gives a working command line: the wheel built from this tree,
installed into a fresh virtual environment that sees only the dependencies the wheel declares,
trains and generates from a folder outside the repository.

The fresh environment gets no packages from PyPI (offline, seconds): each declared dependency,
and theirs in turn, is taken from the environment running the tests and linked into a folder
that the new environment puts on its path. Nothing else is visible there, so a module that
xlstm_kit imports but pyproject.toml does not declare fails the run, as it would for a user.
"""
from __future__ import annotations

import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from xlstm_kit import _extras

ROOT = Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]


def dependency_closure(requirements: list[str], extras: tuple[str, ...] = ()) -> dict[str, md.Distribution]:
    """The installed distributions that ``requirements`` (Requires-Dist lines) need, with their
    own requirements, recursively; markers are evaluated for this interpreter. Fails when one is
    not installed or its version does not satisfy the requirement."""
    found: dict[str, md.Distribution] = {}
    done: set[tuple[str, tuple[str, ...]]] = set()  # a package asked for again with other extras
    todo = [(Requirement(r), extras) for r in requirements]
    while todo:
        req, wanted_extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *wanted_extras)):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req} is declared but not installed in the test environment")
        assert req.specifier.contains(dist.version, prereleases=True), f"installed {name} {dist.version} violates {req}"
        if (name, tuple(sorted(req.extras))) in done:
            continue
        done.add((name, tuple(sorted(req.extras))))
        found[name] = dist
        todo += [(Requirement(r), tuple(req.extras)) for r in dist.requires or []]
    return found


def link_site(dists: dict[str, md.Distribution], folder: Path) -> None:
    """Symlink the top-level files and folders of ``dists`` (from their RECORD) into ``folder``."""
    folder.mkdir()
    for name, dist in dists.items():
        assert dist.files is not None, f"{name} has no RECORD; cannot tell its files"
        tops = {f.parts[0] for f in dist.files if f.parts[0] != ".." and not f.name.endswith(".pth")}
        for top in tops:
            src = Path(dist.locate_file(top))
            if src.exists() and not (folder / top).exists():
                (folder / top).symlink_to(src)


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of this tree, built without network (setuptools of the test environment)."""
    base = tmp_path_factory.mktemp("wheel")
    src = base / "src"  # build from a copy: an in-tree build would leave build/ and *.egg-info
    shutil.copytree(ROOT / "xlstm_kit", src / "xlstm_kit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    proc = subprocess.run([*PIP, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(base), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return next(base.glob("xlstm_kit-*.whl"))


def test_extras_match_the_code(wheel):
    """Every optional module the code asks for through xlstm_kit._extras is in the extra its
    error message names, none is a core dependency, and [all] brings every feature extra."""
    reqs = [Requirement(r) for r in wheel_requirements(wheel)]
    core = {canonicalize_name(r.name) for r in reqs if r.marker is None or "extra" not in str(r.marker)}

    def in_extra(extra):
        return {canonicalize_name(r.name) for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})}

    for module, extra in _extras.EXTRA_OF.items():
        assert canonicalize_name(module) in in_extra(extra), (module, extra)
        assert canonicalize_name(module) not in core, module
    everything = set().union(*(in_extra(e) for e in set(_extras.EXTRA_OF.values())))
    all_reqs = [r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": "all"})]
    assert all_reqs and {canonicalize_name(r.name) for r in all_reqs} <= {"xlstm-kit"} | everything
    assert set().union(*(r.extras for r in all_reqs)) >= set(_extras.EXTRA_OF.values())


def test_missing_extra_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(_extras.EXTRA_OF, "xlstm_kit_absent_pkg", "gpt2")
    with pytest.raises(_extras.MissingExtraError) as e:
        _extras.require("xlstm_kit_absent_pkg", "--tokenizer gpt2")
    assert str(e.value) == "--tokenizer gpt2 needs the extra: pip install 'xlstm-kit[gpt2]'"
    with pytest.raises(_extras.MissingExtraError, match=r"xlstm-kit\[gpt2\]"):
        _extras.package_dir("xlstm_kit_absent_pkg", "--tokenizer gpt2")
    # An installed but broken package keeps its own error (it is not a missing extra).
    (tmp_path / "xlstm_kit_broken_pkg").mkdir()
    (tmp_path / "xlstm_kit_broken_pkg" / "__init__.py").write_text("import xlstm_kit_absent_inner\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(_extras.EXTRA_OF, "xlstm_kit_broken_pkg", "gpt2")
    with pytest.raises(ModuleNotFoundError) as e:
        _extras.require("xlstm_kit_broken_pkg", "--tokenizer gpt2")
    assert not isinstance(e.value, _extras.MissingExtraError) and e.value.name == "xlstm_kit_absent_inner"


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """A fresh venv with the wheel of this tree and only its declared dependencies."""
    base = tmp_path_factory.mktemp("pip")
    deps = dependency_closure(wheel_requirements(wheel))
    link_site(deps, base / "deps")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    purelib = subprocess.run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "_declared_deps.pth").write_text(str(base / "deps") + "\n")
    # --no-index: pip must find every requirement already satisfied by the linked folder.
    proc = subprocess.run([*PIP, "--python", str(vpy), "install", "-q", "--no-index", "--no-cache-dir", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "XLSTM_KIT", "PIP_"))}
    env.update(PYTHONNOUSERSITE="1", XLSTM_KIT_CACHE=str(base / "cache"), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    work = base / "work"
    work.mkdir()
    return venv, env, work, deps


def _run(installed, *cmd, timeout=300):
    venv, env, work, _ = installed
    return subprocess.run(list(cmd), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def test_fresh_venv_sees_only_declared_dependencies(installed):
    venv, _, _, deps = installed
    assert "torch" in deps and "numpy" in deps
    probe = _run(installed, str(venv / "bin" / "python"), "-c",
                 "import xlstm_kit, importlib.util as u; print(xlstm_kit.__file__); "
                 "print([m for m in ('matplotlib', 'tokenizers', 'pytest', 'triton') if u.find_spec(m)])")
    assert probe.returncode == 0, probe.stderr
    where, visible = probe.stdout.splitlines()
    assert Path(where).resolve().is_relative_to(venv.resolve())  # the wheel, not this checkout
    # Undeclared packages are invisible there: what makes a missing declaration fail below.
    assert visible == "[]"
    check = _run(installed, *PIP, "--python", str(venv / "bin" / "python"), "check")
    assert check.returncode == 0, check.stdout + check.stderr


def test_installed_cli_trains_and_generates(installed):
    exe = str(installed[0] / "bin" / "xlstm-kit")
    train = _run(installed, exe, "train", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                 "--eval-batches", "1", "--no-progress", "--threads", "1", "--out", "run")
    assert train.returncode == 0, train.stderr
    assert "done: step 3" in train.stderr and "Traceback" not in train.stderr
    # No matplotlib in a base install: the plot is skipped with a note naming the extra.
    assert "pip install 'xlstm-kit[plot]'" in train.stderr
    gen = _run(installed, exe, "generate", "run", "--prompt", "ROMEO:", "--max-new-tokens", "20", "--seed", "0")
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("ROMEO:") and len(gen.stdout) > len("ROMEO:") + 5
    gpt2 = _run(installed, exe, "train", "--tokenizer", "gpt2", "--steps", "1", "--out", "run2")
    assert gpt2.returncode == 2
    assert gpt2.stderr.strip() == ("xlstm-kit train: error: --tokenizer gpt2 needs the extra: "
                                   "pip install 'xlstm-kit[gpt2]'")
    tasks = _run(installed, exe, "eval", "run", "--tasks", "arc_easy")  # lm-eval comes with the [eval] extra
    assert tasks.returncode == 2
    assert tasks.stderr.strip() == ("xlstm-kit eval: error: --tasks (lm-evaluation-harness) needs the extra: "
                                    "pip install 'xlstm-kit[eval]'")


def test_triton_extra_is_bounded_to_the_tested_versions():
    """The `triton` extra admits the versions the kernels run under (the GPU machines' 3.6, the
    Makefile's pin for the CPU interpreter) and no later minor release (3.9's interpreter
    refuses the kernels' masks)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement

    root = Path(__file__).resolve().parent.parent
    spec = Requirement(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
                       ["triton"][0]).specifier
    pinned = re.search(r"triton==([0-9.]+)", (root / "Makefile").read_text()).group(1)
    assert spec.contains("3.6.0") and spec.contains(pinned)
    assert not spec.contains("3.9.0") and not spec.contains("3.8.0")
