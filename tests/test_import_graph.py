"""The package's import graph: no circles, and no import that climbs the layers.

Every module of xlstm_kit is read with `ast` (nothing is imported), and every `import` of the
package, at module level, inside functions or under `if TYPE_CHECKING:`, is an edge. The layers,
lowest first (a module may import its own layer and those below it, never one above):

    base         errors, _extras, _version
    ops          Triton kernels and their PyTorch references
    fused        layers/fused*: autograd functions over the kernels, below the layers
    layers       blocks and their states
    models       the config and the nn.Module of each family
    io           checkpoints, HuggingFace folders, official converters, tokenizers
    training     the one training loop and its pieces / generation: decoding
    experiments  the synthetic tasks / bench: the benchmark registry / evaluation: lm-eval's backend
    serve        the HTTP server: scheduler, prefix cache, OpenAI API
    api          the public class with I/O and generation (xlstm_kit.model), the LoRA functions
                 (xlstm_kit.lora), the package's lazy top-level names and the old module paths kept
                 as re-exports
    cli          argument parsing and printing
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "xlstm_kit"

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("xlstm_kit.errors", "xlstm_kit._extras", "xlstm_kit._version")),
    ("ops", ("xlstm_kit.ops",)),
    ("fused", ("xlstm_kit.layers.fused", "xlstm_kit.layers.fused_slstm")),
    ("layers", ("xlstm_kit.layers",)),
    ("models", ("xlstm_kit.models",)),
    ("io", ("xlstm_kit.io",)),
    ("training / generation", ("xlstm_kit.training", "xlstm_kit.generation")),
    ("experiments / bench / evaluation", ("xlstm_kit.experiments", "xlstm_kit.bench", "xlstm_kit.evaluation")),
    ("serve", ("xlstm_kit.serve",)),
    ("api", ("xlstm_kit.model", "xlstm_kit.train", "xlstm_kit.data", "xlstm_kit.generate", "xlstm_kit.checkpoint",
             "xlstm_kit.lora", "xlstm_kit")),
    ("cli", ("xlstm_kit.cli", "xlstm_kit.__main__")),
]


def modules(root: Path = PACKAGE) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_pkg: bool, known: dict) -> list[str]:
    """The package's modules an import statement in module `name` loads (the nearest known module
    for `from pkg import name`, which may be a submodule or a name defined in pkg)."""
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        if node.level:
            base = name.split(".") if is_pkg else name.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        wanted = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
    out = []
    for target in wanted:
        if target.split(".")[0] != "xlstm_kit":
            continue
        while target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        out.append(target)
    return out


def import_graph(root: Path = PACKAGE) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    known = modules(root)
    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_pkg) in known.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, name, is_pkg, known):
                    if target != name:
                        edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest prefix that names `module` or a package above it (the
    package itself, "xlstm_kit", names only its own __init__)."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            below = module.startswith(p + ".") and p != "xlstm_kit"
            if (module == p or below) and p.count(".") > depth:
                best, depth = i, p.count(".")
    return best


def test_every_module_has_a_layer():
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert not missing, f"modules outside every layer (add them to LAYERS): {missing}"


def test_every_package_folder_has_an_init():
    """setuptools' find_packages ships only folders with an __init__.py: one without would import
    from a clone and be missing from the wheel."""
    missing = sorted(str(d.relative_to(PACKAGE.parent)) for d in [PACKAGE, *PACKAGE.rglob("*")]
                     if d.is_dir() and d.name != "__pycache__" and not (d / "__init__.py").is_file())
    assert not missing, f"folders without __init__.py: {missing}"


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_import_climbs_the_layers():
    graph = import_graph()
    climbs = []
    for module, edges in sorted(graph.items()):
        here = layer_of(module)
        for target, line in sorted(edges.items()):
            there = layer_of(target)
            if here is not None and there is not None and there > here:
                climbs.append(f"{module}:{line} ({LAYERS[here][0]}) imports {target} ({LAYERS[there][0]})")
    assert not climbs, "imports that climb the layers:\n" + "\n".join(climbs)


@pytest.mark.parametrize("source,expected", [
    ("from . import b\n", {"pkg.b"}),
    ("def f():\n    from .b import x\n", {"pkg.b"}),
    ("import pkg.b\n", {"pkg.b"}),
])
def test_the_graph_sees_module_and_function_level_imports(tmp_path, source, expected, monkeypatch):
    """The checks read imports inside functions as well as at module level (a lazy import still
    ties two modules together)."""
    pkg = tmp_path / "xlstm_kit"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(source.replace("pkg.", "xlstm_kit."))
    (pkg / "b.py").write_text("from . import a\nx = 1\n")
    graph = import_graph(pkg)
    assert set(graph["xlstm_kit.a"]) == {e.replace("pkg.", "xlstm_kit.") for e in expected}
    assert circles(graph) == [["xlstm_kit.a", "xlstm_kit.b"]]
