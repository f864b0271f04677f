"""The shape of the house, checked on every run: the import rules in pyproject.toml
([tool.importlinter]: commands over recipes over the framework over the engines; recipe packages
stand alone) hold, and no module of pan imports itself back through any chain, function-level
imports included."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycles_anywhere_in_pan():
    graph = grimp.build_graph("pan", cache_dir=None)
    found = cycles(graph)
    chains = [" -> ".join(graph.find_shortest_chain(c[0], c[1]) or c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(chains)


def test_the_cycle_finder_finds_a_cycle(tmp_path, monkeypatch):
    package = tmp_path / "loopy"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from loopy import b\n")
    (package / "b.py").write_text("import loopy.c\n")
    (package / "c.py").write_text("import loopy.a\n")
    (package / "d.py").write_text("import loopy.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles(grimp.build_graph("loopy", cache_dir=None)) == [["loopy.a", "loopy.b", "loopy.c"]]


def test_the_import_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


def lazy_imports_without_reason(root: Path) -> list[str]:
    """Imports of pan's own modules inside functions whose line (or the line above) carries no
    comment saying why the import waits: the import graph should be read at the top of a file."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for inner in ast.walk(node):
                names = ([a.name for a in inner.names] if isinstance(inner, ast.Import) else
                         [inner.module or ""] if isinstance(inner, ast.ImportFrom) and not inner.level else [])
                if not any(n == "pan" or n.startswith("pan.") for n in names):
                    continue
                here, above = lines[inner.lineno - 1], lines[inner.lineno - 2].strip()
                if "#" not in here and not above.startswith("#"):
                    found.append(f"{path.relative_to(root.parent)}:{inner.lineno}: {here.strip()}")
    return found


def test_function_level_imports_of_pan_say_why():
    found = lazy_imports_without_reason(ROOT / "pan")
    assert not found, "lazy imports of pan modules without a reason:\n" + "\n".join(found)


def test_the_lazy_import_rule_finds_one(tmp_path):
    package = tmp_path / "pan"
    package.mkdir()
    (package / "a.py").write_text("def f():\n    from pan import b\n\n\ndef g():\n"
                                  "    import pan.c  # lazy: why\n    import json\n")
    assert lazy_imports_without_reason(package) == ["pan/a.py:2: from pan import b"]
