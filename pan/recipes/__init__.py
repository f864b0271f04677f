"""The recipe registry: one training objective per recipe, all run by the same trainer loop.

A recipe names its job config (the components whose keys it accepts) and how to build what it
trains. Pyramid-Flow's full-sequence and autoregressive recipes and the causal VAE register here
when they land.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

# recipe name -> module defining `RECIPE`; imported only when asked for, so loading a config does
# not import every recipe's dependencies.
_MODULES = {
    "pan": "pan.recipes.pan",
}


@dataclass(frozen=True)
class Recipe:
    name: str
    job_config: type        # a pan.config.JobConfig subclass
    task: type              # built as task(job, world, dims, cp): model, data, loss (see PanTask)
    description: str


def recipe_names() -> list[str]:
    return sorted(_MODULES)


def get_recipe(name: str) -> Recipe:
    return importlib.import_module(_MODULES[name]).RECIPE
