"""The recipe registry: what each recipe gives pan, named lazily, and where recipes are found.

A recipe is one package that defines `RECIPE = Recipe(...)` in its `__init__`. The record names the
job config class (needed to load a config, so the recipe's config module stays light) and every
other hook as a `"module:attribute"` string, imported only by the command that uses it:

    hook        used by                    what it names
    ----        -------                    -------------
    task        trainer, pan check, ...    the Task class, built as Task(job, world, dims, cp)
    checks      pan check, train.py        a list of checks, in the order of `pan check`'s table
    probe       pan check (memory, time)   probe(Preflight) -> pan.estimate.Probe
    sample      pan sample                 sample(job, argv) -> exit code
    exports     pan export --format NAME   export(checkpoint_dir, out, *, ema) -> the path written
    precompute  pan data precompute        precompute(job) -> pan.data.precompute.PrecomputeFormat
    workflows   pan launch-command         Workflow records (their `check` is lazy too)
    demo        pan demo --recipe NAME     demo(argv) -> exit code

Where recipes come from, in this order: the built-in ones (pan/recipes/), installed packages that
declare an entry point in the group `pan.recipes` (`name = "module"`), and the modules listed in the
environment variable `PAN_RECIPE_MODULES` (comma-separated), each defining `RECIPE`. Nothing is
registered by importing a module: what a recipe offers is what its record says.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

ENTRY_POINT_GROUP = "pan.recipes"
ENV_MODULES = "PAN_RECIPE_MODULES"
# recipe name -> the package defining `RECIPE`; imported only when asked for, so loading a config
# does not import every recipe's dependencies.
BUILT_IN = {
    "pan": "pan.recipes.pan",
    "pyramid_flow": "pan.recipes.pyramid_flow",
    "pyramid_flow_ar": "pan.recipes.pyramid_flow_ar",
    "causal_vae": "pan.recipes.causal_vae",
    "wan": "pan.recipes.wan",
}


@dataclass(frozen=True)
class Workflow:
    """A launch workflow of `pan launch-command` (and its Slurm script)."""
    name: str
    recipe: str                      # the recipe its configs must name
    default_config: str              # repository-relative YAML
    script: str                      # the Slurm launch script (scripts/<name>.sh)
    description: str
    # A workflow-specific rule, "module:function" called as function(job, dims): raises ConfigError.
    # For a stage after the first of `--stage both` it is called with previous=<that stage's job>.
    check: str | None = None
    # A workflow run in stages (the causal VAE's): stage name -> its default YAML, in order.
    stages: dict[str, str] | None = None


@dataclass(frozen=True)
class Recipe:
    name: str
    job_config: type        # a pan.config.JobConfig subclass
    task: str               # "module:Class" of its pan.task.Task
    description: str
    checks: str | None = None
    probe: str | None = None
    sample: str | None = None
    exports: dict[str, str] = field(default_factory=dict)
    precompute: str | None = None
    workflows: tuple[Workflow, ...] = ()
    demo: str | None = None

    def hook(self, name: str) -> Any:
        """The object a hook names (imported now); None when the recipe does not offer it."""
        spec = getattr(self, name)
        return None if spec is None else resolve(spec)

    def build_task(self, job, world, dims, cp=None):
        return resolve(self.task)(job, world, dims, cp)


def resolve(spec: str) -> Any:
    """`"package.module:attribute"` -> that attribute (`"package.module"` -> the module)."""
    module, _, attribute = spec.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attribute) if attribute else obj


class RegistryError(ValueError):
    """Two recipes (or two workflows) under one name: which one a config means is undecidable."""


_modules: dict[str, str] | None = None


def _register(found: dict[str, str], name: str, module: str, source: str, sources: dict[str, str]) -> None:
    """Add `name -> module`, refusing a name already taken (a plugin never silently replaces a recipe)."""
    if name in found and found[name] != module:
        raise RegistryError(f"two recipes are named {name!r}: {sources[name]} ({found[name]}) and {source} "
                            f"({module}). Rename one (its RECIPE.name and its entry point), or uninstall it.")
    found[name], sources[name] = module, source


def _discover() -> dict[str, str]:
    """name -> module of every recipe: built in, entry points, then PAN_RECIPE_MODULES."""
    global _modules
    if _modules is None:
        found: dict[str, str] = {}
        sources: dict[str, str] = {}
        for name, module in BUILT_IN.items():
            _register(found, name, module, "pan's built-in recipes", sources)
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            _register(found, ep.name, ep.value.partition(":")[0],
                      f"the entry point {ep.name!r} of {ep.dist.name if ep.dist else 'an installed package'}", sources)
        for module in filter(None, (m.strip() for m in os.environ.get(ENV_MODULES, "").split(","))):
            _register(found, importlib.import_module(module).RECIPE.name, module, f"{ENV_MODULES}", sources)
        _modules = found
    return _modules


def recipe_names() -> list[str]:
    return sorted(_discover())


def get_recipe(name: str) -> Recipe:
    recipe = importlib.import_module(_discover()[name]).RECIPE
    if recipe.name != name:
        raise RegistryError(f"recipe {name!r} is registered for {_discover()[name]}, whose RECIPE is "
                            f"named {recipe.name!r}")
    return recipe


def all_workflows() -> dict[str, Workflow]:
    """Every recipe's launch workflows by name; a name two recipes give is refused."""
    found: dict[str, Workflow] = {}
    for name in recipe_names():
        for workflow in get_recipe(name).workflows:
            if workflow.name in found:
                raise RegistryError(f"two launch workflows are named {workflow.name!r}: one of recipe "
                                    f"{found[workflow.name].recipe!r} and one of recipe {workflow.recipe!r} "
                                    f"({_discover()[name]}). Rename one of them.")
            found[workflow.name] = workflow
    return found
