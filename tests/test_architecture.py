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


# ------------------------------------------------------------------------------------------------
# No recipe's name steers shared code: a behaviour a recipe needs arrives as a field of its config
# or record, so a new family is a new package and nothing else.
# ------------------------------------------------------------------------------------------------

# The one place outside the recipes that names one: the recipe a config without `recipe:` means.
DEFAULT_RECIPE_HOME = ("pan/config/job.py", "DEFAULT_RECIPE")


def recipe_name_literals(root: Path, names: set[str]) -> list[str]:
    """String constants equal to a recipe's name in the modules of `root` (a package folder) outside
    its recipes/ and recipe.py, but the default recipe's one assignment."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if rel.startswith(f"{root.name}/recipes/") or rel == f"{root.name}/recipe.py":
            continue
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in ast.walk(tree):
            if (rel == DEFAULT_RECIPE_HOME[0] and isinstance(node, ast.Assign)
                    and [getattr(t, "id", None) for t in node.targets] == [DEFAULT_RECIPE_HOME[1]]):
                allowed.add(id(node.value))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in allowed:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_no_recipe_name_is_written_in_shared_code():
    from pan.recipe import recipe_names

    found = recipe_name_literals(ROOT / "pan", set(recipe_names()))
    assert not found, ("recipe names in shared code (give the recipe a config field or a record hook "
                       "instead):\n" + "\n".join(found))


def test_the_recipe_name_rule_finds_one(tmp_path):
    package = tmp_path / "pan"
    (package / "config").mkdir(parents=True)
    (package / "recipes" / "pan").mkdir(parents=True)
    (package / "config" / "job.py").write_text('DEFAULT_RECIPE = "pan"\nOTHER = "pan"\n')
    (package / "trainer.py").write_text('"""pan trains."""\nif job.recipe == "wan":\n    pass\n')
    (package / "recipes" / "pan" / "config.py").write_text('NAME = "pan"\n')
    (package / "recipe.py").write_text('BUILT_IN = {"pan": "pan.recipes.pan"}\n')
    assert recipe_name_literals(package, {"pan", "wan"}) == ["pan/config/job.py:2: 'pan'",
                                                             "pan/trainer.py:2: 'wan'"]


# ------------------------------------------------------------------------------------------------
# The registry refuses a second recipe or workflow under a name already taken.
# ------------------------------------------------------------------------------------------------

def test_a_plugin_cannot_take_a_built_in_recipes_name(monkeypatch, tmp_path):
    import pan.recipe as registry

    (tmp_path / "impostor.py").write_text(
        "from pan.recipe import Recipe\nfrom pan.config import JobConfig\n"
        "RECIPE = Recipe(name='pan', job_config=JobConfig, task='impostor:Task', description='')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.ENV_MODULES, "impostor")
    monkeypatch.setattr(registry, "_modules", None)
    try:
        import pytest

        with pytest.raises(registry.RegistryError) as err:
            registry.recipe_names()
        message = str(err.value)
        assert "'pan'" in message and "built-in" in message and registry.ENV_MODULES in message
        assert "impostor" in message and "pan.recipes.pan" in message
    finally:
        registry._modules = None


def test_two_workflows_of_one_name_are_refused(monkeypatch, tmp_path):
    import pytest

    import pan.recipe as registry
    from pan.config import DEFAULT_RECIPE

    taken = registry.get_recipe(DEFAULT_RECIPE).workflows[0].name
    (tmp_path / "twin.py").write_text(
        "from pan.recipe import Recipe, Workflow\nfrom pan.config import JobConfig\n"
        "RECIPE = Recipe(name='twin', job_config=JobConfig, task='twin:Task', description='',\n"
        f"                workflows=(Workflow({taken!r}, 'twin', 'x.yaml', 'x.sh', 'a twin'),))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.ENV_MODULES, "twin")
    monkeypatch.setattr(registry, "_modules", None)
    try:
        with pytest.raises(registry.RegistryError) as err:
            registry.all_workflows()
        assert "'twin'" in str(err.value) and repr(DEFAULT_RECIPE) in str(err.value)
    finally:
        registry._modules = None


def test_the_cli_refuses_a_name_conflict_without_a_traceback(tmp_path):
    (tmp_path / "impostor.py").write_text(
        "from pan.recipe import Recipe\nfrom pan.config import JobConfig\n"
        "RECIPE = Recipe(name='pan', job_config=JobConfig, task='impostor:Task', description='')\n")
    import os

    env = {**os.environ, "PAN_RECIPE_MODULES": "impostor", "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "pan.cli", "check", "--config", "config/tiny_cpu.yaml"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "two recipes are named 'pan'" in done.stderr and "Traceback" not in done.stderr


# ------------------------------------------------------------------------------------------------
# The layer contract catches an engine importing a sibling of its layer.
# ------------------------------------------------------------------------------------------------

def test_the_layer_contract_catches_a_sibling_import(tmp_path):
    import os

    shutil.copytree(ROOT / "pan", tmp_path / "pan", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    flow = tmp_path / "pan" / "diffusion" / "flow.py"
    flow.write_text(flow.read_text() + "\nimport pan.runtime.metrics  # planted: a sibling of its layer\n")
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or "lint-imports"
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([lint, "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "pan.diffusion.flow -> pan.runtime.metrics" in done.stdout, done.stdout[-3000:]


def test_files_stay_short_and_the_root_shows_the_layers():
    """No module of pan over 600 lines (a file with several jobs splits along them), and the root
    holds what a newcomer reads first: at most 9 modules beside its packages."""
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in sorted((ROOT / "pan").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600]
    assert not long, "files over 600 lines:\n" + "\n".join(long)
    root = sorted(p.name for p in (ROOT / "pan").glob("*.py") if p.name != "__init__.py")
    assert len(root) <= 9, f"{len(root)} modules at pan/'s root: {root}"
