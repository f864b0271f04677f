"""The recipe registry: one training objective per recipe, all run by the same trainer loop.

A recipe names its job config (the components whose keys it accepts), its `Task` (the contract in
pan/recipes/contract.py) and, optionally, its sampler for `pan sample`. A recipe module registers
its preflight checks (`pan.preflight.register_check`) and launch workflows
(`pan.launch_command.register_workflow`) when it is imported.

Recipes outside pan plug in the same way: a module that calls `register_recipe(name, module)` (or
defines `RECIPE` and is named in the registry) listed in the environment variable
`PAN_RECIPE_MODULES` (comma-separated module names) is imported with the registry, in every process.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

# recipe name -> module defining `RECIPE`; imported only when asked for, so loading a config does
# not import every recipe's dependencies.
_MODULES = {
    "pan": "pan.recipes.pan",
    "pyramid_flow": "pan.recipes.pyramid_flow",
    "pyramid_flow_ar": "pan.recipes.pyramid_flow_ar",
    "causal_vae": "pan.recipes.causal_vae",
}
_plugins_loaded = False


@dataclass(frozen=True)
class Recipe:
    name: str
    job_config: type        # a pan.config.JobConfig subclass
    task: type              # a pan.recipes.contract.Task subclass, built as task(job, world, dims, cp)
    description: str
    # `pan sample` for this recipe: "module:function" called as function(job, checkpoint, argv), or
    # None when the recipe has nothing to sample (it is then refused with the reason).
    sample: str | None = None


def register_recipe(name: str, module: str) -> None:
    """Make `name` a recipe whose `RECIPE` lives in `module` (imported when first asked for)."""
    _MODULES[name] = module


def _load_plugins() -> None:
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for module in filter(None, (m.strip() for m in os.environ.get("PAN_RECIPE_MODULES", "").split(","))):
        importlib.import_module(module)


def recipe_names() -> list[str]:
    _load_plugins()
    return sorted(_MODULES)


def get_recipe(name: str) -> Recipe:
    _load_plugins()
    return importlib.import_module(_MODULES[name]).RECIPE
