"""The package's layers (pyproject.toml [tool.importlinter], README "Layout"): import-linter keeps the contract,
breaks it when an upward import is planted in a copy of the package, and the import graph (imports inside
functions included) has no cycle."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
from distributed_harness import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's command on the package found first under ``root``, with ``root``'s contract."""
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([command, "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_the_layer_contract_is_kept():
    out = lint_imports(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "layers KEPT" in out.stdout


def test_a_planted_upward_import_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "lightning_moe", tmp_path / "lightning_moe",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint_imports(tmp_path).returncode == 0  # the copy, untouched, keeps it
    config = tmp_path / "lightning_moe" / "models" / "config.py"
    config.write_text(config.read_text() + "\n\ndef _planted():\n    from lightning_moe.modules import CausalLM\n")
    out = lint_imports(tmp_path)
    assert out.returncode != 0
    assert "lightning_moe.models is not allowed to import lightning_moe.modules" in out.stdout
    assert "lightning_moe.models.config -> lightning_moe.modules" in out.stdout


def strongly_connected(graph) -> list[list[str]]:
    """Tarjan's strongly connected components of the module graph with more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph.modules)))
    try:
        for module in sorted(graph.modules):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_module_imports_itself_through_others():
    graph = grimp.build_graph("lightning_moe", cache_dir=None)
    cycles = strongly_connected(graph)
    described = []
    for component in cycles:
        first = component[0]
        path = graph.find_shortest_chain(importer=first, imported=component[1]) or ()
        back = graph.find_shortest_chain(importer=component[1], imported=first) or ()
        described.append(" -> ".join(list(path) + list(back[1:])))
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_the_cycle_check_finds_a_cycle():
    """The check above can fail: a two-module loop in a throwaway package is reported."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        package = Path(tmp) / "loop_pkg"
        package.mkdir()
        (package / "__init__.py").write_text("")
        (package / "a.py").write_text("def f():\n    from loop_pkg import b\n")
        (package / "b.py").write_text("import loop_pkg.a\n")
        sys.path.insert(0, tmp)
        try:
            graph = grimp.build_graph("loop_pkg", cache_dir=None)
        finally:
            sys.path.remove(tmp)
    assert strongly_connected(graph) == [["loop_pkg.a", "loop_pkg.b"]]
